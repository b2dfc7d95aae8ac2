"""The host pool (kvmem/pool.py): extent bookkeeping to the page, and allocations whose views hold their pages."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvmem import pool as poolmod
from kvmem.errors import ConfigError
from kvmem.pool import Allocation, ExtentAllocator, HostPool

PAGE = 4096


# =================================================================================================
# ExtentAllocator: bookkeeping only
# =================================================================================================
def test_allocations_come_lowest_address_first_and_free_merges_both_neighbours() -> None:
    ext = ExtentAllocator(16)
    a, b, c = ext.allocate(4), ext.allocate(4), ext.allocate(4)
    assert (a, b, c) == ([(0, 4)], [(4, 4)], [(8, 4)])
    assert ext.free_runs() == [(12, 4)] and ext.free_pages == 4
    ext.free(b)
    assert ext.free_runs() == [(4, 4), (12, 4)] and ext.free_pages == 8
    ext.free(c)  # between the hole left by b and the tail: one run
    assert ext.free_runs() == [(4, 12)]
    ext.free(a)  # left of it: everything is one run again
    assert ext.free_runs() == [(0, 16)] and ext.free_pages == 16
    assert ext.allocate(16) == [(0, 16)] and ext.free_runs() == [] and ext.free_pages == 0


def test_free_merges_with_a_left_neighbour_only() -> None:
    ext = ExtentAllocator(10)
    a, b, c = ext.allocate(3), ext.allocate(3), ext.allocate(4)
    ext.free(a)
    ext.free(b)
    assert ext.free_runs() == [(0, 6)]
    assert c == [(6, 4)] and ext.free_pages == 6


def test_best_fit_takes_the_smallest_run_that_holds_the_request() -> None:
    ext = ExtentAllocator(16)
    a, _b, c, _d = ext.allocate(5), ext.allocate(1), ext.allocate(3), ext.allocate(7)
    ext.free(a)
    ext.free(c)
    assert ext.free_runs() == [(0, 5), (6, 3)]
    assert ext.allocate(3) == [(6, 3)]  # not the first run that fits (0, 5): the smallest
    assert ext.free_runs() == [(0, 5)]
    assert ext.allocate(2) == [(0, 2)]
    assert ext.free_runs() == [(2, 3)] and ext.free_pages == 3


def test_best_fit_among_equal_runs_takes_the_lowest_address() -> None:
    ext = ExtentAllocator(12)
    runs = [ext.allocate(2) for _ in range(6)]
    for i in (4, 2, 0):
        ext.free(runs[i])
    assert ext.free_runs() == [(0, 2), (4, 2), (8, 2)]
    assert ext.allocate(1) == [(0, 1)]  # the smallest length is now 1, at 1
    assert ext.allocate(2) == [(4, 2)]
    assert ext.free_runs() == [(1, 1), (8, 2)]


def test_fragmented_pool_allocates_several_runs_covering_exactly_n_pages() -> None:
    ext = ExtentAllocator(16)
    runs = [ext.allocate(2) for _ in range(8)]
    for i in range(0, 8, 2):
        ext.free(runs[i])
    assert ext.free_runs() == [(0, 2), (4, 2), (8, 2), (12, 2)] and ext.free_pages == 8
    got = ext.allocate(5)  # no free run holds 5 pages, 8 are free
    assert got == [(0, 2), (4, 2), (8, 1)]
    assert sum(n for _s, n in got) == 5
    held = {p for i in range(1, 8, 2) for s, n in runs[i] for p in range(s, s + n)}
    assert held.isdisjoint(p for s, n in got for p in range(s, s + n))
    assert ext.free_runs() == [(9, 1), (12, 2)] and ext.free_pages == 3
    ext.free(got)
    assert ext.free_runs() == [(0, 2), (4, 2), (8, 2), (12, 2)] and ext.free_pages == 8


def test_fragmented_allocation_takes_the_longest_runs_first() -> None:
    ext = ExtentAllocator(20)
    runs = [ext.allocate(n) for n in (1, 1, 4, 1, 2, 1, 10)]
    for i in (0, 2, 4):
        ext.free(runs[i])
    assert ext.free_runs() == [(0, 1), (2, 4), (7, 2)]
    assert ext.allocate(6) == [(2, 4), (7, 2)]
    assert ext.free_runs() == [(0, 1)] and ext.free_pages == 1


def test_too_few_free_pages_is_none_and_changes_nothing() -> None:
    ext = ExtentAllocator(8)
    a = ext.allocate(3)
    ext.allocate(2)
    ext.free(a)
    before = ext.free_runs()
    assert before == [(0, 3), (5, 3)]
    assert ext.allocate(7) is None
    assert ext.free_runs() == before and ext.free_pages == 6
    assert ext.allocate(6) == [(0, 3), (5, 3)]  # exactly what is free: two runs
    assert ext.free_pages == 0 and ext.allocate(1) is None


def test_allocator_refuses_an_empty_range() -> None:
    with pytest.raises(ConfigError, match="num_pages"):
        ExtentAllocator(0)


# =================================================================================================
# HostPool and Allocation: the memory
# =================================================================================================
def test_pool_rounds_up_to_pages_and_refuses_bad_page_sizes() -> None:
    pool = HostPool(10 * PAGE + 1, page_bytes=PAGE, pin_memory=False)
    assert pool.nbytes == 11 * PAGE and pool.free_bytes == 11 * PAGE and pool.used_bytes == 0
    assert pool.buffer.numel() == 11 * PAGE
    for bad in ((0, PAGE), (PAGE, 32), (PAGE, 100)):
        with pytest.raises(ConfigError):
            HostPool(bad[0], page_bytes=bad[1], pin_memory=False)


def test_bytes_written_through_one_view_are_seen_through_every_other() -> None:
    pool = HostPool(8 * PAGE, page_bytes=PAGE, pin_memory=False)
    alloc = pool.allocate(2 * PAGE + 100)
    assert alloc is not None and alloc.runs == ((0, 3),) and alloc.contiguous and alloc.pages == 3
    assert pool.used_bytes == 3 * PAGE
    whole = alloc.view()
    assert whole.numel() == 2 * PAGE + 100 and whole.dtype == torch.uint8
    part = alloc.view(PAGE - 10, PAGE + 10)
    pattern = torch.arange(20, dtype=torch.uint8) + 1
    part.copy_(pattern)
    assert torch.equal(whole[PAGE - 10 : PAGE + 10], pattern)
    (arr,) = alloc.array(PAGE - 10, PAGE + 10)
    assert arr.tolist() == pattern.tolist()
    arr[:] = 200  # the owner's numpy view writes the same pages
    assert whole[PAGE - 10 : PAGE + 10].tolist() == [200] * 20
    (piece,) = alloc.pieces()
    assert piece.data_ptr() == whole.data_ptr() == pool.buffer.data_ptr()
    assert pool.buffer[PAGE - 10 : PAGE + 10].tolist() == [200] * 20


def test_a_view_outliving_its_allocation_keeps_the_pages() -> None:
    pool = HostPool(8 * PAGE, page_bytes=PAGE, pin_memory=False)
    alloc = pool.allocate(2 * PAGE)
    assert alloc is not None and alloc.runs == ((0, 2),)
    view = alloc.view()[PAGE // 2 :]  # a slice of a view holds the pages too
    view.fill_(0x5A)
    del alloc
    gc.collect()
    assert pool.used_bytes == 2 * PAGE, "the pages went back while a view of them was alive"
    other = pool.allocate(2 * PAGE)
    assert other is not None and other.runs == ((2, 2),), "a new allocation got pages a view still shows"
    other.view().fill_(0xFF)
    assert view.tolist() == [0x5A] * (PAGE + PAGE // 2)
    del view
    gc.collect()
    assert pool.used_bytes == 2 * PAGE  # only `other`
    assert pool.free_runs() == [(0, 2), (4, 4)]
    again = pool.allocate(PAGE + 1)
    assert again is not None and again.runs == ((0, 2),)  # the freed pages, reused lowest address first
    del other, again
    gc.collect()
    assert pool.used_bytes == 0 and pool.free_runs() == [(0, 8)]


def test_a_numpy_array_from_a_piece_keeps_the_pages() -> None:
    pool = HostPool(4 * PAGE, page_bytes=PAGE, pin_memory=False)
    alloc = pool.allocate(PAGE)
    assert alloc is not None
    arr = alloc.pieces()[0].numpy()
    del alloc
    gc.collect()
    assert pool.used_bytes == PAGE
    del arr
    gc.collect()
    assert pool.used_bytes == 0


def test_multi_run_allocation_has_no_single_view_and_its_pieces_cover_the_bytes_in_order() -> None:
    pool = HostPool(8 * PAGE, page_bytes=PAGE, pin_memory=False)
    singles = [pool.allocate(PAGE) for _ in range(8)]
    assert pool.allocate(1) is None  # full
    for i in range(0, 8, 2):
        singles[i] = None
    gc.collect()
    assert pool.free_runs() == [(0, 1), (2, 1), (4, 1), (6, 1)]
    nbytes = 3 * PAGE - 10
    alloc = pool.allocate(nbytes)
    assert alloc is not None and alloc.runs == ((0, 1), (2, 1), (4, 1)) and not alloc.contiguous
    with pytest.raises(ValueError, match="3 runs"):
        alloc.view()
    with pytest.raises(ValueError, match="2 runs"):
        alloc.view(PAGE - 4, PAGE + 4)
    assert alloc.view(PAGE + 8, 2 * PAGE).numel() == PAGE - 8  # inside one run: one view
    pieces = alloc.pieces()
    assert [p.numel() for p in pieces] == [PAGE, PAGE, PAGE - 10]
    assert [p.data_ptr() - pool.buffer.data_ptr() for p in pieces] == [0, 2 * PAGE, 4 * PAGE]
    pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    at = 0
    for p in pieces:
        p.copy_(pattern[at : at + p.numel()])
        at += p.numel()
    buf = pool.buffer
    assert torch.equal(buf[0:PAGE], pattern[:PAGE])
    assert torch.equal(buf[2 * PAGE : 3 * PAGE], pattern[PAGE : 2 * PAGE])
    assert torch.equal(buf[4 * PAGE : 5 * PAGE - 10], pattern[2 * PAGE :])
    assert torch.cat(alloc.pieces()).tolist() == pattern.tolist()
    straddle = alloc.pieces(PAGE - 4, PAGE + 6)
    assert [p.tolist() for p in straddle] == [pattern[PAGE - 4 : PAGE].tolist(), pattern[PAGE : PAGE + 6].tolist()]
    assert [a.size for a in alloc.array(10, nbytes)] == [PAGE - 10, PAGE, PAGE - 10]
    assert [span for span in alloc.spans(PAGE - 4, PAGE + 6)] == [(PAGE - 4, PAGE - 4, 4), (PAGE, 2 * PAGE, 6)]


# =================================================================================================
# Finalisers take no locks: a collection inside the pool's critical section
# =================================================================================================
@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """Only the collections a test forces: a cycle it makes stays pending until then."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _collect_inside_allocate(pool: HostPool, collected: list[int]) -> None:
    """Force a collection in ``pool.allocate``'s critical section (under its lock), recording what it freed.

    NOTE: a hook only to choose the moment: when a real collection runs cannot be arranged.
    """
    allocate = pool._allocator.allocate

    def collecting(n: int) -> list[tuple[int, int]] | None:
        collected.append(gc.collect(0))
        return allocate(n)

    pool._allocator.allocate = collecting  # type: ignore[method-assign]


