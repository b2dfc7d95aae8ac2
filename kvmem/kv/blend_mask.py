"""The attention mask of ``BlendCache``'s selected tokens, and SDPA computed group by group over it.

Above the check layer ``BlendCache`` computes a few hundred tokens spread over a prompt of
thousands, each attending to the keys up to its own position. No SDPA kernel takes that
pattern: with an explicit mask it computes every key for every query, about twice the work
of the causal kernel per query. :class:`GroupedMask` is that explicit mask (a plain, correct
additive mask to anything that reads it) which, when handed to
``torch.nn.functional.scaled_dot_product_attention``, cuts the queries into runs of
consecutive positions and attends each run to the keys it can see only (up to its last
position, and within a sliding window), through views of itself: the same result for
about ``(1 + 1/G) / 2`` of the work with ``G`` runs.

``BlendCache`` uses it on the CPU, where attention is bound by arithmetic; on a GPU, where
it is bound by kernel launches, one masked call is faster (see ``BlendCache._mask``).

NOTE: it works through ``__torch_function__``, PyTorch's documented hook for tensor
subclasses, so transformers' SDPA attention needs no change and a model is never modified;
every other operation on the mask (eager attention adds it to its scores) sees the plain
tensor and computes the full, equal result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["GROUP_QUERIES", "MAX_GROUPS", "GroupedMask", "attention_mask"]

GROUP_QUERIES = 64
"""Fewest queries in a run of :class:`GroupedMask` (smaller runs cost more in calls than they save)."""
MAX_GROUPS = 16
"""Most runs of :class:`GroupedMask`."""
_KEY_ALIGN = 16
# NOTE: a run's first key is a multiple of this: CUDA's memory-efficient SDPA kernel reads the mask in
# 16-byte vectors and fails with "misaligned address" on a view that starts between them (seen on an H200;
# PyTorch pads a mask whose row stride is unaligned, but does not check where a view starts). The keys
# this adds before the window are masked out.


class GroupedMask(torch.Tensor):
    """An additive mask ``[1, 1, q, k]`` that SDPA computes in runs of queries (see the module docstring).

    Attributes:
        runs: per run, ``(its queries, the keys they see)`` as slices of the mask's two last dimensions.
    """

    runs: tuple[tuple[slice, slice], ...]

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        mask = kwargs.get("attn_mask")
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.scaled_dot_product_attention and isinstance(mask, GroupedMask) and len(args) == 3:
                return mask._attend(*args, **{k: v for k, v in kwargs.items() if k != "attn_mask"})
            return func(*args, **kwargs)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options: Any) -> torch.Tensor:
        plain = self.as_subclass(torch.Tensor)
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[:, :, queries],
                    key[:, :, keys],
                    value[:, :, keys],
                    attn_mask=plain[..., queries, keys],
                    **options,
                )
                for queries, keys in self.runs
            ],
            dim=2,
        )


def attention_mask(
    queries: torch.Tensor, total: int, window: int | None, dtype: torch.dtype, *, grouped: bool = True
) -> torch.Tensor:
    """The additive mask ``[1, 1, q, total]`` of ``queries`` (sorted positions) over a prompt of ``total``
    tokens: a query at ``p`` sees keys ``<= p`` (and ``> p - window``); a :class:`GroupedMask` when
    ``grouped`` (for SDPA) and it has more than one run of :data:`GROUP_QUERIES`."""
    keys = torch.arange(total, device=queries.device)
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed &= keys[None, :] > queries[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=queries.device)
    mask = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
    count = queries.numel()
    size = max(GROUP_QUERIES, -(-count // MAX_GROUPS))
    if not grouped or count <= size:
        return mask
    at = queries.tolist()  # NOTE: one device sync, not two per run
    runs = []
    for start in range(0, count, size):
        first, last = at[start], at[min(start + size, count) - 1]
        lo = 0 if window is None else max(0, first - window + 1) // _KEY_ALIGN * _KEY_ALIGN
        runs.append((slice(start, start + size), slice(lo, last + 1)))
    split = mask.as_subclass(GroupedMask)
    split.runs = tuple(runs)
    return split
