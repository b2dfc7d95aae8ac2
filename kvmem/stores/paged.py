"""Paged memory: a preallocated pool of fixed-size pages, a free list, refcounts, block tables.

The layout of vLLM's v1 block pool, for kvmem's device-resident storage:

- :class:`BlockPool` is bookkeeping only (no tensors): a free list whose order *is*
  the LRU order, a refcount per block, and a hash -> block map for prefix hits. A
  block whose refcount drops to 0 keeps its hash and goes to the tail of the free
  list; it is evicted (its hash forgotten) only when an allocation takes it from
  the head, so a freed chunk stays a prefix hit until memory is actually needed.
- :class:`BlockTable` maps a sequence's logical chunks to blocks.
- :class:`PagedBuffer` is the storage: one tensor of ``num_blocks`` pages of
  ``rows x cols`` elements, allocated once; reads and writes go through the
  gather/scatter ops of :mod:`kvmem.cuda` (a Triton kernel on CUDA).

Page granularity: one block id names a chunk of ``block_size`` tokens across all
layers (one hash, one refcount, one free-list entry per chunk, as chunk keys are
per chunk); the tensor behind it may be laid out per layer (``rows`` = layers x
K/V x heads) so that one layer's pages are one strided view the attention reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvmem.cuda import gather_pages, scatter_pages
from kvmem.errors import BlockError, ConfigError

__all__ = ["BlockError", "FreeBlockQueue", "BlockPool", "BlockTable", "PagedBuffer"]

_NONE = -1


class FreeBlockQueue:
    """Doubly linked list of free block ids: O(1) ``popleft``, ``append`` and ``remove``.

    Head = least recently freed = the next block to allocate (and evict).

    Args:
        num_blocks: ids ``0 .. num_blocks - 1``, all free, in id order.
    """

    def __init__(self, num_blocks: int) -> None:
        # NOTE: links live in two int lists (no node objects); _NONE ends the chain.
        self._prev = [i - 1 for i in range(num_blocks)]
        self._next = [i + 1 if i + 1 < num_blocks else _NONE for i in range(num_blocks)]
        self._in = [True] * num_blocks
        self._head = 0 if num_blocks else _NONE
        self._tail = num_blocks - 1 if num_blocks else _NONE
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return self._in[block]

    def __iter__(self) -> Iterator[int]:
        b = self._head
        while b != _NONE:
            yield b
            b = self._next[b]

    def popleft(self) -> int:
        """Take the head (least recently freed) block.

        Raises:
            BlockError: the queue is empty.
        """
        if self._head == _NONE:
            raise BlockError("no free block: the free queue is empty")
        b = self._head
        self.remove(b)
        return b

    def append(self, block: int) -> None:
        """Put ``block`` at the tail (most recently freed)."""
        self._prev[block], self._next[block] = self._tail, _NONE
        if self._tail == _NONE:
            self._head = block
        else:
            self._next[self._tail] = block
        self._tail = block
        self._in[block] = True
        self._len += 1

    def remove(self, block: int) -> None:
        """Unlink ``block`` from wherever it is (a cached block revived by a hit)."""
        prev, nxt = self._prev[block], self._next[block]
        if prev == _NONE:
            self._head = nxt
        else:
            self._next[prev] = nxt
        if nxt == _NONE:
            self._tail = prev
        else:
            self._prev[nxt] = prev
        self._prev[block] = self._next[block] = _NONE
        self._in[block] = False
        self._len -= 1


class BlockPool:
    """Refcounted blocks with an LRU free list and a hash -> block map.

    Args:
        num_blocks: blocks in the pool (>= 1).

    Raises:
        ConfigError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ConfigError(f"num_blocks={num_blocks!r}: accepted an integer >= 1")
        self.num_blocks = num_blocks
        self._free = FreeBlockQueue(num_blocks)
        self._refs = [0] * num_blocks
        self._hash_of: list[str | None] = [None] * num_blocks
        self._by_hash: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0 (cached or empty): what :meth:`allocate` can hand out."""
        return len(self._free)

    def free_order(self) -> list[int]:
        """Free blocks, next to be allocated (least recently freed) first."""
        return list(self._free)

    def ref_count(self, block: int) -> int:
        return self._refs[self._check(block)]

    def hash_of(self, block: int) -> str | None:
        """The hash ``block`` is cached under (kept while it is free until it is reallocated)."""
        return self._hash_of[self._check(block)]

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with refcount 1, evicting the least recently freed cached ones.

        Returns:
            The blocks, or ``None`` (nothing changed) when fewer than ``n`` are free: an
            expected condition the caller handles (offload, wait, refuse), not an error.
        """
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            old = self._hash_of[b]
            if old is not None:  # NOTE: evicted: its content is about to be overwritten
                del self._by_hash[old]
                self._hash_of[b] = None
            self._refs[b] = 1
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit or a shared chunk); revives free ones."""
        for b in blocks:
            if self._refs[self._check(b)] == 0:
                self._free.remove(b)
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block; at 0 it goes to the free list's tail, still cached.

        Pass a sequence's blocks tail first (:meth:`BlockTable.release` does) so that its
        last chunks are evicted before the prefix others may share.

        Raises:
            BlockError: a block whose refcount is already 0 (freed twice).
        """
        for b in blocks:
            if self._refs[self._check(b)] == 0:
                raise BlockError(f"block {b} freed with refcount 0: accepted only blocks allocated or touched")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def cache(self, block: int, block_hash: str) -> int:
        """Register ``block`` as holding the content named ``block_hash``.

        Returns:
            The block now cached under ``block_hash``: ``block``, or the block that held it
            already (first writer wins; the caller may free its copy and share that one).

        Raises:
            BlockError: ``block`` is free, or is cached under another hash.
        """
        if self._refs[self._check(block)] == 0:
            raise BlockError(f"block {block} is free: accepted only a referenced block")
        held = self._by_hash.get(block_hash)
        if held is not None:
            return held
        if self._hash_of[block] not in (None, block_hash):
            raise BlockError(f"block {block} is cached as {self._hash_of[block]!r}, not {block_hash!r}")
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return block

    def lookup(self, block_hash: str) -> int | None:
        """The block cached under ``block_hash`` (no reference taken), or ``None``."""
        return self._by_hash.get(block_hash)

    def match_prefix(self, hashes: Sequence[str]) -> list[int]:
        """The longest run of leading ``hashes`` that are cached, each block touched (referenced).

        NOTE: prefix-chained hashes: chunk ``i`` is only usable after chunks ``0..i-1``, so the
        run stops at the first miss.
        """
        out: list[int] = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        self.touch(out)
        return out

    def _check(self, block: int) -> int:
        if not (isinstance(block, int) and 0 <= block < self.num_blocks):
            raise BlockError(f"block {block!r}: accepted an id in [0, {self.num_blocks})")
        return block


