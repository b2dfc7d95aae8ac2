"""int8 / int4 KV quantization on the tensors' own device, in the codec's exact format.

:func:`quantize_kv` returns the parts and metadata :meth:`QuantCodec.encode
<kvmem.codecs.quant.QuantCodec.encode>` returns for the same tensor (byte for byte),
so a chunk quantized on the GPU is stored and decoded like any other; the group
reductions and the coding run as device ops (:mod:`kvmem.cuda`), and only the
choice of fp16 or fp32 scales (one boolean) comes back to the host.
:func:`dequantize_kv_into` decodes a chunk straight into the model's cache layout.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmem import cuda
from kvmem.codecs.quant import QuantCodec
from kvmem.errors import CodecError

__all__ = ["quantize_kv", "dequantize_kv", "dequantize_kv_into"]

Parts = dict[str, torch.Tensor]


def _check(t: torch.Tensor, axis: int, what: str) -> None:
    if t.ndim != 4 or axis not in (-1, -2) or t.numel() == 0:
        raise CodecError(f"{what} of shape {tuple(t.shape)} along axis {axis}: accepted a non-empty KV tensor "
                         "[batch, heads, tokens, head_dim] along axis -2 (keys) or -1 (values)")


def quantize_kv(t: torch.Tensor, bits: int, group: int, axis: int) -> tuple[Parts, dict[str, Any]]:
    """``QuantCodec(bits, group).encode(t, axis)``, computed on ``t``'s device.

    Args:
        t: ``[B, H, T, D]`` floating point.
        bits: 8 or 4.
        group: elements per scale (even).
        axis: ``-2`` for keys (groups along tokens), ``-1`` for values (along channels).

    Returns:
        ``({"q", "step", "lo"}, meta)`` exactly as the codec's.

    Raises:
        CodecError: a bad shape, axis, ``bits``/``group``, or a non-finite value.
    """
    codec = QuantCodec(bits, group)
    _check(t, axis, "quantize_kv input")
    moved = t.movedim(axis, -1)
    moved_shape = list(moved.shape)
    cols = moved_shape[-1]
    group = min(codec.group, cols + cols % 2)
    padded = -(-cols // group) * group
    x = moved.reshape(-1, cols).float()
    if padded != cols:
        x = torch.cat([x, x[:, -1:].expand(-1, padded - cols)], dim=1)
    x = x.reshape(x.shape[0], padded // group, group).contiguous()
    lo, hi = cuda.group_minmax(x)
    if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
        raise CodecError(f"codec {codec.name}: tensor holds inf or nan; use none, fp16 or bf16 for it")
    # NOTE: the codec's own scale rules (fp16, or fp32 where fp16 breaks the half-step bound).
    lo_s, step = codec._scales(lo, hi, torch.float16)
    if not codec._within_half_step(lo, hi, lo_s, step):
        lo_s, step = codec._scales(lo, hi, torch.float32)
    q = cuda.quantize_groups(x, lo_s, step, bits)
    meta = {"axis": axis, "group": group, "cols": cols, "moved_shape": moved_shape}
    return {"q": q, "step": step.contiguous(), "lo": lo_s.contiguous()}, meta


def dequantize_kv_into(dst: torch.Tensor, start: int, parts: Parts, meta: dict[str, Any]) -> None:
    """Decode a chunk quantized by :func:`quantize_kv` (or the codec) into ``dst[:, :, start:start + T, :]``.

    Dequantize and scatter are one kernel on CUDA: the fp32 chunk never exists in memory.

    Args:
        dst: the model's cache tensor ``[B, H, S, D]`` (any float dtype; values are rounded to it).
        start: first token position of the chunk.
        parts, meta: as :func:`quantize_kv` returns them.

    Raises:
        CodecError: the chunk does not fit ``dst`` at ``start``.
    """
    b, h, t, d = _chunk_shape(meta)
    if dst.ndim != 4 or tuple(dst.shape[:2]) != (b, h) or dst.shape[3] != d or not 0 <= start <= dst.shape[2] - t:
        raise CodecError(f"a [{b}, {h}, {t}, {d}] chunk at token {start} does not fit a destination of shape "
                         f"{tuple(dst.shape)}: accepted [{b}, {h}, >= {start + t}, {d}]")
    bits = 4 if parts["q"].shape[-1] * 2 == meta["group"] else 8
    cuda.dequantize_into(dst, start, parts["q"], parts["step"], parts["lo"], bits, meta["axis"], meta["cols"])


def dequantize_kv(parts: Parts, meta: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The chunk quantized by :func:`quantize_kv`, as a new ``[B, H, T, D]`` tensor of ``dtype``."""
    out = torch.empty(_chunk_shape(meta), dtype=dtype, device=parts["q"].device)
    dequantize_kv_into(out, 0, parts, meta)
    return out


def _chunk_shape(meta: dict[str, Any]) -> tuple[int, int, int, int]:
    """``[B, H, T, D]`` of a chunk from its codec metadata (keys were coded with tokens last)."""
    b, h, x, y = meta["moved_shape"]
    return (b, h, y, x) if meta["axis"] == -2 else (b, h, x, y)
