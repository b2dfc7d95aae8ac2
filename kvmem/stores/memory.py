"""In-memory tiers: what they share (entries in an eviction order), and the GPU tier.

``GpuTier`` keeps blobs in the pages of one preallocated device pool
(:mod:`kvmem.stores.paged`); the CPU tier (:mod:`kvmem.stores.cpu`) in the pages of one
host pool (:mod:`kvmem.pool`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kvmem.blob import EncodedBlob
from kvmem.errors import CapacityError, ConfigError
from kvmem.stores.base import OpensBlobs, TierBase, Trusted
from kvmem.stores.eviction import order_for
from kvmem.stores.paged import PagedBuffer
from kvmem.stores.readers import BlobReader, open_by_ranges

__all__ = ["MemoryTier", "GpuTier"]

E = TypeVar("E")


class MemoryTier(TierBase, Generic[E]):
    """What the in-memory tiers share: entries by key, the order they leave in, and the blob bytes they hold.

    Args:
        eviction: the order entries leave in when room is made (:data:`kvmem.config.EVICTIONS`).
    """

    def __init__(self, eviction: str = "lru") -> None:
        # NOTE: with "lru" the mapping's order is the eviction order: first = least recently used
        self._entries: OrderedDict[str, E] = OrderedDict()
        self._order = order_for(eviction, self._entries)  # type: ignore[arg-type]
        self._hit = self._order.hit
        self._bytes = 0
        self._lock = threading.Lock()

    def _forget(self, entry: E) -> None:
        """Account for ``entry`` leaving (caller holds ``_lock``)."""
        raise NotImplementedError

    def _place(self, key: str, entry: E, nbytes: int) -> None:
        """Hold ``entry`` under ``key``, replacing (and forgetting) any entry there (caller holds ``_lock``)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._forget(old)
        self._entries[key] = entry
        self._order.added(key, nbytes)

    def contains(self, key: str) -> bool:
        return key in self._entries

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._forget(old)
                self._order.removed(key)
            return old is not None

    def keys(self) -> Iterator[str]:
        """Keys in the order they leave in (the first to go first), read lazily."""
        return self._order.victims(self._lock)

    def usage(self) -> int:
        return self._bytes


