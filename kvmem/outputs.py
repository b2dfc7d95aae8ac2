"""What a load writes into (``out=``): one tensor, or rows (a "scatter load").

``out`` is either one tensor of the stored tensor's shape and dtype, or a sequence of row
tensors: the stored value ``[len(rows), *row_shape]`` goes row by row into ``rows[i]``
(each of ``row_shape`` and the stored dtype, any layout and device: e.g. the blocks
``cache[:, b]`` of a paged KV cache, in any order), a ``None`` row being skipped.
Pure checks, no I/O: the tiers and the readers share them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmem.errors import OutputMismatch

__all__ = ["Out", "Rows", "check_out", "mismatch", "out_nbytes", "whole"]

Rows = list[torch.Tensor | None]
"""Row ``i`` of the stored tensor goes into ``rows[i]``; a ``None`` row is skipped."""

Out = torch.Tensor | Rows
"""What a load writes into, as :func:`check_out` returns it."""


def check_out(out: object) -> Out:
    """``out`` as a load writes into it: the tensor itself, or its rows as a new list.

    Raises:
        OutputMismatch: ``out`` is neither a tensor nor a sequence of tensors and ``None``.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Sequence) and not isinstance(out, (str, bytes)):
        rows = list(out)
        for i, row in enumerate(rows):
            if row is not None and not isinstance(row, torch.Tensor):
                raise OutputMismatch(
                    f"out[{i}]={type(row).__name__}: rows must each be a torch.Tensor (or None, to skip that row)"
                )
        return rows
    raise OutputMismatch(
        f"out={type(out).__name__}: expected a torch.Tensor, or a sequence of row tensors (or None) "
        "to load the value into"
    )


def mismatch(out: Out, shape: Sequence[int], dtype: torch.dtype | None) -> str | None:
    """Why ``out`` cannot hold a tensor of ``shape`` and ``dtype`` (``None``: it can), as a message naming
    the bad value and what is accepted."""
    stored = f"the stored tensor of shape {list(shape)} and dtype {_name(dtype)}"
    if isinstance(out, torch.Tensor):
        if out.shape == tuple(shape) and out.dtype == dtype:
            return None
        return f"out of shape {list(out.shape)} and dtype {_name(out.dtype)} cannot hold {stored}"
    accepted = (
        f"expected {shape[0]} rows of shape {list(shape[1:])} and dtype {_name(dtype)} (or None)"
        if len(shape)
        else "a 0-d tensor has no rows: load it into a tensor"
    )
    if not len(shape) or len(out) != shape[0]:
        return f"out of {len(out)} rows cannot hold {stored}: {accepted}"
    row_shape = tuple(shape[1:])
    for i, row in enumerate(out):
        if row is not None and (row.shape != row_shape or row.dtype != dtype):
            what = f"row {i} of shape {list(row.shape)} and dtype {_name(row.dtype)}"
            return f"out {what} cannot hold a row of {stored}: {accepted}"
    return None


def out_nbytes(out: Out) -> int:
    """Bytes a load writes into ``out`` (its rows that are given)."""
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    return sum(row.numel() * row.element_size() for row in out if row is not None)


def whole(out: Out) -> bool:
    """Whether ``out`` receives the whole value (a tensor, or rows none of which is ``None``)."""
    return isinstance(out, torch.Tensor) or all(row is not None for row in out)


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")
