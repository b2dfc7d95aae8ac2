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

NOTE: finalisers take no locks. An allocation's finaliser can run anywhere a collection
can, including inside the pool's own critical section (a collection triggered by an
allocation made under ``_lock``), where taking the non-reentrant lock would deadlock the
thread. So it only appends its runs to a lock-free queue (``collections.deque``: append
and popleft are atomic in CPython), which every operation that takes the lock drains
first: the free and used counts a caller reads are exact.

NOTE: page faults. The buffer is mapped once but faulted in on first touch, which on a
VM runs at a twentieth of memcpy speed (measured here: 0.5 GB/s, huge pages or not,
against 9.5 GB/s for a copy into pages already there). So pages are handed out lowest
address first (a pool that is not full keeps reusing pages already faulted in), and a
background thread faults in a window ahead of the highest page handed out
(``MADV_POPULATE_WRITE``, without touching their bytes): a store then copies into pages
that are there, and the pool's resident memory grows with its use, not its size. The
window is as large as the part of the pool in use (16 MiB to 256 MiB), and its first
16 MiB are faulted in when the pool is made: a new pool's first small store neither
faults pages in nor sets off background work beside the request that made it.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from kvmem.errors import ConfigError
from kvmem.libc import libc_function
from kvmem.threads import yield_to_compute

__all__ = ["PAGE_BYTES", "Run", "ExtentAllocator", "HostPool", "Allocation"]

