"""File I/O of the disk tier: vectored reads and writes, temporary files, mtime stamps, directory fsync.
No kvmem state."""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np

from kvmem import blob as blobfmt
from kvmem.libc import libc_function
from kvmem.rows import steps

__all__ = [
    "CREATE",
    "IOV_MAX",
    "advance",
    "fsync_dir",
    "open_or_none",
    "pid_alive",
    "preadv_all",
    "pwrite_all",
    "read_into",
    "remove_stray_tmp",
    "stamp",
    "write_blob",
    "write_tmp",
]

log = logging.getLogger(__name__)

CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL
IOV_MAX = 512
_READ_STEP = 1 << 20  # verified reads go in 1 MiB steps, each checked while it is still in cache
_WRITEBACK_EVERY = 8 << 20  # a write that will be fsynced starts the writeback of each 8 MiB it has written


def _writeback_starter() -> Callable[[int, int, int], object] | None:
    """``start(fd, offset, nbytes)``: begin writing that range of a file's dirty pages to the disk without waiting
    for it (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), or ``None`` where there is no such call.

    NOTE: through ctypes, which releases the GIL for the call. It promises nothing: the fsync after it does.
    """
    call = libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    if call is None:
        return None
    return lambda fd, offset, nbytes: call(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


_SYNC_FILE_RANGE_WRITE = 2
_START_WRITEBACK = _writeback_starter()


_tmp_ids = itertools.count()  # per process: a temporary file is named <key>.<pid>.<n>.tmp


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


def write_tmp(path: Path, key: str, blob: blobfmt.EncodedBlob, fsync: bool) -> Path:
    """``blob`` written (and fsynced with ``fsync``) to a new temporary file beside ``path``; the file."""
    tmp = path.with_name(f"{key}.{os.getpid()}.{next(_tmp_ids)}.tmp")
    try:
        fd = os.open(tmp, CREATE, 0o644)
    except FileNotFoundError:  # the first entry of its shard: make the directory (once, not per put)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, CREATE, 0o644)
    try:
        write_blob(fd, blob, durable=fsync)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    stamp(tmp)
    return tmp


def remove_stray_tmp(entry: os.DirEntry[str]) -> None:
    """Delete a temporary file (from :func:`write_tmp`) left by a crashed writer (never one of a live process)."""
    parts = entry.name.split(".")
    pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
    if pid is not None and pid != os.getpid() and pid_alive(pid):
        return
    try:
        os.unlink(entry.path)
        log.info("kvmem: removed %s left by an interrupted write", entry.path)
    except FileNotFoundError:
        pass


def read_into(fd: int, dst: np.ndarray, checker: blobfmt.StreamVerifier | None) -> int:
    """Fill ``dst`` from ``fd`` in ``_READ_STEP`` steps, feeding ``checker`` after each; bytes read.

    A file that shrank under us yields fewer bytes than ``dst`` holds; the checker
    then fails it like any other truncation.
    """
    view, size = dst.data, dst.size
    step = _READ_STEP if checker is not None else size
    got = 0
    while got < size:
        n = os.readv(fd, [view[got : got + step]])
        if n == 0:
            break
        got += n
        if checker is not None:
            checker.feed(dst, got)
    return got


def write_blob(fd: int, blob: blobfmt.EncodedBlob, durable: bool = False) -> None:
    """Write ``blob`` at the start of the new file ``fd``: sealed, or sealed in the same pass as the write.
    ``durable``: the file is fsynced next, so its payload's writeback starts while the rest is written.

    NOTE: an unsealed blob's segments are written ``_READ_STEP`` at a time, each step
    CRC'd right before ``pwritev`` copies it while it is still in cache; its head, whose
    CRC slots that fills, is written last. A durable write starts the writeback of every
    ``_WRITEBACK_EVERY`` bytes of payload written, so the disk works while the CPU checksums
    and copies the rest and the fsync waits for the tail only: 537 MB in 16 files on 4 threads
    took 0.245 s so against 0.313 s with the fsync alone (raw write + fsync: 0.291 s); ranges of
    4 MiB did the same (0.219 against 0.302 s, raw 0.258 s, in another run).
    """
    if blob.sealed:
        pwrite_all(fd, list(blob.parts), 0)
        return
    assert blob.header is not None
    pwrite_all(fd, [blob.head], 0)  # in file order (the CRCs are rewritten below): its blocks lie in order
    start_writeback = _START_WRITEBACK if durable else None
    offset = started = blob.start  # NOTE: the head is written again at the end: its pages are left for the fsync
    crcs = []
    for i in range(len(blob.header["segments"])):
        crc = 0
        for group in steps(blob.segment_rows(i), _READ_STEP):
            for row in group:
                crc = crc32c.crc32c(row.data, crc)
            offset += pwrite_all(fd, group, offset)
            if start_writeback is not None and offset - started >= _WRITEBACK_EVERY:
                start_writeback(fd, started, offset - started)
                started = offset
        crcs.append(crc)
    blob.seal(crcs)
    pwrite_all(fd, [blob.head], 0)


def pwrite_all(fd: int, parts: list[np.ndarray], offset: int) -> int:
    """Write every byte of ``parts`` at ``offset`` with ``pwritev``, resuming after short writes; bytes written."""
    views = [p.data.cast("B") for p in parts if p.size]
    total = sum(len(v) for v in views)
    while views:  # at most IOV_MAX buffers per call
        n = os.pwritev(fd, views[:IOV_MAX], offset)
        offset += n
        advance(views, n)
    return total


def preadv_all(fd: int, rows: list[np.ndarray], offset: int) -> int:
    """Fill ``rows`` from ``fd`` at ``offset`` with ``preadv``, resuming after short reads; bytes read
    (fewer only at the end of the file)."""
    views = [r.data for r in rows if r.size]
    total = 0
    while views:
        n = os.preadv(fd, views[:IOV_MAX], offset)
        if n == 0:
            break
        total += n
        offset += n
        advance(views, n)
    return total


def advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from the buffers ``views`` (after a short read or write moved them)."""
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
