"""An app's module is imported off the event loop (services.apps.import_app_module): importing the
gateway's, the scheduler's or the console's held the loop 0.2-0.3 s, and in `up` the services
already started (and a stop signal) waited for it."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from pathlib import Path

import pytest

from services.apps import APP_MODULES, import_app_module

pytestmark = pytest.mark.unit


async def test_an_apps_module_is_imported_while_the_event_loop_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The module's import waits until the loop has run a callback (10 s at most: an import on the
    # loop would wait that long, and then say it waited in vain).
    gate = types.ModuleType("import_gate")
    gate.loop_ran = threading.Event()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "import_gate", gate)
    (tmp_path / "slow_app_module.py").write_text("import import_gate\n\nLOOP_RAN = import_gate.loop_ran.wait(10)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(APP_MODULES, "slow", "slow_app_module")
    try:
        asyncio.get_running_loop().call_soon(gate.loop_ran.set)  # type: ignore[attr-defined]
        await import_app_module("slow")
        assert sys.modules["slow_app_module"].LOOP_RAN
    finally:
        sys.modules.pop("slow_app_module", None)
