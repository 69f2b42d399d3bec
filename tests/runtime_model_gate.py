"""A model factory whose load fails once the test lets it (its own module, so that the batcher's
import of the factory and the test share one event: pytest may import a test file under another
module name)."""

from __future__ import annotations

import threading
from typing import Any

LOADING_MAY_FAIL = threading.Event()
WAIT_S = 60.0


def failing_after_its_announcement() -> Any:
    """Fails once let go: its load is announced (LOADING) before it fails."""
    LOADING_MAY_FAIL.wait(WAIT_S)
    raise RuntimeError("this model cannot load")
