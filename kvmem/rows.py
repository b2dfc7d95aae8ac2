"""The bytes of a tensor or array as contiguous rows, and copies between such rows: one copy, no staging.

A slice of a KV cache (``kv[:, :, a:b, :]``) is not contiguous, but it is a short list of
contiguous rows (here one per K/V x layer x head, each ``(b - a) * head_dim`` elements).
Its bytes can be written to a file with one ``pwritev``, read from one with one
``preadv``, checksummed row by row and copied into pool pages without ever being
gathered into a contiguous temporary. That is what this module gives the tiers.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

__all__ = [
    "MIN_ROW",
    "TORCH_COPY_FROM",
    "Source",
    "byte_rows",
    "writable_rows",
    "nbytes_of",
    "copy_rows",
    "stream_copy",
    "STREAMING",
    "STREAMABLE",
    "steps",
    "flat_address",
    "memmove",
]

MIN_ROW = 4096
"""Rows shorter than this are gathered into one contiguous copy first (a syscall or a copy per
row would cost more than the copy)."""

TORCH_COPY_FROM = 1 << 20
"""Copies of fewer bytes than this between host buffers go through numpy: torch's ``copy_`` costs
tens of microseconds before its first byte (it may start its threads); from 1 MiB that pays off."""

STREAM_FROM = 1 << 20
"""Copies of this many bytes or more between host buffers use streaming stores (:mod:`kvmem._stream`), which
write the destination without first reading it into the cache; below it the destination is worth caching."""

try:
    from kvmem import _stream
except ImportError:  # NOTE: built without a C compiler: large copies go through numpy and torch instead
    _stream = None  # type: ignore[assignment]

STREAMING = bool(_stream is not None and _stream.STREAMING)
"""Whether large host copies use streaming stores here (the extension is built, on x86-64)."""

STREAMABLE = platform.machine().lower() in ("x86_64", "amd64")
"""Whether this machine has the streaming stores :mod:`kvmem._stream` uses: where it does and :data:`STREAMING` is
``False``, kvmem was installed without its C module (no compiler at install time)."""

Source = torch.Tensor | np.ndarray
"""Bytes to write or copy: a CPU tensor of any dtype and layout, or a numpy array."""


def nbytes_of(src: Source) -> int:
    """Bytes of ``src``."""
    if isinstance(src, np.ndarray):
        return int(src.nbytes)
    return src.numel() * src.element_size()


memmove = ctypes.memmove
"""``memmove(dst_address, src_address, nbytes)``; it releases the GIL while it copies."""


def flat_address(t: torch.Tensor) -> int | None:
    """The address of ``t``'s bytes when they are one run of host memory that a plain copy may read or write
    (a dense, contiguous CPU tensor without a conjugate or negative view bit), else ``None``.

    NOTE: small copies go through this (a ``memmove`` of a 64 KiB tensor costs ~5 us here, the same copy
    through ``view(uint8).numpy()`` and ``np.copyto`` ~15 us: torch's Python calls cost more than the bytes).
    """
    return int(t.data_ptr()) if t.is_cpu and t.is_contiguous() and _bytes_are_values(t) else None


def _bytes_are_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes, copied as they are, are its values: a real or integer dtype, strided, without a
    negative view bit (complex dtypes, which may carry a conjugate bit, are not among them)."""
    return t.dtype in _PLAIN_DTYPES and t.layout is torch.strided and not t.is_neg()


# real and integer dtypes: a complex tensor may carry a conjugate bit, a quantized one is not its bytes
_PLAIN_DTYPES = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16}
    | {torch.int8, torch.uint8, torch.bool}
    | {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)}
)


def _as_bytes_array(src: Source) -> np.ndarray:
    """``src`` as a (possibly strided) uint8 numpy array whose last axis runs over contiguous bytes."""
    if isinstance(src, np.ndarray):
        arr = src
    elif src.ndim and not src.requires_grad and src.is_contiguous():  # the common case, in few calls
        return (src if src.dtype is torch.uint8 else src.view(torch.uint8)).numpy().reshape(-1)
    else:
        t = src.detach() if src.ndim else src.detach().reshape(1)
        if t.dtype is not torch.uint8:
            # a dtype view of the same bytes; needs a unit last stride, else make it contiguous
            t = (t if t.ndim and t.stride(-1) == 1 else t.contiguous()).view(torch.uint8)
        arr = t.numpy()
    if arr.dtype != np.uint8:
        arr = arr if arr.ndim and arr.strides[-1] == arr.itemsize else np.ascontiguousarray(arr).reshape(-1)
        arr = arr.view(np.uint8)
    return arr


def byte_rows(src: Source, min_row: int = MIN_ROW) -> list[np.ndarray]:
    """The bytes of ``src`` in C order, as contiguous 1-D uint8 arrays (views of ``src`` where possible).

    A contiguous ``src`` is one row. Otherwise its dimensions are merged where their
    strides allow and each remaining leading index gives one row; rows shorter than
    ``min_row`` bytes (or a layout without a contiguous innermost run) make the whole
    ``src`` one contiguous copy instead.
    """
    if isinstance(src, np.ndarray) and src.dtype == np.uint8 and src.ndim == 1 and src.strides[0] == 1:
        return [src] if src.size else []  # one run already (a tier's pages): the common case, first
    if nbytes_of(src) == 0:
        return []
    arr = _as_bytes_array(src)
    return _rows_of(arr, min_row) or [np.ascontiguousarray(arr).reshape(-1)]


