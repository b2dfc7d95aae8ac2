"""Device kernels, each with a plain-torch reference.

Pattern: every op has a plain-torch reference in :mod:`kvmem.cuda.reference`
(tested on CPU in CI) and, when CUDA is present, a Triton implementation in
:mod:`kvmem.cuda.triton_ops` picked once at import by :func:`select` -- never per
call. The ops:

- :func:`gather_pages` / :func:`scatter_pages`: a block table's pages <-> one
  contiguous buffer (the paged pool of :mod:`kvmem.stores.paged`);
- :func:`group_minmax` / :func:`quantize_groups`: the steps of int8/int4 encoding in
  the format of :class:`kvmem.codecs.quant.QuantCodec` (:mod:`kvmem.cuda.kvquant`
  composes them);
- :func:`dequantize_into`: decode a KV chunk and write it straight into the model's
  cache layout (dequantize and scatter fused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

from kvmem.cuda import reference

__all__ = [
    "select",
    "HAS_CUDA",
    "ACCELERATED",
    "gather_pages",
    "scatter_pages",
    "group_minmax",
    "quantize_groups",
    "dequantize_into",
]

log = logging.getLogger(__name__)

HAS_CUDA = torch.cuda.is_available()
F = TypeVar("F", bound=Callable[..., object])


def select(reference: F, accelerated: F | None) -> F:
    """The implementation to use for the life of the process: ``accelerated`` on CUDA, else ``reference``."""
    return accelerated if HAS_CUDA and accelerated is not None else reference


def _triton_ops() -> ModuleType | None:
    """The Triton kernels, when CUDA is present and Triton imports; else ``None`` (references are used)."""
    if not HAS_CUDA:
        return None
    try:
        from kvmem.cuda import triton_ops  # late import: Triton needs a driver to import everywhere
    except ImportError as exc:
        log.warning("kvmem: CUDA is present but Triton is not (%s); using the torch reference kernels", exc)
        return None
    return triton_ops


def _on_cuda_tensors(ref: F, fast: F) -> F:
    """``fast`` for CUDA tensors, ``ref`` for others (host pages on a GPU machine), as torch dispatches ops."""

    def op(first: torch.Tensor, *args: object) -> object:
        return (fast if first.is_cuda else ref)(first, *args)

    op.__name__, op.__doc__ = ref.__name__, ref.__doc__
    return op  # type: ignore[return-value]


_fast = _triton_ops()
ACCELERATED = _fast is not None

# NOTE: chosen here, once per process; no call tries one implementation and falls back to another.
gather_pages = select(reference.gather_pages, _fast and _on_cuda_tensors(reference.gather_pages, _fast.gather_pages))
scatter_pages = select(
    reference.scatter_pages, _fast and _on_cuda_tensors(reference.scatter_pages, _fast.scatter_pages)
)
group_minmax = select(reference.group_minmax, _fast and _on_cuda_tensors(reference.group_minmax, _fast.group_minmax))
quantize_groups = select(
    reference.quantize_groups, _fast and _on_cuda_tensors(reference.quantize_groups, _fast.quantize_groups)
)
dequantize_into = select(
    reference.dequantize_into, _fast and _on_cuda_tensors(reference.dequantize_into, _fast.dequantize_into)
)
