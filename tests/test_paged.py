"""BlockPool, FreeBlockQueue, BlockTable and PagedBuffer: properties (hypothesis) and round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.errors import ConfigError
from kvmem.stores.paged import BlockError, BlockPool, BlockTable, PagedBuffer

# (op, argument): allocate n | free a held block | touch a held block | cache a held block under a hash
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "free", "touch", "cache"]), st.integers(0, 5)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=OPS)
def test_pool_invariants_against_a_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """Refcounts, the free list's LRU order and the hash map follow a plain model of them, op by op."""
    pool = BlockPool(num_blocks)
    refs = [0] * num_blocks
    lru = list(range(num_blocks))  # the model's free list, next to allocate first
    hashes: dict[str, int] = {}
    held: list[int] = []  # one entry per reference taken
    for op, arg in ops:
        if op == "alloc":
            got = pool.allocate(arg)
            if arg > len(lru):
                assert got is None
                continue
            assert got == lru[:arg], "allocation takes the least recently freed blocks"
            del lru[:arg]
            for b in got:
                hashes = {h: x for h, x in hashes.items() if x != b}  # reallocating evicts a cached block
                refs[b] = 1
            held += got
        elif op in ("free", "touch") and held:
            b = held[arg % len(held)]
            if op == "free":
                held.remove(b)
                pool.free([b])
                refs[b] -= 1
                if refs[b] == 0:
                    lru.append(b)
            else:
                pool.touch([b])
                refs[b] += 1
                held.append(b)
        elif op == "cache" and held:
            b = held[arg % len(held)]
            h = f"h{arg}"
            if pool.hash_of(b) not in (None, h) and h not in hashes:
                with pytest.raises(BlockError):
                    pool.cache(b, h)
                continue
            assert pool.cache(b, h) == hashes.setdefault(h, b)
        assert [pool.ref_count(b) for b in range(num_blocks)] == refs
        assert pool.free_order() == lru and pool.num_free == len(lru)
        assert all(pool.lookup(h) == b for h, b in hashes.items())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
def test_freed_cached_blocks_stay_prefix_hits_until_reallocated(order: list[int]) -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(8)
    assert blocks is not None
    for b in blocks:
        pool.cache(b, f"chunk{b}")
    pool.free([blocks[i] for i in order])
    assert pool.free_order()[-len(order):] == [blocks[i] for i in order]
    hits = pool.match_prefix([f"chunk{b}" for b in blocks])
    assert hits == blocks  # every chunk still cached: the whole prefix hits, the freed ones are revived
    assert all(pool.ref_count(b) >= 1 for b in blocks)
    pool.free(blocks)
    evicted = pool.allocate(1)
    assert evicted is not None and pool.lookup(f"chunk{evicted[0]}") is None


def test_block_table_grows_shares_and_releases_tail_first() -> None:
    pool = BlockPool(6)
    first = BlockTable(block_size=4)
    assert first.grow(pool, 10) and first.blocks == [0, 1, 2] and first.num_tokens == 10
    assert first.slot(9) == (2, 1)
    for i, b in enumerate(first.blocks[:2]):
        pool.cache(b, f"c{i}")
    second = BlockTable(block_size=4)
    assert second.share_prefix(pool, ["c0", "c1", "c2"]) == 8 and second.blocks == [0, 1]
    assert pool.ref_count(0) == 2
    assert not second.grow(pool, 100) and second.blocks == [0, 1], "a failed grow changes nothing"
    first.release(pool)
    assert pool.free_order() == [3, 4, 5, 2] and pool.ref_count(0) == 1
    second.release(pool)
    assert pool.free_order() == [3, 4, 5, 2, 1, 0], "tail chunks go first, the shared prefix last"


def test_bad_use_is_refused_with_the_value_named() -> None:
    with pytest.raises(ConfigError, match="num_blocks=0"):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(BlockError, match="block 0 freed with refcount 0"):
        pool.free([0])
    with pytest.raises(BlockError, match=r"block 7: accepted an id in \[0, 2\)"):
        pool.touch([7])
    with pytest.raises(BlockError, match="block 1 is free"):
        pool.cache(1, "x")
    with pytest.raises(BlockError, match="token 5"):
        BlockTable(4).slot(5)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 9), picks=st.lists(st.integers(0, 9), max_size=10, unique=True))
def test_paged_buffer_gather_scatter_round_trip(rows: int, cols: int, picks: list[int]) -> None:
    buf = PagedBuffer(10, rows, cols, torch.float32)
    buf.pages.zero_()
    src = torch.arange(rows * len(picks) * cols, dtype=torch.float32).reshape(rows, -1)
    buf.write(picks, src)
    assert torch.equal(buf.read(picks), src)
    for j, b in enumerate(picks):  # page b's row r holds its own slice of the contiguous buffer
        assert torch.equal(buf.pages[b], src[:, j * cols:(j + 1) * cols])
    untouched = [b for b in range(10) if b not in picks]
    assert not buf.pages[untouched].any()
