"""BlockPool, BlockTable and PagedBuffer: properties (hypothesis) and round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.errors import ConfigError
from kvmem.stores.paged import BlockError, BlockPool, BlockTable, PagedBuffer

# (op, argument): allocate n | free a held block
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=OPS)
def test_pool_invariants_against_a_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """Allocations and the free list's LRU order follow a plain model of them, op by op."""
    pool = BlockPool(num_blocks)
    lru = list(range(num_blocks))  # the model's free list, next to allocate first
    held: list[int] = []
    for op, arg in ops:
        if op == "alloc":
            got = pool.allocate(arg)
            if arg > len(lru):
                assert got is None
                continue
            assert got == lru[:arg], "allocation takes the least recently freed blocks"
            del lru[:arg]
            held += got
        elif held:
            b = held.pop(arg % len(held))
            pool.free([b])
            lru.append(b)
        assert pool.num_free == len(lru)
    assert pool.allocate(len(lru)) == lru


def test_block_table_grows_or_changes_nothing() -> None:
    pool = BlockPool(6)
    first = BlockTable(block_size=4)
    assert first.grow(pool, 10) and first.blocks == [0, 1, 2] and first.num_tokens == 10
    assert first.grow(pool, 2) and first.blocks == [0, 1, 2] and first.num_tokens == 12, "the last block had room"
    assert not first.grow(pool, 100) and first.blocks == [0, 1, 2], "a failed grow changes nothing"
    assert first.num_tokens == 12 and pool.num_free == 3


def test_bad_use_is_refused_with_the_value_named() -> None:
    with pytest.raises(ConfigError, match="num_blocks=0"):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(BlockError, match="block 0 freed with refcount 0"):
        pool.free([0])
    with pytest.raises(BlockError, match=r"block 7: accepted an id in \[0, 2\)"):
        pool.free([7])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 9), picks=st.lists(st.integers(0, 9), max_size=10, unique=True))
def test_paged_buffer_gather_scatter_round_trip(rows: int, cols: int, picks: list[int]) -> None:
    buf = PagedBuffer(10, rows, cols, torch.float32)
    buf.pages.zero_()
    src = torch.arange(rows * len(picks) * cols, dtype=torch.float32).reshape(rows, -1)
    buf.write(picks, src)
    assert torch.equal(buf.read(picks), src)
    for j, b in enumerate(picks):  # page b's row r holds its own slice of the contiguous buffer
        assert torch.equal(buf.pages[b], src[:, j * cols : (j + 1) * cols])
    untouched = [b for b in range(10) if b not in picks]
    assert not buf.pages[untouched].any()
