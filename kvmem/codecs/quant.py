"""Group-wise affine ``int8`` / ``int4`` quantization.

Each group of ``group`` consecutive elements along ``axis`` stores its minimum and
step (fp16, or fp32 when fp16 is too coarse for them); elements are rounded to the
nearest of ``2**bits`` levels, so the error of every element is at most half a step.
For attention KV the caller passes ``axis=-2`` for keys (per-channel groups along
tokens) and ``axis=-1`` for values (per-token groups along channels), as KIVI does.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmem.codecs.base import Encoded
from kvmem.errors import CodecError

__all__ = ["QuantCodec"]

_SLACK = 2.0**-8  # rounded scales may widen the half-step bound by this fraction of a step
_FP32_EPS = 2.0**-22  # float32 arithmetic error, relative to the magnitudes involved


class QuantCodec:
    """Affine quantization to ``bits`` (8 or 4) with ``group`` elements per scale."""

    lossless = False

    def __init__(self, bits: int, group: int = 64) -> None:
        if bits not in (4, 8) or group % 2:
            raise CodecError(f"QuantCodec(bits={bits}, group={group}): bits must be 4 or 8, group even")
        self.bits = bits
        self.group = group
        self.levels = (1 << bits) - 1
        self.name = f"int{bits}"

    def encode(self, t: torch.Tensor, axis: int) -> Encoded:
        if t.ndim == 0 or t.numel() == 0:
            return {"data": t}, {"raw": True}
        x, meta = self.groups(t, axis if -t.ndim <= axis < t.ndim else -1)
        lo_s, step = self.scales(x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True))
        q = torch.round((x - lo_s.float()) / step.float()).clamp_(0, self.levels).to(torch.uint8)
        if self.bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        return {"q": q.contiguous(), "step": step.contiguous(), "lo": lo_s.contiguous()}, meta

    def groups(self, t: torch.Tensor, axis: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """``t`` as fp32 groups ``[rows, G, group]`` along ``axis`` (the last group padded with its last
        element), and the codec's ``meta`` for them."""
        moved = t.movedim(axis, -1)
        moved_shape = list(moved.shape)
        cols = moved_shape[-1]
        group = min(self.group, cols + cols % 2)
        padded = -(-cols // group) * group
        x = moved.reshape(-1, cols).float()
        if padded != cols:
            x = torch.cat([x, x[:, -1:].expand(-1, padded - cols)], dim=1)
        meta = {"axis": axis, "group": group, "cols": cols, "moved_shape": moved_shape}
        return x.reshape(x.shape[0], padded // group, group), meta

    def scales(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's stored minimum and step: fp16, or fp32 where fp16 breaks the half-step bound.

        Raises:
            CodecError: a group holds inf or nan.
        """
        if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            raise CodecError(f"codec {self.name}: tensor holds inf or nan; use none, fp16 or bf16 for it")
        lo_s, step = self._scales(lo, hi, torch.float16)
        if not self._within_half_step(lo, hi, lo_s, step):
            lo_s, step = self._scales(lo, hi, torch.float32)
        return lo_s, step

    def _scales(self, lo: torch.Tensor, hi: torch.Tensor, sdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's minimum and step, rounded to ``sdtype`` (a step of 0 becomes 1: a constant group)."""
        step = ((hi - lo) / self.levels).to(sdtype)
        return lo.to(sdtype), torch.where(step == 0, torch.ones_like(step), step)

    def _within_half_step(self, lo: torch.Tensor, hi: torch.Tensor, lo_s: torch.Tensor, step: torch.Tensor) -> bool:
        """Whether the rounded ``lo_s``/``step`` still keep every element within half a true step.

        Rounding moves the grid of levels. Inside it an element is off by half a rounded
        step; beyond its ends it is clamped, off by the distance to the end. fp16 fails this when
        a group's range is tiny next to its magnitude (an offset channel) or its step underflows.
        """
        lo_f, step_f = lo_s.float(), step.float()
        worst = torch.maximum(torch.maximum(step_f / 2, lo_f - lo), hi - (lo_f + self.levels * step_f))
        worst = torch.where(hi > lo, worst, (lo_f - lo).abs())
        # NOTE: the arithmetic slack is relative to the group's smallest magnitude (0 when it spans 0),
        # so it never exceeds an element's own; a constant group must come back exactly.
        smallest = torch.where((lo <= 0) & (hi >= 0), torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs()))
        tol = (hi - lo) / self.levels * (0.5 + _SLACK) + smallest * _FP32_EPS
        return bool((worst <= torch.where(hi > lo, tol, torch.zeros_like(tol))).all())

    def decode(
        self, parts: dict[str, torch.Tensor], meta: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        if meta.get("raw"):
            return parts["data"]
        q = parts["q"]
        if self.bits == 4:
            q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
        x = q.float() * parts["step"].float() + parts["lo"].float()
        cols = meta["cols"]
        x = x.reshape(x.shape[0], -1)[:, :cols]
        return x.reshape(meta["moved_shape"]).movedim(-1, meta["axis"]).to(dtype).contiguous()
