"""The `asyncinfer` command's entry point: nothing but a quiet Ctrl-C while the real one loads.

Importing services.cli (structlog, rich, pydantic, the configuration) takes most of a second; a
Ctrl-C in it printed a traceback of 30-50 lines and exited 1 (pydantic wraps the KeyboardInterrupt
in a RuntimeError), which scripts read as "a job ended other than SUCCEEDED". Until the import is
done, SIGINT ends the process with 130, as a shell reports a Ctrl-C; then the command's own handling
takes over.

The handler is set with `_signal`, the interpreter's built-in module, before anything is imported:
`import signal` alone imports enum, functools and collections (~15 ms), and a Ctrl-C in them
printed a traceback (5 of 48 tries 30-70 ms after the start). What is left before the handler is
Python's own start-up (site and its .pth files), which Python reports.
"""

import _signal  # type: ignore[import-not-found]  # no stub: signal.py re-exports it
import os
import sys

EXIT_INTERRUPTED = 130


def _interrupted_while_loading(_signum: int, _frame: object) -> None:
    os._exit(EXIT_INTERRUPTED)  # nothing is open yet: no output to flush, no file half written


def main() -> int:
    # A process started with SIGINT ignored (a background job of a script) keeps ignoring it.
    ignored = _signal.getsignal(_signal.SIGINT) == _signal.SIG_IGN
    if not ignored:
        _signal.signal(_signal.SIGINT, _interrupted_while_loading)
    from services.cli import main as command

    try:
        if not ignored:
            _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        return command(sys.argv[1:])
    except KeyboardInterrupt:  # between the handler's restore and the command's own handling
        return EXIT_INTERRUPTED
