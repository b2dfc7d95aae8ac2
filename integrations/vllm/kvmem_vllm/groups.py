"""vLLM's KV cache groups, and which blocks of a chunk each one keeps (so which a chunk's entry holds).

With its hybrid KV cache manager on, vLLM gives each kind of layer a KV cache group of its own: full
attention keeps a block for every token, a sliding window only the blocks its window still reaches (the
ones before are freed while the request runs, and come back as vLLM's null block). The groups' layers
share the KV cache tensors (layer ``j`` of every group is a view of tensor ``j``), and a block id belongs
to one group at a time, so a block of any group is the same strided view of every tensor
(:class:`kvmem_vllm.worker.BlockViews`).

A chunk's entry holds, as its rows, the blocks each group keeps when a request's KV ends at the chunk's
end: every block of a full-attention group, the last blocks of a sliding-window group (those within its
window). A load that ends at a later chunk needs fewer of a sliding group's blocks, never other ones.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvmem.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["NULL_BLOCK", "GroupLayout", "UnsupportedLayout", "group_windows"]

NULL_BLOCK = 0  # vLLM's null block (BlockPool's first): what a sliding-window group holds outside its window


class UnsupportedLayout(ConfigError):
    """A KV cache group whose state kvmem-vllm does not store (a Mamba layer's, ...): the engine runs without
    reuse (the connector neither loads nor saves)."""


def group_windows(kv_cache_config: KVCacheConfig) -> tuple[int | None, ...]:
    """Per KV cache group, the tokens before a position that its layers keep (``sliding_window - 1`` plus
    the tokens vLLM retains below the window), ``None`` for full attention.

    Raises:
        UnsupportedLayout: a group of another kind (Mamba state, chunked local attention, ...), or groups
            of different block sizes.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    windows: list[int | None] = []
    sizes = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        sizes.add(spec.block_size)
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            windows.append(None)
        elif type(spec) is SlidingWindowSpec:
            windows.append(spec.sliding_window - 1 + spec.extra_retained_tokens)
        else:
            raise UnsupportedLayout(
                f"a KV cache group of {type(spec).__name__} ({', '.join(group.layer_names[:2])}, ...): kvmem-vllm "
                "stores full-attention and sliding-window attention KV only"
            )
    if len(sizes) > 1:
        raise UnsupportedLayout(f"KV cache groups of block sizes {sorted(sizes)}: kvmem-vllm needs one block size")
    return tuple(windows)


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Which blocks of a chunk the engine's KV cache groups keep: the rows of a chunk's entry.

    Attributes:
        windows: per group, what :func:`group_windows` says.
        block_size: vLLM's tokens per block.
        chunk_blocks: vLLM blocks per kvmem chunk.
    """

    windows: tuple[int | None, ...]
    block_size: int
    chunk_blocks: int

    @property
    def whole_requests(self) -> bool:
        """Whether a failed load fails its whole request (several groups: vLLM takes failed blocks of one
        group only, and recomputes a request whose asynchronous load failed)."""
        return len(self.windows) > 1

    def rows(self, chunk: int) -> list[tuple[int, int]]:
        """The rows of chunk ``chunk``'s entry, ``(group, block position in the request)``, group by group:
        every block of a full-attention group, the blocks of a sliding-window group that a request ending
        at the chunk's end keeps."""
        first = chunk * self.chunk_blocks
        end = (first + self.chunk_blocks) * self.block_size
        rows = []
        for group, kept in enumerate(self.windows):
            start = first if kept is None else max(first, max(0, end - kept) // self.block_size)
            rows += [(group, position) for position in range(start, first + self.chunk_blocks)]
        return rows
