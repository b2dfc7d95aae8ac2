"""Host memory allocated once: a pool of pages handed out as runs of consecutive pages.

The CPU tier keeps its blobs here (and :class:`~kvmem.kv.offload.OffloadingCache` its
host pages): no buffer is allocated per entry, so a store is one copy into memory that
was faulted in once, and a load is one copy out of it.

- :class:`ExtentAllocator` is bookkeeping only: free runs of pages by start, by end and
  by length. An allocation takes the smallest free run that holds it (best fit, O(log n)
  in the number of distinct free-run lengths); a freed run merges with its free
  neighbours in O(1). When no single run is long enough but enough pages are free
  (fragmentation), the allocation is made of several runs, longest first.
- :class:`HostPool` is the memory: one buffer of ``num_pages`` pages (pinned when CUDA
  is present, else an anonymous mapping that asks for transparent huge pages), and
  :class:`Allocation`\\ s of it. An allocation gives its pages back when the last
  reference to it goes: the tier's entry, and every view handed out
  (:meth:`Allocation.view`). A view can therefore outlive the entry's eviction; its
  pages are reused only after it is gone (Python's reference count is the refcount).

NOTE: page faults. The buffer is mapped once but faulted in on first touch; on a VM
without huge pages first touch runs at a fraction of memcpy speed, so pages are handed
out lowest address first: a pool that is not full keeps reusing pages already faulted in.
"""

from __future__ import annotations

import bisect
import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvmem.errors import ConfigError

__all__ = ["PAGE_BYTES", "Run", "ExtentAllocator", "HostPool", "Allocation"]

PAGE_BYTES = 4096
Run = tuple[int, int]
"""``(first page, page count)``."""


