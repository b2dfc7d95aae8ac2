"""Reference error bounds of the lossy codecs, computed from the data alone, and a bit-exact check."""

from __future__ import annotations

import torch

from kvmem.codecs import tensor_codec

__all__ = ["assert_bit_exact", "quant_step", "error_bound", "exact_under"]


def assert_bit_exact(a: torch.Tensor, b: object) -> None:
    """``b`` is a tensor of ``a``'s dtype, shape and device holding the same bytes (NaN payloads included)."""
    assert isinstance(b, torch.Tensor)
    assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
    ab = a.contiguous().reshape(-1).view(torch.uint8)
    bb = b.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(ab, bb)


def quant_step(x: torch.Tensor, bits: int, axis: int, group: int = 64) -> torch.Tensor:
    """Per element, the step of its quantization group, computed from the data alone."""
    moved = x.detach().double().movedim(axis, -1)
    cols = moved.shape[-1]
    g = min(group, cols + cols % 2)
    rows = moved.reshape(-1, cols)
    steps = torch.empty_like(rows)
    for start in range(0, cols, g):
        block = rows[:, start : start + g]
        steps[:, start : start + g] = (block.amax(1, keepdim=True) - block.amin(1, keepdim=True)) / ((1 << bits) - 1)
    return steps.reshape(moved.shape).movedim(-1, axis)


def error_bound(x: torch.Tensor, codec: str, axis: int = -1) -> torch.Tensor:
    """The documented worst-case error of each element of ``x`` under ``codec`` (as float64)."""
    mag = x.detach().double().abs()
    out_eps = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}.get(x.dtype, 0.0)
    if codec == "fp16":
        return mag * 2.0**-11 + 2.0**-25
    if codec == "bf16":
        return mag * 2.0**-8 + 2.0**-133
    quant = tensor_codec(codec)
    half_step = quant_step(x, quant.bits, axis, quant.group) * (0.5 + 2.0**-8)  # type: ignore[attr-defined]
    # float32 arithmetic (and fp64 -> fp32) slack, plus rounding the result to a 16-bit dtype.
    return half_step + mag * 2.0**-22 + (mag + 2 * half_step) * out_eps


def exact_under(x: torch.Tensor, codec: str) -> bool:
    """Whether ``codec`` must reproduce ``x`` bit for bit."""
    if codec == "none" or not x.is_floating_point() or x.numel() == 0 or (x.ndim == 0 and codec.startswith("int")):
        return True
    return codec in ("fp16", "bf16") and x.element_size() <= 2
