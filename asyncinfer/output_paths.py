"""Where a file named by its user is written: the file the path names, not the link.

A download or a results file goes whole into place by a rename (`<path>.part` renamed over the
path), and a rename replaces the last component of the path it is given. Given a symbolic link,
it would replace the link and leave the file behind it as it was; given `/dev/stdout` with the
shell's output sent to a file (the link `/proc/self/fd/1` then names a regular file), it replaced
`/dev/stdout` itself, as root, with the output in it, for every program on the machine. So a
path is first followed to what it names: one of this process's own descriptors (`/dev/stdout`,
`/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`), written through as it is, or the file at the
end of its links.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

_DESCRIPTOR = re.compile(r"/(?:proc/self|dev)/fd/(\d+)")
_MAX_LINKS = 40  # Linux's own bound (ELOOP) on the links a path may go through


def descriptor_or_file(path: str | os.PathLike[str]) -> int | Path:
    """The descriptor of this process that the path names through its links (`/dev/stdout` is 1),
    or the absolute path of the file at the end of its links (the path itself when it is no link;
    a link to nothing yet gives where the file would be made, as the shell's `>` does)."""
    current = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        found = _DESCRIPTOR.fullmatch(current)
        if found is not None:
            return int(found.group(1))
        if not os.path.islink(current):
            break
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
    return Path(os.path.realpath(current))


def is_special(path: Path) -> bool:
    """Whether the path exists and is not a regular file or folder (a device, a FIFO, a socket):
    written as it is, since a file renamed over it would replace it (`/dev/null`)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)
