"""The disk tier: one file per blob, atomic writes, an LRU index rebuilt on open.

Layout under ``root``::

    blobs/<first two hex digits>/<key>.kvb     committed entries
    blobs/<..>/<key>.<pid>.<n>.tmp             a write in progress
    quarantine/<key>.<unix time>.kvb           entries that failed their CRC

A write goes to a temporary file, is fsynced (per ``fsync``), then renamed over
the entry: a crash leaves the old entry or the new one, never half of one.
The LRU order is the files' mtimes (a hit touches the file), so the index
rebuilt by scanning on open keeps the order across restarts. Several processes
may share a root: ``get`` opens the file itself rather than trusting this
process's index.
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

import torch

from kvmem.blob import EncodedBlob, empty_buffer
from kvmem.keys import is_storage_key
from kvmem.stores.base import TierBase

__all__ = ["DiskTier"]

log = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_IOV_MAX = 512
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
        if not is_storage_key(key):
            raise ValueError(f"DiskTier key {key[:80]!r}: expected a storage key of 64 hex digits")
        return self._blobs / key[:2] / (key + _SUFFIX)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, str, int]] = []
        for shard in self._blobs.iterdir():
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard):
                if entry.name.endswith(".tmp"):
                    self._remove_stray_tmp(entry)
                elif entry.name.endswith(_SUFFIX) and is_storage_key(entry.name[:-len(_SUFFIX)]):
                    st = entry.stat()
                    found.append((st.st_mtime, entry.name[:-len(_SUFFIX)], st.st_size))
        for _mtime, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size

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
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return None
        try:
            size = os.fstat(fd).st_size
            buf = empty_buffer(size)
            view = memoryview(buf.numpy())
            got = 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break  # the file shrank under us: return what is there; the CRC check rejects it
                got += n
        finally:
            os.close(fd)
        self._touch(key, path, size)
        return buf[:got]

    def put(self, key: str, blob: EncodedBlob) -> None:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{key}.{os.getpid()}.{next(self._tmp_ids)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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

    def _touch(self, key: str, path: Path, size: int) -> None:
        with self._lock:
            self._bytes += size - self._index.pop(key, 0)
            self._index[key] = size
        try:
            os.utime(path)
        except FileNotFoundError:
            pass  # deleted by another process after our read; the bytes we read stand


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
