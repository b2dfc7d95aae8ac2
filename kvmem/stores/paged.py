"""Paged memory: a preallocated pool of fixed-size pages, a free list, refcounts, block tables.

The layout of vLLM's v1 block pool, for kvmem's device-resident storage (the GPU tier,
:mod:`kvmem.stores.memory`) and the live offload's host pages (:mod:`kvmem.kv.offload`):

- :class:`BlockPool` is bookkeeping only (no tensors): a free list whose order *is*
  the LRU order and a refcount per block; a block whose refcount drops to 0 goes to
  the tail of the free list, and allocations take from the head.
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

from collections.abc import Iterable, Sequence
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
        # links live in two int lists (no node objects); _NONE ends the chain.
        self._prev = [i - 1 for i in range(num_blocks)]
        self._next = [i + 1 if i + 1 < num_blocks else _NONE for i in range(num_blocks)]
        self._head = 0 if num_blocks else _NONE
        self._tail = num_blocks - 1 if num_blocks else _NONE
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

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
        self._len += 1

    def remove(self, block: int) -> None:
        """Unlink ``block`` from wherever it is."""
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
        self._len -= 1


class BlockPool:
    """Refcounted blocks with an LRU free list.

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

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0: what :meth:`allocate` can hand out."""
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with refcount 1, the least recently freed first.

        Returns:
            The blocks, or ``None`` (nothing changed) when fewer than ``n`` are free: an
            expected condition the caller handles (offload, wait, refuse), not an error.
        """
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block; at 0 it goes to the free list's tail.

        Raises:
            BlockError: a block whose refcount is already 0 (freed twice).
        """
        for b in blocks:
            if self._refs[self._check(b)] == 0:
                raise BlockError(f"block {b} freed with refcount 0: accepted only allocated blocks")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

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

    def __init__(
        self,
        num_blocks: int,
        rows: int,
        cols: int,
        dtype: torch.dtype = torch.uint8,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        storage: torch.Tensor | None = None,
    ) -> None:
        if rows < 1 or cols < 1:
            raise ConfigError(f"page shape ({rows}, {cols}): accepted rows >= 1 and cols >= 1")
        self.pool = BlockPool(num_blocks)
        self.device = torch.device(device)
        shape = (num_blocks, rows, cols)
        if storage is not None:
            nbytes = num_blocks * rows * cols * dtype.itemsize
            if storage.numel() < nbytes or storage.dtype != torch.uint8 or storage.device != self.device:
                raise ConfigError(
                    f"storage of {storage.numel()} {storage.dtype} on {storage.device}: accepted "
                    f"at least {nbytes} uint8 on {self.device}"
                )
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
        return gather_pages(self.pages, self.ids(blocks))

    def write(self, blocks: Sequence[int] | torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` (``[rows, len(blocks) * cols]``, on this device) into the pages, in table order
        (``blocks`` may be :meth:`ids` already: a writer in several parts makes them once)."""
        ids = blocks if isinstance(blocks, torch.Tensor) else self.ids(blocks)
        scatter_pages(self.pages, ids, src)

    def ids(self, blocks: Sequence[int]) -> torch.Tensor:
        """``blocks`` as the index tensor the page kernels take, on this buffer's device."""
        return torch.tensor(list(blocks), dtype=torch.int64, device=self.device)
