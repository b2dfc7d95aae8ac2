"""The disk tier: one file per blob, atomic writes, an LRU index rebuilt on open.

Layout under ``root``::

    areas.json                                 the active area and its blob format (see kvmem/stores/areas.py)
    blobs/<first two hex digits>/<key>.kvb     committed entries of the active area (``blobs``, ``blobs.f2``...)
    blobs/<..>/<key>.<pid>.<n>.tmp             a write in progress
    quarantine/<key>.<unix time>.kvb           entries that failed their CRC

While ``kvmem migrate`` runs there is a second area, the target: reads look in
it first, then in the active one; writes go to it, in its format. Every
process sharing ``root`` follows ``areas.json``: it checks the file after each
write (a write that landed in an area no longer written to is moved into the
current one) and before giving up on a miss.

A write goes to a temporary file, is fsynced (per ``fsync``), then renamed over
the entry: a crash leaves the old entry or the new one, never half of one.
The LRU order is the files' mtimes (a write or a hit stamps the file with the
nanosecond clock), so the index rebuilt by scanning on open keeps the order
across restarts. Several processes may share a root: ``get`` opens the file
itself rather than trusting this process's index.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob, empty_buffer
from kvmem.errors import IntegrityError
from kvmem.recovery import OnRecovered
from kvmem.stores import files
from kvmem.stores.areas import STATE_FILE, SUFFIX, AreaState, entry_file, read_state, scan_area
from kvmem.stores.base import (
    AdvisesReads,
    BatchWrites,
    Durable,
    OpensBlobs,
    PinsFormat,
    Quarantine,
    TierBase,
    VerifiedReads,
    lru_keys,
)
from kvmem.stores.readers import BlobReader, FileReader
from kvmem.threads import io_pool

__all__ = ["DiskTier"]

log = logging.getLogger(__name__)

_BATCH_FSYNC_EVERY = 64  # with fsync="batch", fsync pending files after this many writes
_BATCH_FSYNC_SECONDS = 1.0
_STATE_RECHECK = 0.2  # seconds between checks of areas.json when nothing forces one


class DiskTier(TierBase, VerifiedReads, OpensBlobs, AdvisesReads, Quarantine, Durable, BatchWrites, PinsFormat):
    """Blob files under ``root``, at most ``capacity`` bytes.

    Loads are CRC-checked as the file is read; corrupt files are moved aside; with
    ``fsync="batch"`` writes are made durable by :meth:`flush`. What a format migration
    does with its areas is :class:`~kvmem.stores.areas.DiskAreas`'s.

    Args:
        root: directory (created if missing).
        capacity: bytes this tier may hold.
        fsync: ``always`` (file and directory before a put returns), ``batch``
            (every 64 writes or 1 s, and on flush/close) or ``never``.
        on_recovered: told ``"areas"`` when a damaged ``areas.json`` is set aside and rebuilt.
    """

    persistent = True

    def __init__(
        self, root: str | os.PathLike[str], capacity: int, fsync: str = "batch", on_recovered: OnRecovered | None = None
    ) -> None:
        self.name = "disk"
        self.capacity = capacity
        self.fsync = fsync
        self.root = Path(root)
        self._quarantine = self.root / "quarantine"
        self._quarantine.mkdir(parents=True, exist_ok=True)
        self._state_file = os.fspath(self.root / STATE_FILE)
        self._on_recovered = on_recovered
        stamp = self._state_stamp()
        self._use_state(read_state(self.root, on_recovered), stamp)
        self._lock = threading.Lock()
        # key -> size; order is the LRU order (first = least recently used).
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._unsynced: set[Path] = set()
        self._last_sync = time.monotonic()
        self._rebuild_index()

    # -- areas --------------------------------------------------------------
    @property
    def areas(self) -> AreaState:
        """The areas as this process last read them (see :mod:`kvmem.stores.areas`)."""
        return self._state

    @property
    def blob_format(self) -> int:
        """The blob format entries are written in now (the target's during a migration)."""
        if time.monotonic() - self._checked > _STATE_RECHECK:
            self.refresh_areas()
        return self._state.write_format

    def _use_state(self, state: AreaState, stamp: tuple[int, int]) -> None:
        """Follow ``state``, read from ``areas.json`` as it was at ``stamp``."""
        self._state = state
        self._dirs = tuple(os.fspath(self.root / name) + os.sep for name in state.reading_order)
        self._write_dir = os.fspath(self.root / state.write_area) + os.sep
        os.makedirs(self._write_dir, exist_ok=True)
        self._stamp = stamp
        self._checked = time.monotonic()

    def refresh_areas(self) -> bool:
        """Follow ``areas.json`` if another process changed it; whether it had changed."""
        stamp = self._state_stamp()
        self._checked = time.monotonic()
        if stamp == self._stamp:
            return False
        self._use_state(read_state(self.root, self._on_recovered), stamp)
        return True

    def _state_stamp(self) -> tuple[int, int]:
        """``areas.json``'s (mtime, inode), taken before it is read: a change made after the read shows."""
        try:
            st = os.stat(self._state_file)
        except FileNotFoundError:
            return (0, 0)
        return (st.st_mtime_ns, st.st_ino)

    # -- paths --------------------------------------------------------------
    def path(self, key: str) -> Path:
        """The file of ``key``: where it is now, or where a put would write it. Only storage keys map to a path."""
        found = next((f for f in self._files(key) if os.path.exists(f)), None)
        return Path(found or entry_file(self._write_dir, key))

    def _files(self, key: str) -> list[str]:
        """``key``'s files in reading order (the migration target first)."""
        return [entry_file(d, key) for d in self._dirs]

    def _rebuild_index(self, clean_tmp: bool = True) -> None:
        found = [hit for d in self._dirs for hit in scan_area(Path(d), clean_tmp)]
        index = OrderedDict((key, size) for _mtime, key, size in sorted(found))
        with self._lock:
            self._index = index
            self._bytes = sum(index.values())

    def rescan(self) -> None:
        """Re-read the index from the files, to see what other processes sharing ``root`` wrote or removed.

        Meant for observers (``kvmem serve-metrics``): an entry this process
        puts while the scan runs may be left out of the index until the next rescan.
        """
        self._rebuild_index(clean_tmp=False)

    # -- StorageTier --------------------------------------------------------
    def get(self, key: str) -> torch.Tensor | None:
        return self._read(key, None)

    def read_verified(self, key: str) -> blobfmt.Verified | None:
        """``get`` with the CRCs checked during the read, one 1 MiB step at a time, and the header the check parsed.

        NOTE: each step is checked right after ``readv`` brought it into cache, so the
        check adds no second pass over memory (measured: 0.89 of a plain read, vs 0.82
        for a read followed by :func:`kvmem.blob.verify`). The bytes checked are the
        bytes returned.

        Raises:
            IntegrityError: the file is truncated or does not match its CRCs.
        """
        checker = blobfmt.StreamVerifier()
        buf = self._read(key, checker)
        return None if buf is None else blobfmt.Verified(buf, checker.parsed)

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        """Bytes ``[start, stop)`` of ``key``'s file (fewer at its end), read with one ``pread``."""
        found = self._open(key)
        if found is None:
            return None
        fd, _path = found
        try:
            buf = empty_buffer(max(0, stop - start))
            got = os.preadv(fd, [buf.numpy().data], start) if buf.numel() else 0
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
        fd = next((fd for fd in map(files.open_or_none, self._files(key)) if fd is not None), None)
        if fd is None:
            return  # a hint only: the read that follows reports the miss
        try:
            os.posix_fadvise(fd, start, max(0, stop - start), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # a hint only: the read that follows does the work, or reports the failure
        finally:
            os.close(fd)

    def _read(self, key: str, checker: blobfmt.StreamVerifier | None) -> torch.Tensor | None:
        """The file of ``key`` in a new buffer; with ``checker``, its CRCs checked as it is read."""
        found = self._open(key)
        if found is None:
            return None
        fd, path = found
        try:
            size = os.fstat(fd).st_size
            buf = empty_buffer(size)
            got = files.read_into(fd, buf.numpy(), checker)
        finally:
            os.close(fd)
        if checker is not None:
            checker.finish(got)
        self._touch(key, path, size)
        return buf[:got]

    def _open(self, key: str) -> tuple[int, str] | None:
        """An open descriptor of ``key``'s file (newest area first) and its path, or ``None``.

        On a miss, ``areas.json`` is checked: a migration may have switched areas
        (and removed the old one) since this process last looked.
        """
        for attempt in range(2):
            for path in self._files(key):
                fd = files.open_or_none(path)
                if fd is not None:
                    return fd, path
            if attempt or not self.refresh_areas():
                break
        self._forget(key)
        return None

    def _write_tmp(self, path: Path, key: str, blob: EncodedBlob) -> Path:
        """``blob`` written (and fsynced per ``fsync``) to a new temporary file beside ``path``."""
        return files.write_tmp(path, key, blob, fsync=self.fsync == "always")

    def put(self, key: str, blob: EncodedBlob) -> None:
        self.put_many([(key, blob)])

    def put_many(self, items: Sequence[tuple[str, EncodedBlob]]) -> None:
        """Write every entry to a temporary file (in parallel, each fsynced per ``fsync``), then rename each
        over its entry, then fsync each directory once (``fsync="always"``).

        NOTE: an entry is committed by its rename alone, so a crash leaves each entry whole, old
        or new; a batch makes its directories durable together, not one file at a time.
        """
        area = self._write_dir
        fmt = self._state.write_format
        jobs = [(key, Path(entry_file(area, key)), _in_format(blob, fmt)) for key, blob in items]
        if len(jobs) == 1:
            tmps = [self._write_tmp(jobs[0][1], jobs[0][0], jobs[0][2])]
        else:
            futures = [io_pool().submit(self._write_tmp, path, key, blob) for key, path, blob in jobs]
            if any(f.exception() is not None for f in futures):  # NOTE: waits for all: a failed batch leaves no tmp
                for tmp in (f.result() for f in futures if f.exception() is None):
                    tmp.unlink(missing_ok=True)
            tmps = [f.result() for f in futures]  # raises the first failure
        paths = []
        for (_key, path, _blob), tmp in zip(jobs, tmps):
            os.replace(tmp, path)
            paths.append(path)
        if self.refresh_areas() and self._write_dir != area:
            # NOTE: a migration began or switched while these files were written: move them where entries go now
            paths = [self._move_to_write_area(key, path) for (key, _p, _b), path in zip(jobs, paths)]
        if self.fsync == "always":
            for directory in dict.fromkeys(p.parent for p in paths):
                files.fsync_dir(directory)
        with self._lock:
            for (key, _p, blob), path in zip(jobs, paths):
                self._bytes += blob.nbytes - self._index.pop(key, 0)
                self._index[key] = blob.nbytes
                if self.fsync == "batch":
                    self._unsynced.add(path)
        if self.fsync == "batch" and (
            len(self._unsynced) >= _BATCH_FSYNC_EVERY or time.monotonic() - self._last_sync > _BATCH_FSYNC_SECONDS
        ):
            self.flush()

    def open_blob(self, key: str) -> BlobReader | None:
        """``key``'s file, opened once: its header read and checked, its parts read into tensors on demand.

        Raises:
            IntegrityError: the file's head is not an intact blob header.
        """
        found = self._open(key)
        if found is None:
            return None
        # NOTE: not stamped as used (a metadata write per open, measured in layer-wise loads): a chunk read
        # in parts is warmed into the tiers above by the prefix cache, and those reads stamp it
        return FileReader(found[0], self.name)  # owns the descriptor from here on (closes it on a bad header)

    def _move_to_write_area(self, key: str, path: Path) -> Path:
        """Move ``key``'s file at ``path`` into the current write area (in its format); the new path."""
        target = Path(entry_file(self._write_dir, key))
        target.parent.mkdir(parents=True, exist_ok=True)
        original = EncodedBlob.from_buffer(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))
        blob = _in_format(original, self._state.write_format)
        if blob is original:
            os.replace(path, target)
        else:
            os.replace(self._write_tmp(target, key, blob), target)
            path.unlink(missing_ok=True)
        return target

    def contains(self, key: str) -> bool:
        """Whether ``key``'s file exists now: from the files, not the index (another process sharing ``root``
        may have removed the entry), following ``areas.json`` on a miss as :meth:`_open` does."""
        for attempt in range(2):
            if any(os.path.exists(f) for f in self._files(key)):
                return True
            if attempt or not self.refresh_areas():
                break
        return False

    def delete(self, key: str) -> bool:
        # NOTE: the active area before the target: a migration copying this key then finds its source gone
        existed = False
        for path in reversed(self._files(key)):
            try:
                os.unlink(path)
                existed = True
            except FileNotFoundError:
                pass
        self._forget(key)
        return existed

    def quarantine(self, key: str) -> None:
        for path in self._files(key):
            target = self._quarantine / f"{key}.{time.time_ns()}{SUFFIX}"
            try:
                os.replace(path, target)
                log.warning("kvmem: quarantined corrupt entry %s to %s", key, target)
            except FileNotFoundError:
                pass
        self._forget(key)

    def keys(self) -> Iterator[str]:
        return lru_keys(self._index, self._lock)

    def usage(self) -> int:
        return self._bytes

    def quarantined(self) -> list[Path]:
        """Files moved aside by :meth:`quarantine`."""
        return sorted(self._quarantine.glob(f"*{SUFFIX}"))

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
            files.fsync_dir(directory)

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
            files.stamp(path)
        except FileNotFoundError:
            pass  # deleted by another process after our read; the bytes we read stand


def _in_format(blob: EncodedBlob, blob_format: int) -> EncodedBlob:
    """``blob`` in ``blob_format``: as it is, or reframed (a writer that encoded before a migration began)."""
    try:
        if blobfmt.format_of(blob.head)[0] == blob_format:
            return blob
    except IntegrityError:
        return blob  # not a blob this tier can read: stored as given, its CRC check fails it on load
    from kvmem.codecs.serialization import reframe  # late: the codecs know the header layout; rare path

    buf = blob.to_tensor()
    return reframe(buf, blob_format, blobfmt.verify(buf))