def writable_rows(dst: torch.Tensor, min_row: int = MIN_ROW) -> list[np.ndarray] | None:
    """:func:`byte_rows` of a CPU tensor as views only (to read into), or ``None`` where that would need a copy."""
    if not dst.is_cpu or (dst.ndim and dst.stride(-1) != 1):
        return None
    if dst.numel() == 0:
        return []
    return _rows_of(_as_bytes_array(dst), min_row)


def _rows_of(arr: np.ndarray, min_row: int) -> list[np.ndarray] | None:
    """Contiguous row views covering ``arr`` in C order, or ``None`` (no unit-stride run of ``min_row`` bytes)."""
    if arr.flags.c_contiguous:
        return [arr.reshape(-1)]
    shape: list[int] = []
    strides: list[int] = []
    for n, s in zip(arr.shape, arr.strides):
        if n == 1:
            continue
        if shape and strides[-1] == n * s:  # the outer dim steps over exactly this one: merge them
            shape[-1] *= n
            strides[-1] = s
        else:
            shape.append(n)
            strides.append(s)
    if strides[-1] != 1 or shape[-1] < min_row:
        return None
    lead = as_strided(arr, shape=(*shape[:-1], shape[-1]), strides=(*strides[:-1], 1))
    return [lead[idx] for idx in np.ndindex(*shape[:-1])]


def steps(rows: Sequence[np.ndarray], step: int) -> Iterator[list[np.ndarray]]:
    """``rows`` cut and grouped into lists of about ``step`` bytes (rows longer than ``step`` are cut)."""
    group: list[np.ndarray] = []
    size = 0
    for row in rows:
        for lo in range(0, row.size, step):
            piece = row[lo : lo + step]
            group.append(piece)
            size += piece.size
            if size >= step:
                yield group
                group, size = [], 0
    if group:
        yield group


def copy_rows(dst: Iterable[np.ndarray], src: Iterable[np.ndarray]) -> int:
    """Copy the byte stream of ``src`` rows into the byte stream of ``dst`` rows; bytes copied.

    Stops when either runs out. Each row pair is one copy of their overlap: with streaming stores, all
    of them in one call without the GIL, when they come to :data:`STREAM_FROM` bytes or more.
    """
    dst, src = list(dst), list(src)
    if STREAMING and sum(s.size for s in src) >= STREAM_FROM and _runs(src) and _runs(dst, writeable=True):
        spans = [(_address(d) + d_at, _address(s) + s_at, n) for d, d_at, s, s_at, n in _overlaps(dst, src)]
        if _disjoint(spans):
            _stream.copy(spans)
            return sum(n for _d, _s, n in spans)
    done = 0
    for d, d_at, s, s_at, n in _overlaps(dst, src):
        np.copyto(d[d_at : d_at + n], s[s_at : s_at + n])
        done += n
    return done


def stream_copy(dst: Source, src: Source) -> bool:
    """Copy ``src``'s bytes into ``dst`` (host memory, the same number of bytes, each a few contiguous rows)
    with streaming stores: ``True``; ``False`` with nothing copied where that cannot be done without a
    staging copy, or the copy is under :data:`STREAM_FROM` bytes, or streaming is not available here.
    """
    if not STREAMING or nbytes_of(src) < STREAM_FROM or nbytes_of(dst) != nbytes_of(src):
        return False
    dst_rows, src_rows = _view_rows(dst), _view_rows(src)
    if dst_rows is None or src_rows is None:
        return False
    copy_rows(dst_rows, src_rows)
    return True


def _view_rows(x: Source) -> list[np.ndarray] | None:
    """:func:`byte_rows` of ``x`` as views only, or ``None`` where its bytes are not plainly its values (see
    :func:`_bytes_are_values`) or not rows of :data:`MIN_ROW` bytes in host memory."""
    if isinstance(x, np.ndarray):
        return [x] if x.dtype == np.uint8 and x.ndim == 1 and x.strides == (1,) else None
    return writable_rows(x) if _bytes_are_values(x) else None


_Overlap = tuple[np.ndarray, int, np.ndarray, int, int]


def _disjoint(spans: list[tuple[int, int, int]]) -> bool:
    """Whether the destination bytes of ``spans`` lie apart from their source bytes (a streaming copy reads
    and writes in blocks: it must not overlap itself, as ``memmove`` may)."""
    if not spans:
        return True
    d_lo, d_hi = min(d for d, _s, _n in spans), max(d + n for d, _s, n in spans)
    s_lo, s_hi = min(s for _d, s, _n in spans), max(s + n for _d, s, n in spans)
    return d_hi <= s_lo or s_hi <= d_lo


def _runs(rows: list[np.ndarray], writeable: bool = False) -> bool:
    """Whether every row is a run of bytes (one address and a length say it all), writeable if asked."""
    return all(
        r.dtype == np.uint8 and r.ndim == 1 and r.strides == (1,) and (r.flags.writeable or not writeable) for r in rows
    )


def _address(row: np.ndarray) -> int:
    return int(row.__array_interface__["data"][0])


def _overlaps(dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> Iterator[_Overlap]:
    """``(dst_row, at, src_row, at, nbytes)`` for each overlap of the two byte streams, in order, until either
    runs out."""
    out = iter(dst)
    d, d_at = None, 0
    for s in src:
        s_at = 0
        while s_at < s.size:
            if d is None or d_at == d.size:
                d = next(out, None)
                d_at = 0
                if d is None:
                    return
                continue
            n = min(s.size - s_at, d.size - d_at)
            yield d, d_at, s, s_at, n
            s_at += n
            d_at += n
