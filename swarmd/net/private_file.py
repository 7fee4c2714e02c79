"""Reading a small secret file (the identity key, the swarm key) the careful way."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from swarmd.errors import SwarmError


def read_private_file(
    path: Path, what: str, max_bytes: int, forbidden_mode: int, error: type[SwarmError]
) -> bytes:
    """At most max_bytes + 1 bytes of `path` (so the caller can tell "too large").

    Refuses, with `error` naming the file: anything but a regular file (O_NONBLOCK: a
    FIFO in its place must not hang the start-up), and a file whose mode has any of the
    `forbidden_mode` bits (with how to fix it). FileNotFoundError is left to the caller.
    """
    flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"Cannot read the {what} {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"The {what} {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & forbidden_mode:
            who = "group or others" if forbidden_mode & 0o070 else "other users"
            raise error(
                f"The {what} {path} has mode {mode:04o}: {who} can access it. "
                f"Fix it with: chmod 600 {path}"
            )
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"Cannot read the {what} {path}: {exc}") from exc
    finally:
        os.close(fd)
