"""Atomic file replacement: the one way kvmem rewrites a small file it keeps (state, journal, index).

A reader sees the old file or the new one, never half of either: the bytes go to a temporary
file beside ``path`` (``.<name>.<random>.tmp``, so a crashed writer's leftover matches no
``<name>*`` pattern), which is then renamed over ``path``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: Path, data: bytes | memoryview | str, *, durable: bool) -> None:
    """Replace ``path`` with ``data`` atomically; its directory is made when missing.

    Args:
        path: the file to replace (or create).
        data: its new content; a ``str`` is written as UTF-8.
        durable: fsync the file before the rename and the directory after it, so the new
            content survives a power loss once this returns; without it the replacement is
            atomic but may be lost (the old file comes back) on a power loss.

    Raises:
        OSError: the write or the rename failed; ``path`` is unchanged and the temporary file gone.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
