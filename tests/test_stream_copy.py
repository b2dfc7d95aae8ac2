"""Streaming copies of large host buffers (kvmem/_stream.c through kvmem/rows.py): the same bytes as a plain
copy for every layout, offset and length, and the plain copy wherever streaming cannot or must not be used."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmem import Memory, rows
from kvmem.rows import STREAM_FROM, copy_rows, stream_copy


def kv(tokens: int = 512, dim: int = 256, seed: int = 0) -> torch.Tensor:
    """[K/V, layers, tokens, dim] bf16: a token slice of it is rows of ``chunk * dim * 2`` bytes."""
    return torch.randn(2, 4, tokens, dim, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_the_extension_is_built_and_streams_on_x86_64_linux() -> None:
    """A package installed without its compiled part would still pass every other test, only slower: here
    that fails (the README's install builds it; CI must not lose it silently)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"streaming stores are x86-64 only (this is {platform.machine()})")
    from kvmem import _stream

    assert _stream.STREAMING == 1 and rows.STREAMING


@pytest.mark.skipif(not rows.STREAMING, reason="kvmem._stream not built or not x86-64")
@pytest.mark.parametrize("shift", [0, 1, 7, 15, 16, 33])
@pytest.mark.parametrize("extra", [0, 1, 63, 64, 4095])
def test_a_streamed_copy_is_the_bytes_at_any_alignment_and_length(shift: int, extra: int) -> None:
    n = STREAM_FROM + extra
    src_buf = np.random.default_rng(shift + extra).integers(0, 256, n + 64, dtype=np.uint8)
    dst_buf = np.zeros(n + 128, np.uint8)
    src, dst = src_buf[shift : shift + n], dst_buf[64 - (shift % 17) : 64 - (shift % 17) + n]
    assert stream_copy(dst, src)
    assert np.array_equal(dst, src)
    # nothing written around it
    start = 64 - (shift % 17)
    assert not dst_buf[:start].any() and not dst_buf[start + n :].any()


@pytest.mark.skipif(not rows.STREAMING, reason="kvmem._stream not built or not x86-64")
def test_kv_slices_stream_both_ways_between_a_tensor_and_pages() -> None:
    cache = kv()
    chunk = cache[:, :, 128:384, :]  # 8 rows of 128 KiB: 1 MiB
    pages = np.zeros(chunk.numel() * 2, np.uint8)
    assert stream_copy(pages, chunk)
    assert pages.tobytes() == chunk.contiguous().view(torch.uint8).numpy().tobytes()
    dst = torch.zeros_like(cache)
    assert stream_copy(dst[:, :, 128:384, :], pages)
    assert torch.equal(dst[:, :, 128:384, :], chunk)
    assert not dst[:, :, :128].any() and not dst[:, :, 384:].any()


@pytest.mark.skipif(not rows.STREAMING, reason="kvmem._stream not built or not x86-64")
def test_what_cannot_stream_is_left_to_the_plain_copy() -> None:
    big = kv()
    half = STREAM_FROM // 2
    assert not stream_copy(np.zeros(half, np.uint8), np.ones(half, np.uint8))  # small: worth caching
    assert not stream_copy(torch.zeros_like(big), torch._neg_view(big))  # its bytes are not its values
    short = torch.zeros(2, 4, 8192, 256, dtype=torch.bfloat16)[..., :32]  # 4 MiB in rows of 64 bytes
    assert not stream_copy(short, torch.ones(2, 4, 8192, 32, dtype=torch.bfloat16))
    assert not stream_copy(np.zeros(STREAM_FROM, np.float32), np.zeros(STREAM_FROM, np.float32))  # not byte runs
    assert not stream_copy(np.zeros(STREAM_FROM, np.uint8), np.zeros(2 * STREAM_FROM, np.uint8))  # sizes differ


@pytest.mark.skipif(not rows.STREAMING, reason="kvmem._stream not built or not x86-64")
def test_overlapping_or_read_only_buffers_go_the_plain_way() -> None:
    buf = np.arange(3 * STREAM_FROM, dtype=np.uint64).view(np.uint8)[: 3 * STREAM_FROM]
    want = buf[: 2 * STREAM_FROM].copy()
    assert copy_rows([buf[STREAM_FROM // 2 : STREAM_FROM // 2 + 2 * STREAM_FROM]], [buf[: 2 * STREAM_FROM]])
    assert np.array_equal(buf[STREAM_FROM // 2 : STREAM_FROM // 2 + 2 * STREAM_FROM], want)  # memmove semantics
    frozen = np.zeros(STREAM_FROM, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        copy_rows([frozen], [np.ones(STREAM_FROM, np.uint8)])


@pytest.mark.parametrize("streaming", [True, False])
def test_store_and_load_many_of_kv_slices_give_the_bytes_with_and_without_streaming(
    streaming: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The public path, both ways: with streaming where it is built, and with the plain copies it falls back to."""
    if streaming and not rows.STREAMING:
        pytest.skip("kvmem._stream not built or not x86-64")
    monkeypatch.setattr(rows, "STREAMING", streaming)
    calls: list[int] = []
    if streaming:
        real = rows._stream

        class Counting:
            STREAMING = real.STREAMING

            @staticmethod
            def copy(pairs: list[tuple[int, int, int]]) -> None:
                calls.append(sum(n for _d, _s, n in pairs))
                real.copy(pairs)

        monkeypatch.setattr(rows, "_stream", Counting)
    cache = kv(tokens=1024)
    chunks = [cache[:, :, i : i + 256, :] for i in range(0, 1024, 256)]  # 1 MiB each, rows of 128 KiB
    for verify in (False, True):  # with cpu_verify, CRCs taken from the streamed pages, re-checked on each load
        mem = Memory(str(tmp_path / str(verify)), cpu_bytes=64 << 20, disk_bytes=0, cpu_verify=verify)
        calls.clear()
        mem.store_many([(f"c{i}", c) for i, c in enumerate(chunks)])
        stored = len(calls)
        dst = torch.zeros_like(cache)
        outs = [dst[:, :, i : i + 256, :] for i in range(0, 1024, 256)]
        assert mem.load_many([f"c{i}" for i in range(4)], out=outs) == outs
        # streamed, where built: each chunk's copy into the pages, and out of them into its slice
        assert (stored, len(calls) - stored) == ((4, 4) if streaming else (0, 0))
        assert all(n == 1 << 20 for n in calls)
        assert torch.equal(dst, cache)
        assert torch.equal(mem.load("c2"), chunks[2])
        mem.close()
    # streamed: the stores and loads of both memories (the 1 MiB chunks), nothing of the plain path's