PAGE_BYTES = 4096
_AHEAD = 256 << 20  # bytes faulted in beyond the highest page handed out, at most
_AHEAD_MIN = 16 << 20  # ... and at least (the window is as large as the part of the pool in use: see allocate)
_POPULATE_STEP = 16 << 20
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
        self._lengths: list[int] = []  # sorted distinct lengths of free runs: best fit by bisect
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

    def free(self, runs: Iterable[Run]) -> None:
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
            raise ConfigError(
                f"HostPool(nbytes={nbytes!r}, page_bytes={page_bytes!r}): accepted nbytes >= 1 "
                "and page_bytes a positive multiple of 64"
            )
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
        self._freed: deque[tuple[Run, ...]] = deque()  # runs of dead allocations, given back under _lock
        # pinned memory is resident from the start; a mapping is faulted in ahead of use
        self._populated = self.nbytes if self.pinned or _MADVISE is None else 0
        self._populator: threading.Thread | None = None
        # NOTE: the first window is faulted in at open, so a new pool's first store (a request's) finds its pages there
        self._wanted = min(self.nbytes, _AHEAD_MIN)
        if self._populated < self._wanted:
            with self._lock:
                self._start_populating()

    @property
    def used_bytes(self) -> int:
        """Bytes of pages held by allocations (entries, and views that outlived them)."""
        return (self._allocator.num_pages - self._free_pages()) * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return self._free_pages() * self.page_bytes

    def _free_pages(self) -> int:
        """Pages free, counting those of every allocation gone by now."""
        with self._lock:
            self._drain()
            return self._allocator.free_pages

    def allocate(self, nbytes: int) -> Allocation | None:
        """Pages for ``nbytes`` (as few runs as the free space allows), or ``None`` when too few are free."""
        with self._lock:
            runs = self._take(max(1, -(-nbytes // self.page_bytes)))
            if runs is None:
                return None
            end = max(first + n for first, n in runs) * self.page_bytes
            # NOTE: the window grows with use, from 16 MiB up: faulting in ahead competes with the request
            # that triggered it for the cores and the address space, so a pool little used faults in little
            ahead = min(_AHEAD, max(_AHEAD_MIN, end))
            if end + ahead // 2 > self._wanted and self._populated < self.nbytes:
                # the window moves in steps of half of it, not page by page: one thread run per step
                self._wanted = min(self.nbytes, end + ahead)
                self._start_populating()
        # NOTE: a tuple of tuples of ints: the garbage collector stops tracking it (see kvmem.stores.cpu._Entry)
        return Allocation(self, tuple(runs), nbytes)

    def _take(self, pages: int) -> list[Run] | None:
        """``pages`` pages from the allocator, or ``None`` when too few are free (caller holds ``_lock``).

        NOTE: a collection inside the allocator's call can free allocations (their runs are
        queued, not given back): when that leaves too few pages, the queue is drained and
        the allocation tried again, so a caller never sees ``None`` while freed room waits.
        """
        while True:
            self._drain()
            runs = self._allocator.allocate(pages)
            if runs is not None or not self._freed:
                return runs

    def _drain(self) -> None:
        """Give the allocator the runs of allocations gone since the last drain (caller holds ``_lock``).

        NOTE: only a holder of ``_lock`` pops the queue (finalisers only append), so a
        non-empty check followed by ``popleft`` cannot find it empty.
        """
        freed = self._freed
        while freed:
            self._allocator.free(freed.popleft())

    def _start_populating(self) -> None:
        """Start the thread that faults pages in ahead of use, unless it runs (caller holds ``_lock``).

        NOTE: the thread lives only while there is work: it holds the pool, which must be
        able to go (and unmap its memory) once nothing else holds it.
        """
        if self._populator is None:
            self._populator = threading.Thread(target=self._populate_loop, name="kvmem-pool-populate", daemon=True)
            self._populator.start()

    def _populate_loop(self) -> None:
        """Fault in ``[populated, wanted)`` in steps, without writing a byte; exit when caught up."""
        yield_to_compute()
        while True:
            with self._lock:
                if self._populated >= self._wanted:
                    self._populator = None
                    return
                start, stop = self._populated, min(self._wanted, self._populated + _POPULATE_STEP)
            ok = _MADVISE(self._base + start, stop - start)  # type: ignore[misc]
            with self._lock:
                # a kernel older than 5.14 refuses: first touch faults the pages in, as without this
                self._populated = stop if ok else self.nbytes

    def array(self, address: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of the pool from host ``address`` (see :meth:`Allocation.address`) as a numpy view."""
        at = address - self._base
        return self._array[at : at + nbytes]

    def free_runs(self) -> list[Run]:
        with self._lock:
            self._drain()
            return self._allocator.free_runs()


class Allocation:
    """Pages of a :class:`HostPool` holding ``nbytes``, laid out over ``runs`` in order.

    The pages go back to the pool when the allocation is garbage: when its owner drops it
    and no view made by :meth:`view` / :meth:`pieces` is alive any more.
    """

    __slots__ = ("pool", "runs", "nbytes", "__weakref__")

    def __init__(self, pool: HostPool, runs: tuple[Run, ...], nbytes: int) -> None:
        self.pool = pool
        self.runs = runs
        self.nbytes = nbytes

    def __del__(self) -> None:
        # NOTE: no lock: this can run inside the pool's critical section (see the module docstring)
        self.pool._freed.append(self.runs)

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
        arr = self.pool._array
        out = []
        for _off, addr, n in self.spans(start, stop):
            leased = arr[addr : addr + n].view(_Leased)
            leased.allocation = self  # NOTE: the tensor holds the array, the array holds the allocation
            out.append(torch.from_numpy(leased))
        return out

    def address(self, start: int, stop: int) -> int | None:
        """The host address of byte ``start`` when bytes ``[start, stop)`` lie in one run (for the allocation's
        owner, while it holds it), else ``None``."""
        first, n = self.runs[0]
        if stop <= n * self.pool.page_bytes:
            return self.pool._base + first * self.pool.page_bytes + start
        return None

    def array(self, start: int = 0, stop: int | None = None) -> list[np.ndarray]:
        """:meth:`pieces` as numpy arrays of the pool (no lease: for the allocation's owner, while it holds it)."""
        arr = self.pool._array
        return [arr[addr : addr + n] for _off, addr, n in self.spans(start, stop)]


class _Leased(np.ndarray):
    """A view of pool bytes that holds the :class:`Allocation` owning them (its ``allocation`` attribute)."""

    allocation: Allocation


def _populate_write() -> Callable[[int, int], bool] | None:
    """``populate(address, length) -> ok``: fault pages in for writing without changing them
    (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+), or ``None`` where there is no such call.

    NOTE: through ctypes, which releases the GIL for the call (``mmap.madvise`` does not).
    """
    madvise = libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if madvise is None:
        return None
    return lambda address, length: madvise(address, length, _MADV_POPULATE_WRITE) == 0


_MADV_POPULATE_WRITE = 23
_MADVISE = _populate_write()


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of uint8 host memory: page-locked, or mapped with a request for transparent huge pages."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # a kernel without THP: 4 KiB pages, slower first touch, same behaviour
    return torch.frombuffer(mapping, dtype=torch.uint8)