class ExtentAllocator:
    """Pages ``[0, num_pages)`` as runs: best-fit allocation, O(1) merge on free.

    Args:
        num_pages: pages managed (>= 1).

    Raises:
        ConfigError: ``num_pages`` < 1.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ConfigError(f"num_pages={num_pages!r}: accepted an integer >= 1")
        self.num_pages = num_pages
        self.free_pages = 0
        self._by_start: dict[int, int] = {}  # free run start -> length
        self._by_end: dict[int, int] = {}  # free run end (exclusive) -> start
        self._starts: dict[int, set[int]] = {}  # length -> starts of free runs that long
        self._lengths: list[int] = []  # NOTE: sorted distinct lengths of free runs: best fit by bisect
        self._add(0, num_pages)

    def allocate(self, n: int) -> list[Run] | None:
        """``n`` pages: one run when a free run is long enough, else several (longest first).

        Returns:
            The runs, or ``None`` (nothing changed) when fewer than ``n`` pages are free:
            an expected condition (the caller makes room or refuses), not an error.
        """
        if n < 1 or n > self.free_pages:
            return None if n > self.free_pages else []
        i = bisect.bisect_left(self._lengths, n)
        if i < len(self._lengths):
            return [self._take(self._lengths[i], n)]
        runs: list[Run] = []
        while n:
            run = self._take(self._lengths[-1], n)
            runs.append(run)
            n -= run[1]
        return runs

    def free(self, runs: list[Run]) -> None:
        """Give ``runs`` back, each merged with the free runs beside it."""
        for start, n in runs:
            left = self._by_end.get(start)
            if left is not None:
                n += start - left
                self._remove(left, start - left)
                start = left
            right = self._by_start.get(start + n)
            if right is not None:
                self._remove(start + n, right)
                n += right
            self._add(start, n)

    def free_runs(self) -> list[Run]:
        """Free runs, lowest start first (for tests and ``kvmem doctor``)."""
        return sorted(self._by_start.items())

    def _take(self, length: int, n: int) -> Run:
        """``min(n, length)`` pages from the lowest-addressed free run of ``length`` pages."""
        start = min(self._starts[length])
        self._remove(start, length)
        got = min(n, length)
        if got < length:
            self._add(start + got, length - got)
        return start, got

    def _add(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        starts = self._starts.get(n)
        if starts is None:
            self._starts[n] = {start}
            bisect.insort(self._lengths, n)
        else:
            starts.add(start)
        self.free_pages += n

    def _remove(self, start: int, n: int) -> None:
        del self._by_start[start]
        del self._by_end[start + n]
        starts = self._starts[n]
        starts.discard(start)
        if not starts:
            del self._starts[n]
            del self._lengths[bisect.bisect_left(self._lengths, n)]
        self.free_pages -= n


class HostPool:
    """``nbytes`` of host memory, allocated once, cut into ``page_bytes`` pages.

    Args:
        nbytes: pool size (rounded up to whole pages).
        page_bytes: allocation granularity (a multiple of 64; 4 KiB: a blob of format 2
            then starts its page-aligned segments on pages of the pool).
        pin_memory: page-locked memory for fast copies to a GPU (default: when CUDA is present).

    Raises:
        ConfigError: ``nbytes`` < 1 or a bad ``page_bytes``.
    """

    def __init__(self, nbytes: int, page_bytes: int = PAGE_BYTES, pin_memory: bool | None = None) -> None:
        if nbytes < 1 or page_bytes < 64 or page_bytes % 64:
            raise ConfigError(f"HostPool(nbytes={nbytes!r}, page_bytes={page_bytes!r}): accepted nbytes >= 1 "
                              "and page_bytes a positive multiple of 64")
        self.page_bytes = page_bytes
        pages = -(-nbytes // page_bytes)
        self.nbytes = pages * page_bytes
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        # NOTE: the only allocation of pool memory; every put and load after this reuses it.
        self.buffer = _host_buffer(self.nbytes, self.pinned)
        self._array = self.buffer.numpy()
        self._base = self._array.ctypes.data
        self._allocator = ExtentAllocator(pages)
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Bytes of pages held by allocations (entries, and views that outlived them)."""
        return (self._allocator.num_pages - self._allocator.free_pages) * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return self._allocator.free_pages * self.page_bytes

    def allocate(self, nbytes: int) -> Allocation | None:
        """Pages for ``nbytes`` (as few runs as the free space allows), or ``None`` when too few are free."""
        with self._lock:
            runs = self._allocator.allocate(max(1, -(-nbytes // self.page_bytes)))
        return None if runs is None else Allocation(self, runs, nbytes)

    def free_runs(self) -> list[Run]:
        with self._lock:
            return self._allocator.free_runs()

    def _release(self, runs: list[Run]) -> None:
        with self._lock:
            self._allocator.free(runs)


class Allocation:
    """Pages of a :class:`HostPool` holding ``nbytes``, laid out over ``runs`` in order.

    The pages go back to the pool when the allocation is garbage: when its owner drops it
    and no view made by :meth:`view` / :meth:`pieces` is alive any more.
    """

    __slots__ = ("pool", "runs", "nbytes", "__weakref__")

    def __init__(self, pool: HostPool, runs: list[Run], nbytes: int) -> None:
        self.pool = pool
        self.runs = runs
        self.nbytes = nbytes

    def __del__(self) -> None:
        self.pool._release(self.runs)

    @property
    def pages(self) -> int:
        """Pages held."""
        return sum(n for _start, n in self.runs)

    @property
    def contiguous(self) -> bool:
        """Whether the bytes lie in one run (then :meth:`view` is one tensor)."""
        return len(self.runs) == 1

    def spans(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, int, int]]:
        """``(offset in the allocation, pool byte address, length)`` of the pieces holding bytes ``[start, stop)``."""
        stop = self.nbytes if stop is None else min(stop, self.nbytes)
        page = self.pool.page_bytes
        offset = 0
        for first, n in self.runs:
            end = offset + n * page
            lo, hi = max(start, offset), min(stop, end)
            if lo < hi:
                yield lo, first * page + lo - offset, hi - lo
            offset = end
            if offset >= stop:
                break

    def view(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Bytes ``[start, stop)`` as one uint8 tensor that keeps this allocation alive.

        Raises:
            ValueError: the range crosses from one run into another (see :meth:`pieces`).
        """
        pieces = self.pieces(start, stop)
        if len(pieces) > 1:
            raise ValueError(f"bytes [{start}, {stop}) of this allocation lie in {len(pieces)} runs")
        return pieces[0] if pieces else torch.empty(0, dtype=torch.uint8)

    def pieces(self, start: int = 0, stop: int | None = None) -> list[torch.Tensor]:
        """Bytes ``[start, stop)`` as uint8 tensors, one per run they cross, each keeping this allocation alive."""
        return [torch.from_numpy(np.asarray(_Lease(self, self.pool._base + addr, n)))
                for _off, addr, n in self.spans(start, stop)]

    def array(self, start: int = 0, stop: int | None = None) -> list[np.ndarray]:
        """:meth:`pieces` as numpy arrays of the pool (no lease: for the allocation's owner, while it holds it)."""
        arr = self.pool._array
        return [arr[addr:addr + n] for _off, addr, n in self.spans(start, stop)]


@dataclass
class _Lease:
    """What a view's numpy array rests on: the pool bytes it shows, and the allocation that owns them."""

    allocation: Allocation
    address: int
    nbytes: int

    @property
    def __array_interface__(self) -> dict[str, object]:
        return {"data": (self.address, False), "shape": (self.nbytes,), "typestr": "|u1", "version": 3}


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of uint8 host memory: page-locked, or mapped with a request for transparent huge pages."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # NOTE: a kernel without THP: 4 KiB pages, slower first touch, same behaviour
    return torch.frombuffer(mapping, dtype=torch.uint8)