@dataclass
class BlockTable:
    """One sequence's logical chunks -> blocks of a pool.

    Attributes:
        block_size: tokens per block.
        blocks: block of chunk ``i`` at index ``i``.
        num_tokens: tokens the sequence holds (the last block may be partly filled).
    """

    block_size: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def blocks_needed(self, new_tokens: int) -> int:
        """Blocks to allocate so that ``new_tokens`` more tokens fit."""
        return max(0, -(-(self.num_tokens + new_tokens) // self.block_size) - len(self.blocks))

    def grow(self, pool: BlockPool, new_tokens: int) -> bool:
        """Make room for ``new_tokens`` more tokens; whether the pool had the blocks (else nothing changed)."""
        got = pool.allocate(self.blocks_needed(new_tokens))
        if got is None:
            return False
        self.blocks += got
        self.num_tokens += new_tokens
        return True

    def share_prefix(self, pool: BlockPool, hashes: Sequence[str]) -> int:
        """Start an empty table with the cached run of ``hashes`` (referenced); tokens reused.

        Raises:
            BlockError: the table is not empty.
        """
        if self.blocks:
            raise BlockError(f"share_prefix on a table holding {len(self.blocks)} blocks: accepted an empty table")
        self.blocks = pool.match_prefix(hashes)
        self.num_tokens = len(self.blocks) * self.block_size
        return self.num_tokens

    def slot(self, token: int) -> tuple[int, int]:
        """``(block, offset in it)`` of token position ``token``."""
        if not 0 <= token < self.num_tokens:
            raise BlockError(f"token {token}: accepted a position in [0, {self.num_tokens})")
        return self.blocks[token // self.block_size], token % self.block_size

    def release(self, pool: BlockPool) -> None:
        """Free every block, tail first (see :meth:`BlockPool.free`), and empty the table."""
        pool.free(reversed(self.blocks))
        self.blocks, self.num_tokens = [], 0


class PagedBuffer:
    """``num_blocks`` pages of ``rows x cols`` elements in one tensor allocated once, with their pool.

    Args:
        num_blocks: pages.
        rows, cols: page shape; a gather of ``n`` pages gives ``[rows, n * cols]``
            (e.g. rows = K/V x heads and cols = tokens x head_dim: the model's layout).
        dtype, device: of the pages.
        pin_memory: pin a CPU buffer (for asynchronous copies to and from a GPU).
        storage: memory to lay the pages over instead of allocating it (a uint8 tensor of at
            least ``num_blocks * rows * cols`` elements' bytes on ``device``, e.g. pages the
            CPU tier lends: :meth:`kvmem.Memory.lease_host`).

    Raises:
        ConfigError: a page dimension < 1, or a ``storage`` too small.
    """

    def __init__(self, num_blocks: int, rows: int, cols: int, dtype: torch.dtype = torch.uint8,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 storage: torch.Tensor | None = None) -> None:
        if rows < 1 or cols < 1:
            raise ConfigError(f"page shape ({rows}, {cols}): accepted rows >= 1 and cols >= 1")
        self.pool = BlockPool(num_blocks)
        self.device = torch.device(device)
        shape = (num_blocks, rows, cols)
        if storage is not None:
            nbytes = num_blocks * rows * cols * dtype.itemsize
            if storage.numel() < nbytes or storage.dtype != torch.uint8 or storage.device != self.device:
                raise ConfigError(f"storage of {storage.numel()} {storage.dtype} on {storage.device}: accepted "
                                  f"at least {nbytes} uint8 on {self.device}")
            self.pages = storage[:nbytes].view(dtype).view(shape)
            return
        pin = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        # NOTE: the only allocation of page memory; every later read and write reuses it.
        self.pages = torch.empty(shape, dtype=dtype, device=self.device, pin_memory=pin)

    @property
    def page_nbytes(self) -> int:
        return self.pages[0].numel() * self.pages.element_size()

    def read(self, blocks: Sequence[int]) -> torch.Tensor:
        """A new ``[rows, len(blocks) * cols]`` tensor: the pages in table order."""
        return gather_pages(self.pages, self._ids(blocks))

    def write(self, blocks: Sequence[int], src: torch.Tensor) -> None:
        """Write ``src`` (``[rows, len(blocks) * cols]``, on this device) into the pages, in table order."""
        scatter_pages(self.pages, self._ids(blocks), src)

    def _ids(self, blocks: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(blocks), dtype=torch.int64, device=self.device)
