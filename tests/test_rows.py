"""Byte rows (kvmem/rows.py): a strided tensor's bytes as contiguous views, and copies between row lists."""

from __future__ import annotations

import numpy as np
import torch

from kvmem.rows import MIN_ROW, byte_rows, copy_rows, flat_address, memmove, nbytes_of, steps, writable_rows


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def joined(rows: list[np.ndarray]) -> bytes:
    return b"".join(r.tobytes() for r in rows)


def kv_cache(layers: int = 3, tokens: int = 64, dim: int = 64) -> torch.Tensor:
    """[K/V, layers, tokens, head_dim] float32."""
    return torch.randn(2, layers, tokens, dim, generator=torch.Generator().manual_seed(1))


def test_a_contiguous_tensor_is_one_row_sharing_its_memory() -> None:
    t = kv_cache()
    (row,) = byte_rows(t)
    assert row.dtype == np.uint8 and row.ndim == 1 and row.size == nbytes_of(t) == t.numel() * 4
    assert row.ctypes.data == t.data_ptr()
    assert row.tobytes() == as_bytes(t)
    (arr_row,) = byte_rows(t.numpy())
    assert arr_row.ctypes.data == t.data_ptr()
    assert byte_rows(torch.empty(0, 3)) == []
    (scalar,) = byte_rows(torch.tensor(1.5))
    assert scalar.tobytes() == np.float32(1.5).tobytes()


def test_a_token_slice_is_one_row_per_kv_and_layer_each_a_view_in_c_order() -> None:
    kv = kv_cache(layers=3)
    a, b = 16, 32  # 16 tokens * 64 * 4 B = 4096 B per row: MIN_ROW exactly
    sl = kv[:, :, a:b, :]
    assert (b - a) * 64 * 4 == MIN_ROW
    rows = byte_rows(sl)
    assert len(rows) == 2 * 3
    for (kv_i, layer), row in zip([(i, j) for i in range(2) for j in range(3)], rows):
        assert row.ctypes.data == kv[kv_i, layer, a].data_ptr(), "a row is not a view of its (K/V, layer) run"
        assert row.size == MIN_ROW and row.flags.c_contiguous
    assert joined(rows) == as_bytes(sl)


def test_dimensions_merge_where_their_strides_allow() -> None:
    kv = torch.randn(2, 3, 4, 64, 32)  # [K/V, layers, heads, tokens, head_dim]
    sl = kv[:, :, :, 8:40]  # heads do not merge with tokens: one row per (K/V, layer, head)
    rows = byte_rows(sl)
    assert len(rows) == 2 * 3 * 4 and all(r.size == 32 * 32 * 4 for r in rows)
    assert joined(rows) == as_bytes(sl)
    heads = kv[:, 1]  # [K/V, heads, tokens, dim]: (heads, tokens, dim) is contiguous within each K/V
    rows = byte_rows(heads)
    assert len(rows) == 2 and rows[0].ctypes.data == kv[0, 1].data_ptr()
    assert joined(rows) == as_bytes(heads)


def test_short_rows_make_one_contiguous_copy() -> None:
    kv = kv_cache()
    sl = kv[:, :, 16:20, :]  # rows of 4 * 64 * 4 = 1 KiB
    (row,) = byte_rows(sl)
    assert row.size == nbytes_of(sl)
    base = kv.data_ptr()
    assert not base <= row.ctypes.data < base + nbytes_of(kv), "short rows were not gathered into a copy"
    assert row.tobytes() == as_bytes(sl)
    assert len(byte_rows(sl, min_row=1024)) == 6  # allowed shorter rows: views again
    transposed = kv[0, 0].t()  # no contiguous innermost run at all
    (row,) = byte_rows(transposed, min_row=0)
    assert row.tobytes() == as_bytes(transposed)


