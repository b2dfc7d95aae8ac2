"""Device kernels, each with a plain-torch reference.

Pattern: every op has ``reference_<op>`` in plain torch (tested on CPU in CI)
and, when CUDA is present, a Triton implementation picked once at import by
:func:`select` -- never per call. No kernels are needed by the CPU/disk path
yet; the GPU path (paged pool, device quantization) adds them here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["select", "HAS_CUDA"]

HAS_CUDA = torch.cuda.is_available()
F = TypeVar("F", bound=Callable[..., object])


def select(reference: F, accelerated: F | None) -> F:
    """The implementation to use for the life of the process: ``accelerated`` on CUDA, else ``reference``."""
    return accelerated if HAS_CUDA and accelerated is not None else reference
