"""The codec seams: a tensor codec (cast / quantize) and a byte codec (lz4)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["TensorCodec", "ByteCodec", "Encoded"]

Encoded = tuple[dict[str, torch.Tensor], dict[str, Any]]
"""A tensor codec's output: named CPU tensors to store, and JSON-able metadata."""


class TensorCodec(Protocol):
    """Turns one floating-point tensor into tensors to store, and back.

    Codecs apply to floating-point tensors only; integer and bool tensors are
    always stored as they are.
    """

    name: str
    lossless: bool

    def encode(self, t: torch.Tensor, axis: int) -> Encoded:
        """Encode ``t`` (contiguous, on CPU). ``axis`` is the dimension quantization
        groups run along (-1: per token; -2: per channel, for attention keys)."""
        ...

    def decode(
        self, parts: dict[str, torch.Tensor], meta: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Rebuild a tensor of ``dtype`` and ``shape`` from ``encode``'s output."""
        ...


class ByteCodec(Protocol):
    """Compresses the bytes of one stored segment."""

    name: str

    def compress(self, data: np.ndarray, itemsize: int) -> np.ndarray:
        """Compress uint8 ``data`` whose elements are ``itemsize`` bytes wide."""
        ...

    def decompress(self, data: np.ndarray, raw_nbytes: int, itemsize: int) -> np.ndarray:
        """Inverse of :meth:`compress`."""
        ...
