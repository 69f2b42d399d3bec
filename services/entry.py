"""The `asyncinfer` command's entry point: nothing but a quiet Ctrl-C while the real one loads.

Importing services.cli (structlog, rich, pydantic, the configuration) takes most of a second; a
Ctrl-C in it printed a traceback of 30-50 lines and exited 1 (pydantic wraps the KeyboardInterrupt
in a RuntimeError), which scripts read as "a job ended other than SUCCEEDED". Until the import is
done, SIGINT ends the process with 130, as a shell reports a Ctrl-C; then the command's own handling
takes over.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

EXIT_INTERRUPTED = 130


def _interrupted_while_loading(_signum: int, _frame: FrameType | None) -> None:
    os._exit(EXIT_INTERRUPTED)  # nothing is open yet: no output to flush, no file half written


def main() -> int:
    # A process started with SIGINT ignored (a background job of a script) keeps ignoring it.
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if not ignored:
        signal.signal(signal.SIGINT, _interrupted_while_loading)
    from services.cli import main as command

    if not ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return command(sys.argv[1:])
