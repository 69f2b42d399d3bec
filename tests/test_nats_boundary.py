"""The NATS adapter's boundary, read off the source tree: no module in asyncinfer/ or services/
outside asyncinfer/nats/ imports nats-py, and nats-py's private names appear in one file only,
the adapter's fast path (asyncinfer/nats/_fastpath.py), anywhere in the code, tests or benchmarks
(this file aside)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "asyncinfer" / "nats"
FAST_PATH = ADAPTER / "_fastpath.py"
THIS_TEST = Path(__file__).resolve()  # it names them, to find them
GENERATED = ROOT / "asyncinfer" / "v1"

# nats-py's private names that code has reached for (Client, JetStreamContext, KeyValue and the kv
# module), and the mutation of a client's options after connect. Our own classes' `self._nc`,
# `self._js`, `self._stream` and `self._timeout` are not nats-py's, hence `(?<!self)`; nothing of
# ours is called `_pre` or `_prefix`.
PRIVATE_NATS_PY = re.compile(
    r"\b(_resp_map|_resp_sub_prefix|_init_request_sub|_nuid|_is_key_valid|_send_command|_flush_pending"
    r"|_flush_queue|_pending_data_size|_max_pending_size|_max_payload|_skip_subject_validation)\b"
    r"|\._(pre|prefix)\b"
    r"|(?<!self)\._(nc|js|stream|timeout|direct)\b"
    r"|\.options\["
)


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if GENERATED not in p.parents)


def imports_nats_py(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name == "nats" or name.startswith("nats.") for name in names):
            lines.append(node.lineno)
    return lines


def test_only_the_adapter_imports_nats_py() -> None:
    found = {
        str(path.relative_to(ROOT)): lines
        for path in python_files("asyncinfer", "services")
        if ADAPTER not in path.parents and (lines := imports_nats_py(ast.parse(path.read_text(), str(path))))
    }
    assert found == {}
    # The check can see an import: the adapter has them.
    assert imports_nats_py(ast.parse((ADAPTER / "__init__.py").read_text()))


def test_private_nats_py_names_appear_only_in_the_fast_path() -> None:
    found = {
        f"{path.relative_to(ROOT)}:{number}": line.strip()
        for path in python_files("asyncinfer", "services", "tests", "bench")
        if path not in (FAST_PATH, THIS_TEST)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_NATS_PY.search(line)
    }
    assert found == {}
    # The pattern finds what the fast path uses.
    assert PRIVATE_NATS_PY.search(FAST_PATH.read_text())
