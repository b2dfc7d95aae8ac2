"""In-memory tiers: what they share (an LRU of entries), and the GPU tier.

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
from kvmem.stores.base import OpensBlobs, TierBase, Trusted, lru_keys
from kvmem.stores.paged import PagedBuffer
from kvmem.stores.readers import BlobReader, open_by_ranges

__all__ = ["LruTier", "GpuTier"]

E = TypeVar("E")


class LruTier(TierBase, Generic[E]):
    """What the in-memory tiers share: entries by key in LRU order, and the blob bytes they hold."""

    def __init__(self) -> None:
        # OrderedDict order is the LRU order: first = least recently used.
        self._entries: OrderedDict[str, E] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _forget(self, entry: E) -> None:
        """Account for ``entry`` leaving (caller holds ``_lock``)."""
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        return key in self._entries

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._forget(old)
            return old is not None

    def keys(self) -> Iterator[str]:
        return lru_keys(self._entries, self._lock)

    def usage(self) -> int:
        return self._bytes


class GpuTier(LruTier["_Entry"], Trusted, OpensBlobs):
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
        transfer_bytes: bytes per staged host-to-device copy (the seed's 1 MB).

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
        transfer_bytes: int = 1 << 20,
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
        super().__init__()

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
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
            old = self._entries.pop(key, None)
            if old is not None:  # NOTE: the new version is written before the old one's pages are freed
                self._forget(old)
            self._entries[key] = _Entry(blocks, blob.nbytes)
            self._bytes += blob.nbytes

    def _write(self, blocks: list[int], blob: EncodedBlob) -> None:
        """Stream ``blob``'s parts into ``blocks`` through the staging buffer, one run of pages at a time."""
        host = self._host_staging.numpy()[0]
        fill, done = 0, 0
        for part in blob.parts:
            taken = 0
            while taken < part.size:
                n = min(part.size - taken, host.size - fill)
                host[fill : fill + n] = part[taken : taken + n]
                fill, taken = fill + n, taken + n
                if fill == host.size:
                    done = self._flush(blocks, done, fill)
                    fill = 0
        if fill:
            self._flush(blocks, done, fill)

    def _flush(self, blocks: list[int], done: int, fill: int) -> int:
        """Copy ``fill`` staged bytes into the pages after the first ``done``; pages written so far."""
        n = -(-fill // self.page_bytes)
        if self._staging is not self._host_staging:
            self._staging.copy_(self._host_staging)  # one >= transfer_bytes DMA; blocking: the host refills
        self._buffer.write(blocks[done : done + n], self._staging[:, : n * self.page_bytes])
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


def _default_page_bytes(capacity: int) -> int:
    """64 KiB, or the largest power of two giving the tier at least 256 pages (256 B at least)."""
    size = 64 * 1024
    while size > 256 and capacity // size < 256:
        size //= 2
    return size
