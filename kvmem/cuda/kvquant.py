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
        raise CodecError(
            f"{what} of shape {tuple(t.shape)} along axis {axis}: accepted a non-empty KV tensor "
            "[batch, heads, tokens, head_dim] along axis -2 (keys) or -1 (values)"
        )


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
    x, meta = codec.groups(t, axis)
    x = x.contiguous()
    lo, hi = cuda.group_minmax(x)
    lo_s, step = codec.scales(lo, hi)  # the codec's own scale rules, on the device
    q = cuda.quantize_groups(x, lo_s, step, bits)
    return {"q": q, "step": step.contiguous(), "lo": lo_s.contiguous()}, meta


def dequantize_kv_into(
    dst: torch.Tensor, start: int, parts: Parts, meta: dict[str, Any], *, skip: int = 0, count: int | None = None
) -> None:
    """Decode tokens ``[skip, skip + count)`` of a quantized chunk into ``dst[:, :, start:start + count]``.

    The chunk is one quantized by :func:`quantize_kv` or the codec. Dequantize and scatter
    are one kernel on CUDA: the fp32 chunk never exists in memory (except for a key chunk
    cut at the front, see below). The values are those of :meth:`QuantCodec.decode
    <kvmem.codecs.quant.QuantCodec.decode>`, bit for bit.

    Args:
        dst: the model's cache tensor ``[B, H, S, D]`` (any float dtype; values are rounded to it).
        start: position in ``dst`` of the first token written.
        parts, meta: as :func:`quantize_kv` returns them (or a blob's leaf holds them).
        skip: chunk tokens to leave out at the front.
        count: chunk tokens to write (default: all after ``skip``).

    Raises:
        CodecError: the parts do not match ``meta``, or the tokens do not fit ``dst`` at ``start``.
    """
    b, h, t, d = _chunk_shape(meta)
    bits = _check_parts(parts, meta)
    count = t - skip if count is None else count
    if not 0 <= skip < skip + count <= t:
        raise CodecError(
            f"tokens [{skip}, {skip + count}) of a {t}-token chunk: accepted 0 <= skip < skip + count <= {t}"
        )
    if dst.ndim != 4 or tuple(dst.shape[:2]) != (b, h) or dst.shape[3] != d or not 0 <= start <= dst.shape[2] - count:
        raise CodecError(
            f"a [{b}, {h}, {count}, {d}] chunk at token {start} does not fit a destination of shape "
            f"{tuple(dst.shape)}: accepted [{b}, {h}, >= {start + count}, {d}]"
        )
    q, step, lo = parts["q"], parts["step"], parts["lo"]
    if meta["axis"] == -1:  # rows are (b, h, token): the tokens wanted are whole rows
        if (skip, count) != (0, t):
            q, step, lo = (
                p.view(b, h, t, *p.shape[1:])[:, :, skip : skip + count].reshape(-1, *p.shape[1:])
                for p in (q, step, lo)
            )
        cuda.dequantize_into(dst, start, q, step, lo, bits, -1, d)
    elif skip == 0:  # columns are tokens: those past ``count`` are cut like the padding
        cuda.dequantize_into(dst, start, q, step, lo, bits, -2, count)
    else:
        # a key chunk's groups run along tokens, so a front cut (a sliding window starting inside
        # the chunk, once per layer) decodes the whole chunk first.
        whole = torch.empty((b, h, t, d), dtype=dst.dtype, device=dst.device)
        cuda.dequantize_into(whole, 0, q, step, lo, bits, -2, t)
        dst[:, :, start : start + count] = whole[:, :, skip : skip + count]


def _check_parts(parts: Parts, meta: dict[str, Any]) -> int:
    """The bits of a quantized chunk whose ``parts`` have the shapes ``meta`` implies (the kernels index by them).

    Raises:
        CodecError: a part is missing or of the wrong dtype or shape.
    """
    b, h, t, d = _chunk_shape(meta)
    group, cols = meta.get("group"), meta.get("cols")
    if not isinstance(group, int) or group <= 0 or group % 2:
        raise CodecError(f"quantization metadata {meta}: accepted a positive even group")
    coded, other = (t, d) if meta["axis"] == -2 else (d, t)  # rows are (b, h, other), columns coded
    rows, groups = b * h * other, -(-coded // group)
    q, step, lo = (parts.get(name) for name in ("q", "step", "lo"))
    ok = (
        cols == coded
        and q is not None
        and step is not None
        and lo is not None
        and q.dtype == torch.uint8
        and tuple(q.shape) in ((rows, groups, group), (rows, groups, group // 2))
        and step.is_floating_point()
        and lo.is_floating_point()
        and tuple(step.shape) == tuple(lo.shape) == (rows, groups, 1)
    )
    if not ok:
        shapes = {name: tuple(p.shape) for name, p in parts.items()}
        raise CodecError(
            f"quantized chunk parts {shapes} do not match {meta}: accepted q uint8 "
            f"[{rows}, {groups}, {group} or {group // 2}], step and lo [{rows}, {groups}, 1]"
        )
    return 8 if parts["q"].shape[-1] == group else 4


def dequantize_kv(parts: Parts, meta: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The chunk quantized by :func:`quantize_kv`, as a new ``[B, H, T, D]`` tensor of ``dtype``."""
    out = torch.empty(_chunk_shape(meta), dtype=dtype, device=parts["q"].device)
    dequantize_kv_into(out, 0, parts, meta)
    return out


def _chunk_shape(meta: dict[str, Any]) -> tuple[int, int, int, int]:
    """``[B, H, T, D]`` of a chunk from its codec metadata (keys were coded with tokens last).

    Raises:
        CodecError: ``meta`` does not describe a KV chunk coded along axis -2 or -1.
    """
    shape, axis = meta.get("moved_shape"), meta.get("axis")
    if (
        not isinstance(shape, list)
        or len(shape) != 4
        or axis not in (-1, -2)
        or not all(isinstance(n, int) and n > 0 for n in shape)
    ):
        raise CodecError(f"quantization metadata {meta}: accepted a [B, H, T, D] chunk coded along axis -2 or -1")
    b, h, x, y = shape
    return (b, h, y, x) if axis == -2 else (b, h, x, y)
