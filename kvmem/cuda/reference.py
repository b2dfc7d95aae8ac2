"""Plain-torch references of every device op: what the Triton kernels must reproduce.

They run on any device (CPU in CI) and are the implementation used without CUDA.
Shapes:

- pages ``[N, R, C]`` (contiguous along ``C``), block ids ``int64 [n]``; a gather gives
  ``[R, n * C]``: page ``ids[j]``'s row ``r`` at ``[r, j*C:(j+1)*C]``.
- quantization groups ``x [rows, G, group]`` (fp32), per-group ``lo``/``step``
  ``[rows, G, 1]``; codes ``uint8 [rows, G, group]`` (int8) or ``[rows, G, group // 2]``
  (int4: element ``2j`` in the low nibble, ``2j + 1`` in the high one), the layout of
  :class:`kvmem.codecs.quant.QuantCodec`.
"""

from __future__ import annotations

import torch

__all__ = ["gather_pages", "scatter_pages", "group_minmax", "quantize_groups", "dequantize_into"]


def gather_pages(pages: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Pages ``ids`` of ``pages`` side by side: a new ``[R, n * C]`` tensor."""
    return pages.index_select(0, ids).transpose(0, 1).reshape(pages.shape[1], -1)


def scatter_pages(pages: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` (``[R, n * C]``) into pages ``ids`` (distinct), the inverse of :func:`gather_pages`."""
    _, rows, cols = pages.shape
    pages.index_copy_(0, ids, src.reshape(rows, ids.numel(), cols).transpose(0, 1))


def group_minmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's minimum and maximum, ``[rows, G, 1]`` (NaN where a group holds one)."""
    return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)


def quantize_groups(x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``x``: ``round((x - lo) / step)`` clamped to ``[0, 2**bits - 1]``, int4 packed in pairs."""
    q = torch.round((x - lo.float()) / step.float()).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q.contiguous()


def dequantize_into(
    dst: torch.Tensor,
    start: int,
    q: torch.Tensor,
    step: torch.Tensor,
    lo: torch.Tensor,
    bits: int,
    axis: int,
    cols: int,
) -> None:
    """Decode one KV chunk and write it into ``dst[:, :, start:start + T, :]`` (the model's cache layout).

    Args:
        dst: ``[B, H, S, D]``.
        start: first token position of the chunk in ``dst``.
        q, step, lo: the chunk's codes and scales (see the module docstring).
        bits: 8 or 4.
        axis: ``-2`` (keys: rows are ``(b, h, channel)``, columns tokens) or ``-1`` (values:
            rows are ``(b, h, token)``, columns channels).
        cols: columns before padding to whole groups (``T`` for keys, ``D`` for values).
    """
    if bits == 4:
        q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    x = (q.float() * step.float() + lo.float()).reshape(q.shape[0], -1)[:, :cols]
    b, h, _, d = dst.shape
    if axis == -1:
        dst[:, :, start : start + q.shape[0] // (b * h), :] = x.reshape(b, h, -1, d).to(dst.dtype)
    else:
        dst[:, :, start : start + cols, :] = x.reshape(b, h, d, cols).transpose(-1, -2).to(dst.dtype)