def _pending_in_a_cycle(alloc: Allocation) -> weakref.ref[Allocation]:
    """Drop ``alloc`` but for a view of it held by a reference cycle: only a collection frees its pages."""
    cycle: list[object] = [alloc.view()]
    cycle.append(cycle)
    return weakref.ref(alloc)


def _within(seconds: float, work: Callable[[], None]) -> None:
    """Run ``work`` in a thread; a deadlock fails the test after ``seconds`` instead of hanging it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="kvmem-test-allocate", daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"deadlock: the thread did not return within {seconds} s"
    if errors:
        raise errors[0]


def test_a_view_freed_by_a_collection_inside_allocate_neither_deadlocks_nor_loses_its_pages(
    no_automatic_gc: None,
) -> None:
    pool = HostPool(4 * PAGE, page_bytes=PAGE, pin_memory=False)
    collected: list[int] = []
    _collect_inside_allocate(pool, collected)

    def one_round() -> None:
        alloc = pool.allocate(4 * PAGE)  # the whole pool
        assert alloc is not None and pool.free_bytes == 0
        gone = _pending_in_a_cycle(alloc)
        del alloc
        assert pool.used_bytes == 4 * PAGE  # the cycle holds the view: the pages are still in use
        collected.clear()
        again = pool.allocate(4 * PAGE)  # needs the pages the collection frees, under the lock
        assert collected[0] > 0 and gone() is None, "the pending view was not freed inside allocate"
        assert again is not None and again.runs == ((0, 4),), "the pages freed inside allocate were lost"
        assert pool.used_bytes == 4 * PAGE
        del again
        assert pool.used_bytes == 0 and pool.free_runs() == [(0, 4)]

    def rounds() -> None:
        for _ in range(1000):  # the bar: 1,000 in a row
            one_round()

    _within(10, rounds)


def test_usage_counts_pages_freed_by_a_collection_outside_the_pool(no_automatic_gc: None) -> None:
    pool = HostPool(4 * PAGE, page_bytes=PAGE, pin_memory=False)
    alloc = pool.allocate(2 * PAGE)
    assert alloc is not None
    _pending_in_a_cycle(alloc)
    del alloc
    assert pool.used_bytes == 2 * PAGE and pool.free_bytes == 2 * PAGE
    assert gc.collect() > 0
    assert pool.used_bytes == 0 and pool.free_bytes == 4 * PAGE and pool.free_runs() == [(0, 4)]


def _resident(pool: HostPool) -> int:
    """Bytes of ``pool``'s mapping resident in memory now (its ``Rss`` in ``/proc/self/smaps``)."""
    start = f"{pool._base:x}-"
    lines = Path("/proc/self/smaps").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    rss = next(line for line in lines[at + 1 :] if line.startswith("Rss:"))
    return int(rss.split()[1]) * 1024


@pytest.mark.skipif(
    poolmod._MADVISE is None or not Path("/proc/self/smaps").exists(),
    reason="needs MADV_POPULATE_WRITE (Linux 5.14+) and /proc to read the mapping's residency",
)
def test_pages_are_faulted_in_ahead_of_use_by_a_window_that_grows_with_it() -> None:
    """A new pool faults in its first 16 MiB at once, and its first small allocation keeps that window (not 256 MiB);
    once 64 MiB are in use, the window is 64 MiB: the pool's resident memory follows its use."""
    pool = HostPool(512 << 20, pin_memory=False)
    _wait_populated(pool)
    assert 16 << 20 <= _resident(pool) <= 24 << 20
    first = pool.allocate(4096)
    _wait_populated(pool)
    assert 16 << 20 <= _resident(pool) <= 24 << 20
    more = pool.allocate(64 << 20)
    _wait_populated(pool)
    assert 128 << 20 <= _resident(pool) <= 136 << 20
    del first, more


def _wait_populated(pool: HostPool) -> None:
    for _ in range(1000):
        with pool._lock:
            if pool._populator is None:
                return
        time.sleep(0.01)
    raise AssertionError("the pool's populating thread did not finish within 10 s")
