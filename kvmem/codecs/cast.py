"""Lossless ``none`` and the float casts ``fp16`` / ``bf16``."""

from __future__ import annotations

from typing import Any

import torch

from kvmem.codecs.base import Encoded
from kvmem.errors import CodecError

__all__ = ["NoneCodec", "CastCodec"]

_FP16_MAX = torch.finfo(torch.float16).max


class NoneCodec:
    """Stores tensors as they are: bit-exact."""

    name = "none"
    lossless = True

    def encode(self, t: torch.Tensor, axis: int) -> Encoded:
        return {"data": t}, {}

    def decode(
        self, parts: dict[str, torch.Tensor], meta: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        return parts["data"]


class CastCodec:
    """Narrows floats wider than 16 bits to ``target``; 16-bit and narrower floats stay as they are.

    ``fp16`` refuses values outside its range (±65504) instead of storing ``inf``.
    """

    lossless = False

    def __init__(self, name: str, target: torch.dtype) -> None:
        self.name = name
        self.target = target

    def encode(self, t: torch.Tensor, axis: int) -> Encoded:
        if t.element_size() <= 2:
            return {"data": t}, {}
        if self.target == torch.float16 and t.numel():
            peak = float(t.abs().max())
            if peak > _FP16_MAX:
                raise CodecError(
                    f"codec fp16: value {peak:.6g} is outside the fp16 range (±{_FP16_MAX:.0f}); "
                    "use bf16, int8 or none for this tensor"
                )
        return {"data": t.to(self.target)}, {}

    def decode(
        self, parts: dict[str, torch.Tensor], meta: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        data = parts["data"]
        return data if data.dtype == dtype else data.to(dtype)