def test_dtype_views_keep_the_bytes() -> None:
    t = torch.randn(4, 2048).to(torch.bfloat16)[:, 0:2048]
    (row,) = byte_rows(t)
    assert row.tobytes() == as_bytes(t)
    half = torch.randn(8, 4096).to(torch.float16)[:, 1024:3072]  # rows of 4096 B at a 2 KiB offset
    rows = byte_rows(half)
    assert len(rows) == 8 and rows[0].ctypes.data == half.data_ptr()
    assert joined(rows) == as_bytes(half)


def test_writable_rows_are_views_of_the_destination() -> None:
    kv = torch.zeros(2, 3, 64, 64)
    dst = kv[:, :, 16:32, :]
    rows = writable_rows(dst)
    assert rows is not None and len(rows) == 6
    source = torch.arange(dst.numel(), dtype=torch.float32).reshape(dst.shape)
    copy_rows(rows, byte_rows(source.contiguous()))
    assert torch.equal(dst, source)
    assert float(kv[:, :, :16].abs().sum()) == 0 and float(kv[:, :, 32:].abs().sum()) == 0
    assert writable_rows(dst[:, :, :2]) is None  # rows of 512 B: a copy would be needed
    rows = writable_rows(dst[:, :, :2], min_row=0)
    assert rows is not None and len(rows) == 6


def test_writable_rows_refuse_what_needs_a_copy() -> None:
    t = torch.zeros(64, 128)
    assert writable_rows(t.t()) is None  # transposed: the last stride is not 1
    assert writable_rows(t[:, ::2]) is None
    assert writable_rows(torch.zeros(0, 4)) == []
    (row,) = writable_rows(t)  # type: ignore[misc]
    row[:4] = 0xFF
    assert torch.isnan(t[0, 0])


def test_copy_rows_between_different_cuts_copies_the_byte_stream() -> None:
    rng = np.random.default_rng(2)
    src_bytes = rng.integers(0, 256, 125, dtype=np.uint8)
    src = [src_bytes[0:5], src_bytes[5:105], src_bytes[105:108], src_bytes[108:125]]
    dst_buf = np.zeros(125, dtype=np.uint8)
    dst = [dst_buf[0:50], dst_buf[50:100], dst_buf[100:125]]
    assert copy_rows(dst, src) == 125
    assert dst_buf.tobytes() == src_bytes.tobytes()
    short = np.zeros(60, dtype=np.uint8)
    assert copy_rows([short[:7], short[7:]], src) == 60  # stops when the destination runs out
    assert short.tobytes() == src_bytes[:60].tobytes()
    long = np.full(200, 9, dtype=np.uint8)
    assert copy_rows([long], src) == 125  # stops when the source runs out
    assert long[:125].tobytes() == src_bytes.tobytes() and (long[125:] == 9).all()
    assert copy_rows([long], []) == 0


def test_steps_cut_long_rows_and_group_short_ones() -> None:
    data = np.arange(40, dtype=np.uint8)
    rows = [data[0:10], data[10:35], data[35:40]]
    groups = list(steps(rows, 16))
    assert [[p.size for p in g] for g in groups] == [[10, 16], [9, 5]]
    assert b"".join(p.tobytes() for g in groups for p in g) == data.tobytes()
    assert all(p.base is not None for g in groups for p in g)  # pieces are views, not copies
    assert [[p.size for p in g] for g in steps([data], 16)] == [[16], [16], [8]]
    assert list(steps([], 16)) == []


def test_flat_address_is_the_data_of_a_dense_contiguous_tensor_only() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    assert flat_address(t) == t.data_ptr()
    assert flat_address(t[:, 1:]) is None, "a strided slice is not one run"
    assert flat_address(t.transpose(0, 1)) is None
    c = torch.complex(t, t)
    assert flat_address(c) is None and flat_address(c.conj()) is None, "complex: a conjugate bit is not bytes"
    assert flat_address(torch._neg_view(t)) is None, "a negative view is not its bytes"
    assert flat_address(t.to_sparse()) is None
    assert flat_address(torch.empty(0)) is not None


def test_memmove_copies_between_tensors_by_address() -> None:
    src = torch.arange(1000, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    memmove(flat_address(dst), flat_address(src), src.numel() * src.element_size())
    assert torch.equal(dst, src)