class GpuTier(MemoryTier["_Entry"], Trusted, OpensBlobs):
    """Device-memory tier on a paged pool: blobs live in fixed-size pages of one preallocated buffer.

    No allocation per entry and no fragmentation: a blob takes ``ceil(nbytes / page_bytes)``
    pages from the pool's free list (:class:`~kvmem.stores.paged.PagedBuffer`) and gives them back
    when deleted or replaced. Writes go through a preallocated staging buffer (pinned on
    CUDA) in runs of at least ``transfer_bytes``: one host-to-device copy and one scatter
    kernel per run rather than one copy per page. Loads from it are not CRC-checked (the
    bytes never left the device: :class:`~kvmem.stores.base.Trusted`).

    ``get`` gathers the pages into a new buffer the caller owns (it does not share its
    buffers), so a later write that reuses freed pages never changes bytes handed out
    (copy-on-write); ``read_range`` and ``open_blob`` gather only the pages a range covers.

    Args:
        capacity: bytes of blobs this tier may hold (``usage`` counts blob bytes).
        device: torch device of the pool (``cuda``; any device works, ``cpu`` in tests).
        page_bytes: page size; by default 64 KiB, smaller for a small tier (at least 256
            pages' worth) so that rounding up to whole pages wastes little.
        transfer_bytes: bytes per host-to-device run (8 MiB: on an H200 a 32 MiB put from the CPU tier's
            pinned pages ran at 0.22 of a plain pinned copy in 1 MiB runs, 0.47-0.60 in 4-8 MiB runs,
            0.62 in 32 MiB runs; each run is one copy and one scatter kernel).
        eviction: the order entries leave in (``lru`` or ``arc``: :mod:`kvmem.stores.eviction`).

    The pool holds 1/8 more pages than ``capacity`` needs, for the unused tail of
    each entry's last page; a put that still finds too few pages (a great many tiny
    entries) raises :class:`~kvmem.errors.CapacityError`, which the tiered store treats
    as this value refused (it goes to the tiers below).
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device | str = "cuda",
        page_bytes: int | None = None,
        transfer_bytes: int = 8 << 20,
        eviction: str = "lru",
    ) -> None:
        self.name = "gpu"
        self.capacity = capacity
        self.device = torch.device(device)
        self.page_bytes = page_bytes or _default_page_bytes(capacity)
        if self.page_bytes < 1 or transfer_bytes < 1:
            raise ConfigError(f"page_bytes={page_bytes!r}, transfer_bytes={transfer_bytes!r}: accepted sizes >= 1")
        pages = -(-capacity // self.page_bytes)
        self._buffer = PagedBuffer(max(1, pages + pages // 8 + 1), 1, self.page_bytes, torch.uint8, self.device)
        run = max(1, min(self._buffer.pool.num_blocks, -(-transfer_bytes // self.page_bytes)))
        pin = self.device.type == "cuda"
        # NOTE: the staging buffers are the only memory a put touches besides the pages: no per-entry allocation.
        self._host_staging = torch.empty((1, run * self.page_bytes), dtype=torch.uint8, pin_memory=pin)
        self._staging = (
            self._host_staging
            if self.device.type == "cpu"
            else torch.empty_like(self._host_staging, device=self.device)
        )
        super().__init__(eviction)

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._hit(key)
            return self._buffer.read(entry.blocks)[0, : entry.nbytes]

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            stop = min(stop, entry.nbytes)
            if start >= stop:
                return torch.empty(0, dtype=torch.uint8, device=self.device)
            first, last = start // self.page_bytes, -(-stop // self.page_bytes)
            got = self._buffer.read(entry.blocks[first:last])[0]
            return got[start - first * self.page_bytes : stop - first * self.page_bytes]

    def open_blob(self, key: str) -> BlobReader | None:
        """``key``'s blob read by ranges (each a gather of the pages it covers), not CRC-checked."""
        return open_by_ranges(lambda lo, hi: self.read_range(key, lo, hi), self.name, checks_crc=False)

    def put(self, key: str, blob: EncodedBlob) -> None:
        with self._lock:
            blocks = self._buffer.pool.allocate(-(-blob.nbytes // self.page_bytes))
            if blocks is None:
                raise CapacityError(
                    f"GPU tier: {blob.nbytes} bytes need {-(-blob.nbytes // self.page_bytes)} pages "
                    f"of {self.page_bytes} B, {self._buffer.pool.num_free} are free"
                )
            self._write(blocks, blob)
            # NOTE: the new version is written before the old one's pages are freed
            self._place(key, _Entry(blocks, blob.nbytes), blob.nbytes)
            self._bytes += blob.nbytes

    def _write(self, blocks: list[int], blob: EncodedBlob) -> None:
        """Stream ``blob``'s parts into ``blocks`` through the staging buffers, one run of pages at a time.

        Parts in pinned host memory (a CPU tier's pages when CUDA is present) are copied to the device
        staging buffer as they are, without the host staging copy; the put waits for those copies once,
        at its end, so that the pages may be reused as soon as it returns.
        """
        ids = self._buffer.ids(blocks)  # NOTE: one index tensor per put, not one small copy per run
        pinned = _pinned_parts(blob) if self._staging is not self._host_staging else None
        host, device = self._host_staging.numpy()[0], self._staging[0]
        done = 0
        for pieces in _runs([part.size for part in blob.parts], host.size):
            for i, lo, hi, at in pieces:
                if pinned is None:
                    host[at : at + hi - lo] = blob.parts[i][lo:hi]
                else:
                    device[at : at + hi - lo].copy_(pinned[i][lo:hi], non_blocking=True)
            _i, lo, hi, at = pieces[-1]
            done = self._flush(ids, done, at + hi - lo, staged=pinned is None)
        if pinned is not None:
            torch.cuda.current_stream(self.device).synchronize()

    def _flush(self, ids: torch.Tensor, done: int, fill: int, staged: bool) -> int:
        """Copy ``fill`` bytes of the device staging buffer (first from the host one when ``staged``) into
        the pages after the first ``done``; pages written so far."""
        n = -(-fill // self.page_bytes)
        if staged and self._staging is not self._host_staging:
            self._staging.copy_(self._host_staging)  # one >= transfer_bytes DMA; blocking: the host refills
        self._buffer.write(ids[done : done + n], self._staging[:, : n * self.page_bytes])
        return done + n

    def _forget(self, entry: _Entry) -> None:
        self._buffer.pool.free(entry.blocks)
        self._bytes -= entry.nbytes

    @property
    def free_pages(self) -> int:
        """Pages not holding any entry."""
        return self._buffer.pool.num_free


@dataclass(frozen=True)
class _Entry:
    blocks: list[int]
    nbytes: int


def _runs(sizes: list[int], run: int) -> Iterator[list[tuple[int, int, int, int]]]:
    """Parts of ``sizes`` bytes laid end to end, cut into runs of ``run`` bytes: per run, its pieces as
    ``(part, start, stop, offset in the run)``."""
    pieces: list[tuple[int, int, int, int]] = []
    fill = 0
    for i, size in enumerate(sizes):
        taken = 0
        while taken < size:
            n = min(size - taken, run - fill)
            pieces.append((i, taken, taken + n, fill))
            fill, taken = fill + n, taken + n
            if fill == run:
                yield pieces
                pieces, fill = [], 0
    if pieces:
        yield pieces


def _pinned_parts(blob: EncodedBlob) -> list[torch.Tensor] | None:
    """``blob``'s parts as tensors when every one lies in pinned host memory, else ``None``."""
    parts = []
    for part in blob.parts:
        if not part.flags.writeable:  # NOTE: torch warns on a read-only array; such bytes are not pinned pages
            return None
        tensor = torch.from_numpy(part)
        if not tensor.is_pinned():
            return None
        parts.append(tensor)
    return parts


def _default_page_bytes(capacity: int) -> int:
    """64 KiB, or the largest power of two giving the tier at least 256 pages (256 B at least)."""
    size = 64 * 1024
    while size > 256 and capacity // size < 256:
        size //= 2
    return size
