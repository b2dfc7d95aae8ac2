"""Triton implementations of the ops in :mod:`kvmem.cuda.reference`, same signatures, same bits.

Imported only when CUDA is present (``import triton`` needs a driver). Bit-exactness
with the torch references rests on three choices, each a NOTE below: IEEE division
(``div_rn``), round-half-to-even (as ``torch.round``), and no fused
multiply-add on decode (``enable_fp_fusion=False``: torch multiplies, then adds).
Integer offsets are computed in int64 so pools over 2 GiB index correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_pages", "scatter_pages", "group_minmax", "quantize_groups", "dequantize_into"]

_BLOCK = 1024  # elements per program along a page row
_GROUPS = 16  # quantization groups per program


@triton.jit
def _copy_pages_kernel(
    pages_ptr, ids_ptr, flat_ptr, n, rows, cols, s_page, s_row, TO_PAGES: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    j = pid // rows
    r = pid % rows
    col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = col < cols
    page = tl.load(ids_ptr + j).to(tl.int64)
    paged = pages_ptr + page * s_page + r * s_row + col
    flat = flat_ptr + r * (n * cols) + j * cols + col
    if TO_PAGES:
        tl.store(paged, tl.load(flat, mask=mask), mask=mask)
    else:
        tl.store(flat, tl.load(paged, mask=mask), mask=mask)


def _launch_copy(pages: torch.Tensor, ids: torch.Tensor, flat: torch.Tensor, to_pages: bool) -> None:
    _, rows, cols = pages.shape
    n = ids.numel()
    if n == 0:
        return
    assert pages.stride(2) == 1 and flat.is_contiguous(), "pages must be contiguous along a row"
    grid = (n * rows, triton.cdiv(cols, _BLOCK))
    _copy_pages_kernel[grid](
        pages, ids, flat, n, rows, cols, pages.stride(0), pages.stride(1), TO_PAGES=to_pages, BLOCK=_BLOCK
    )


def gather_pages(pages: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty((pages.shape[1], ids.numel() * pages.shape[2]), dtype=pages.dtype, device=pages.device)
    _launch_copy(pages, ids, out, to_pages=False)
    return out


def scatter_pages(pages: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    _launch_copy(pages, ids, src.contiguous(), to_pages=True)


@triton.jit
def _minmax_kernel(x_ptr, lo_ptr, hi_ptr, n_groups, GROUP: tl.constexpr, P2: tl.constexpr, GROUPS: tl.constexpr):
    gi = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    e = tl.arange(0, P2)
    mask = (gi[:, None] < n_groups) & (e[None, :] < GROUP)
    v = tl.load(x_ptr + gi[:, None] * GROUP + e[None, :], mask=mask, other=0.0)
    lo = tl.min(tl.where(mask, v, float("inf")), axis=1)
    hi = tl.max(tl.where(mask, v, float("-inf")), axis=1)
    # NOTE: torch.amin/amax propagate NaN; tl.min/max need not, so carry it explicitly.
    nan = tl.max(tl.where(mask & (v != v), 1, 0), axis=1) > 0
    lo = tl.where(nan, float("nan"), lo)
    hi = tl.where(nan, float("nan"), hi)
    tl.store(lo_ptr + gi, lo, mask=gi < n_groups)
    tl.store(hi_ptr + gi, hi, mask=gi < n_groups)


def group_minmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, groups, group = x.shape
    x = x.contiguous()
    lo = torch.empty((rows, groups, 1), dtype=x.dtype, device=x.device)
    hi = torch.empty_like(lo)
    n = rows * groups
    _minmax_kernel[(triton.cdiv(n, _GROUPS),)](
        x, lo, hi, n, GROUP=group, P2=triton.next_power_of_2(group), GROUPS=_GROUPS
    )
    return lo, hi


@triton.jit
def _code(v, lo, step, LEVELS: tl.constexpr):
    # NOTE: div_rn is IEEE division (plain `/` is approximate). Adding and subtracting 1.5 * 2**23 rounds
    # an fp32 value of magnitude < 2**22 to an integer, half to even, as torch.round does (larger values
    # are clamped to 0 or LEVELS either way); no libdevice call, so Triton's interpreter runs it too.
    q = (tl.math.div_rn(v - lo, step) + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.uint8)


@triton.jit
def _quantize_kernel(
    x_ptr,
    lo_ptr,
    step_ptr,
    q_ptr,
    n_groups,
    GROUP: tl.constexpr,
    P2: tl.constexpr,
    LEVELS: tl.constexpr,
    PACK4: tl.constexpr,
    GROUPS: tl.constexpr,
):
    gi = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    gmask = gi < n_groups
    lo = tl.load(lo_ptr + gi, mask=gmask, other=0.0).to(tl.float32)[:, None]
    step = tl.load(step_ptr + gi, mask=gmask, other=1.0).to(tl.float32)[:, None]
    e = tl.arange(0, P2)[None, :]
    base = x_ptr + gi[:, None] * GROUP
    if PACK4:
        mask = gmask[:, None] & (e < GROUP // 2)
        a = _code(tl.load(base + 2 * e, mask=mask, other=0.0), lo, step, LEVELS)
        b = _code(tl.load(base + 2 * e + 1, mask=mask, other=0.0), lo, step, LEVELS)
        tl.store(q_ptr + gi[:, None] * (GROUP // 2) + e, a | (b << 4), mask=mask)
    else:
        mask = gmask[:, None] & (e < GROUP)
        q = _code(tl.load(base + e, mask=mask, other=0.0), lo, step, LEVELS)
        tl.store(q_ptr + gi[:, None] * GROUP + e, q, mask=mask)


def quantize_groups(x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    rows, groups, group = x.shape
    width = group // 2 if bits == 4 else group
    q = torch.empty((rows, groups, width), dtype=torch.uint8, device=x.device)
    n = rows * groups
    _quantize_kernel[(triton.cdiv(n, _GROUPS),)](
        x.contiguous(),
        lo.contiguous(),
        step.contiguous(),
        q,
        n,
        GROUP=group,
        P2=triton.next_power_of_2(width),
        LEVELS=(1 << bits) - 1,
        PACK4=bits == 4,
        GROUPS=_GROUPS,
    )
    return q


@triton.jit
def _dequantize_into_kernel(
    q_ptr,
    step_ptr,
    lo_ptr,
    dst_ptr,
    cols,
    heads,
    per_bh,
    start,
    s_b,
    s_h,
    s_t,
    s_d,
    GROUP: tl.constexpr,
    NGROUPS: tl.constexpr,
    PACK4: tl.constexpr,
    KEYS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = c < cols
    g = row * NGROUPS + c // GROUP
    step = tl.load(step_ptr + g, mask=mask, other=1.0).to(tl.float32)
    lo = tl.load(lo_ptr + g, mask=mask, other=0.0).to(tl.float32)
    if PACK4:
        byte = tl.load(q_ptr + row * (NGROUPS * GROUP // 2) + c // 2, mask=mask, other=0)
        code = tl.where(c % 2 == 0, byte & 0x0F, byte >> 4)
    else:
        code = tl.load(q_ptr + row * (NGROUPS * GROUP) + c, mask=mask, other=0)
    x = code.to(tl.float32) * step + lo  # NOTE: launched with enable_fp_fusion=False: no FMA, as torch
    bh = row // per_bh
    r = row % per_bh
    if KEYS:  # rows (b, h, channel), columns tokens
        off = (bh // heads) * s_b + (bh % heads) * s_h + (start + c) * s_t + r * s_d
    else:  # rows (b, h, token), columns channels
        off = (bh // heads) * s_b + (bh % heads) * s_h + (start + r) * s_t + c * s_d
    tl.store(dst_ptr + off, x.to(dst_ptr.dtype.element_ty), mask=mask)


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
    rows, groups, width = q.shape
    group = width * 2 if bits == 4 else width
    _, heads, _, d = dst.shape
    per_bh = d if axis == -2 else rows // (dst.shape[0] * heads)
    grid = (rows, triton.cdiv(cols, _BLOCK))
    _dequantize_into_kernel[grid](
        q.contiguous(),
        step.contiguous(),
        lo.contiguous(),
        dst,
        cols,
        heads,
        per_bh,
        start,
        *dst.stride(),
        GROUP=group,
        NGROUPS=groups,
        PACK4=bits == 4,
        KEYS=axis == -2,
        BLOCK=_BLOCK,
        enable_fp_fusion=False,
    )
