"""File I/O of the disk tier: vectored reads and writes, mtime stamps, directory fsync. No kvmem state."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from kvmem import blob as blobfmt

__all__ = ["CREATE", "IOV_MAX", "fsync_dir", "open_or_none", "pid_alive", "read_into", "stamp", "write_all"]

CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL
IOV_MAX = 512
_READ_STEP = 1 << 20  # verified reads go in 1 MiB steps, each checked while it is still in cache


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_or_none(path: str) -> int | None:
    """A read-only descriptor of ``path``, or ``None`` if there is no such file."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None


def stamp(path: str | Path) -> None:
    """Set ``path``'s mtime from the nanosecond clock.

    NOTE: the kernel stamps writes with a coarse clock (ticks of a few ms), so files
    written in one tick would tie and reopen in key order, not LRU order.
    """
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def read_into(fd: int, dst: np.ndarray, checker: blobfmt.StreamVerifier | None) -> int:
    """Fill ``dst`` from ``fd`` in ``_READ_STEP`` steps, feeding ``checker`` after each; bytes read.

    A file that shrank under us yields fewer bytes than ``dst`` holds; the checker
    then fails it like any other truncation.
    """
    view, size = memoryview(dst), dst.size
    step = _READ_STEP if checker is not None else size
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:got + step]])
        if n == 0:
            break
        got += n
        if checker is not None:
            checker.feed(dst, got)
    return got


def write_all(fd: int, parts: list) -> None:
    """Write every byte of ``parts`` (uint8 arrays) with ``writev``, resuming after short writes."""
    views = [memoryview(p).cast("B") for p in parts if p.size]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def fsync_dir(directory: Path) -> None:
    """fsync a directory, so the names created or renamed in it are durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
