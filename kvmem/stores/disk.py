"""The disk tier: one file per blob, atomic writes, an LRU index rebuilt on open.

Layout under ``root``::

    blobs/<first two hex digits>/<key>.kvb     committed entries
    blobs/<..>/<key>.<pid>.<n>.tmp             a write in progress
    quarantine/<key>.<unix time>.kvb           entries that failed their CRC

A write goes to a temporary file, is fsynced (per ``fsync``), then renamed over
the entry: a crash leaves the old entry or the new one, never half of one.
The LRU order is the files' mtimes (a write or a hit stamps the file with the
nanosecond clock), so the index rebuilt by scanning on open keeps the order
across restarts. Several processes may share a root: ``get`` opens the file
itself rather than trusting this process's index.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob, empty_buffer
from kvmem.keys import is_storage_key
from kvmem.stores.base import TierBase

__all__ = ["DiskTier"]

log = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_IOV_MAX = 512
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL
_READ_STEP = 1 << 20  # get_verified reads in 1 MiB steps and checks each one while it is still in cache
_BATCH_FSYNC_EVERY = 64  # with fsync="batch", fsync pending files after this many writes
_BATCH_FSYNC_SECONDS = 1.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(TierBase):
    """Blob files under ``root``, at most ``capacity`` bytes.

    Args:
        root: directory (created if missing).
        capacity: bytes this tier may hold.
        fsync: ``always`` (file and directory before a put returns), ``batch``
            (every 64 writes or 1 s, and on flush/close) or ``never``.
    """

    persistent = True

    def __init__(self, root: str | os.PathLike[str], capacity: int, fsync: str = "batch") -> None:
        self.name = "disk"
        self.capacity = capacity
        self.fsync = fsync
        self.root = Path(root)
        self._blobs = self.root / "blobs"
        self._blobs_dir = os.fspath(self._blobs) + os.sep
        self._quarantine = self.root / "quarantine"
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._quarantine.mkdir(exist_ok=True)
        self._lock = threading.Lock()
        # NOTE: key -> size; order is the LRU order (first = least recently used).
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._tmp_ids = itertools.count()
        self._unsynced: set[Path] = set()
        self._last_sync = time.monotonic()
        self._rebuild_index()

    # -- paths --------------------------------------------------------------
    def path(self, key: str) -> Path:
        """The file of ``key``. Only storage keys (64 hex digits) map to a path."""
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        """:meth:`path` as a string, for the read path (a string join costs less than pathlib)."""
        if not is_storage_key(key):
            raise ValueError(f"DiskTier key {key[:80]!r}: expected a storage key of 64 hex digits")
        return f"{self._blobs_dir}{key[:2]}{os.sep}{key}{_SUFFIX}"

    def _rebuild_index(self, clean_tmp: bool = True) -> None:
        found: list[tuple[int, str, int]] = []
        for shard in self._blobs.iterdir():
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard):
                if entry.name.endswith(".tmp"):
                    if clean_tmp:
                        self._remove_stray_tmp(entry)
                elif entry.name.endswith(_SUFFIX) and is_storage_key(entry.name[:-len(_SUFFIX)]):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue  # deleted by another process while we scanned
                    found.append((st.st_mtime_ns, entry.name[:-len(_SUFFIX)], st.st_size))
        index = OrderedDict((key, size) for _mtime, key, size in sorted(found))
        with self._lock:
            self._index = index
            self._bytes = sum(index.values())

    def rescan(self) -> None:
        """Re-read the index from the files, to see what other processes sharing ``root`` wrote or removed.

        NOTE: meant for observers (``kvmem serve-metrics``): an entry this process
        puts while the scan runs may be left out of the index until the next rescan.
        """
        self._rebuild_index(clean_tmp=False)

    def _remove_stray_tmp(self, entry: os.DirEntry[str]) -> None:
        """Delete a temporary file left by a crashed writer (never one of a live process)."""
        parts = entry.name.split(".")
        pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            return
        try:
            os.unlink(entry.path)
            log.info("kvmem: removed %s left by an interrupted write", entry.path)
        except FileNotFoundError:
            pass

    # -- StorageTier --------------------------------------------------------
    def get(self, key: str) -> torch.Tensor | None:
        return self._read(key, None)

    def get_verified(self, key: str, checker: blobfmt.StreamVerifier | None = None) -> torch.Tensor | None:
        """``get`` with the CRCs checked during the read, one 1 MiB step at a time.

        ``checker``: a fresh verifier to check with (its ``header`` is then the blob's).

        NOTE: each step is checked right after ``readv`` brought it into cache, so the
        check adds no second pass over memory (measured: 0.89 of a plain read, vs 0.82
        for a read followed by :func:`kvmem.blob.verify`). The bytes checked are the
        bytes returned.

        Raises:
            IntegrityError: the file is truncated or does not match its CRCs.
        """
        return self._read(key, checker if checker is not None else blobfmt.StreamVerifier())

    def read_verified(self, key: str) -> blobfmt.Verified | None:
        checker = blobfmt.StreamVerifier()
        buf = self.get_verified(key, checker)
        return None if buf is None else blobfmt.Verified(buf, (checker.header, checker.start))

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        """Bytes ``[start, stop)`` of ``key``'s file (fewer at its end), read with one ``pread``."""
        try:
            fd = os.open(self._file(key), os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return None
        try:
            buf = empty_buffer(max(0, stop - start))
            got = os.preadv(fd, [buf.numpy()], start) if buf.numel() else 0
        finally:
            os.close(fd)
        return buf[:got]

    def advise_range(self, key: str, start: int, stop: int) -> None:
        """Start reading bytes ``[start, stop)`` of ``key``'s file into the page cache (``POSIX_FADV_WILLNEED``).

        NOTE: the kernel submits the whole range at once; a cold ``pread`` instead
        ramps its readahead up from a few pages. Reading one layer (1 MiB) of each of
        16 cold chunk files took 60-80 ms here with ``pread`` alone, 20-30 ms advised first.
        """
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = os.open(self._file(key), os.O_RDONLY)
        except FileNotFoundError:
            return  # a hint only: the read that follows reports the miss
        try:
            os.posix_fadvise(fd, start, max(0, stop - start), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # a hint only: the read that follows does the work, or reports the failure
        finally:
            os.close(fd)

    def _read(self, key: str, checker: blobfmt.StreamVerifier | None) -> torch.Tensor | None:
        """The file of ``key`` in a new buffer; with ``checker``, its CRCs checked as it is read."""
        path = self._file(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return None
        try:
            size = os.fstat(fd).st_size
            buf = empty_buffer(size)
            got = _read_into(fd, buf.numpy(), checker)
        finally:
            os.close(fd)
        if checker is not None:
            checker.finish(got)
        self._touch(key, path, size)
        return buf[:got]

    def put(self, key: str, blob: EncodedBlob) -> None:
        path = self.path(key)
        tmp = path.with_name(f"{key}.{os.getpid()}.{next(self._tmp_ids)}.tmp")
        try:
            fd = os.open(tmp, _CREATE, 0o644)
        except FileNotFoundError:  # the first entry of its shard: make the directory (once, not per put)
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, _CREATE, 0o644)
        try:
            parts = list(blob.parts)
            for i in range(0, len(parts), _IOV_MAX):
                _write_all(fd, parts[i:i + _IOV_MAX])
            if self.fsync == "always":
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        _stamp(tmp)
        os.replace(tmp, path)
        if self.fsync == "always":
            _fsync_dir(path.parent)
        with self._lock:
            self._bytes += blob.nbytes - self._index.pop(key, 0)
            self._index[key] = blob.nbytes
            if self.fsync == "batch":
                self._unsynced.add(path)
        if self.fsync == "batch" and (len(self._unsynced) >= _BATCH_FSYNC_EVERY
                                      or time.monotonic() - self._last_sync > _BATCH_FSYNC_SECONDS):
            self.flush()

    def contains(self, key: str) -> bool:
        return key in self._index or self.path(key).exists()

    def delete(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            existed = True
        except FileNotFoundError:
            existed = False
        self._forget(key)
        return existed

    def quarantine(self, key: str) -> None:
        target = self._quarantine / f"{key}.{int(time.time())}{_SUFFIX}"
        try:
            os.replace(self.path(key), target)
            log.warning("kvmem: quarantined corrupt entry %s to %s", key, target)
        except FileNotFoundError:
            pass
        self._forget(key)

    def keys(self) -> Iterator[str]:
        with self._lock:
            snapshot = list(self._index)
        return iter(snapshot)

    def usage(self) -> int:
        return self._bytes

    def quarantined(self) -> list[Path]:
        """Files moved aside by :meth:`quarantine`."""
        return sorted(self._quarantine.glob(f"*{_SUFFIX}"))

    def purge_quarantine(self) -> int:
        freed = 0
        for path in self.quarantined():
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass  # purged by another process
        return freed

    def flush(self) -> None:
        """fsync files written since the last flush (``fsync="batch"``), then their directories."""
        with self._lock:
            pending, self._unsynced = self._unsynced, set()
            self._last_sync = time.monotonic()
        for path in pending:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # replaced or evicted since: nothing left to make durable
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for directory in {p.parent for p in pending}:
            _fsync_dir(directory)

    def close(self) -> None:
        self.flush()

    # -- helpers ------------------------------------------------------------
    def _forget(self, key: str) -> None:
        with self._lock:
            self._bytes -= self._index.pop(key, 0)

    def _touch(self, key: str, path: str | Path, size: int) -> None:
        with self._lock:
            self._bytes += size - self._index.pop(key, 0)
            self._index[key] = size
        try:
            _stamp(path)
        except FileNotFoundError:
            pass  # deleted by another process after our read; the bytes we read stand


def _stamp(path: str | Path) -> None:
    """Set ``path``'s mtime from the nanosecond clock.

    NOTE: the kernel stamps writes with a coarse clock (ticks of a few ms), so files
    written in one tick would tie and reopen in key order, not LRU order.
    """
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _read_into(fd: int, dst: np.ndarray, checker: blobfmt.StreamVerifier | None) -> int:
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


def _write_all(fd: int, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts if p.size]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
