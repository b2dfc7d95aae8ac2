"""Device ops: the torch references on CPU (CI), the Triton kernels against them (CUDA, or Triton's interpreter)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmem.codecs.quant import QuantCodec
from kvmem.cuda import reference
from kvmem.cuda.kvquant import dequantize_kv, dequantize_kv_into, quantize_kv
from kvmem.cuda.transfer import plan_runs
from kvmem.errors import CodecError, ConfigError
from tests.servers import missing

CASES = [(bits, axis, tokens) for bits in (8, 4) for axis in (-2, -1) for tokens in (16, 13, 70)]


def kv(tokens: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, tokens, 16, generator=g) * 3 + 1).to(dtype).to(device)


@pytest.mark.parametrize("bits, axis, tokens", CASES)
def test_quantize_kv_is_the_codec_byte_for_byte(bits: int, axis: int, tokens: int) -> None:
    t = kv(tokens)
    codec = QuantCodec(bits, 64)
    parts, meta = codec.encode(t, axis)
    got, got_meta = quantize_kv(t, bits, 64, axis)
    assert got_meta == meta
    for name in parts:
        assert got[name].dtype == parts[name].dtype and torch.equal(got[name], parts[name])
    assert torch.equal(dequantize_kv(got, got_meta, torch.float32), codec.decode(parts, meta, torch.float32, t.shape))


@pytest.mark.parametrize("bits, axis, tokens", CASES)
def test_fused_dequantize_scatter_writes_only_its_tokens(bits: int, axis: int, tokens: int) -> None:
    t = kv(tokens, dtype=torch.bfloat16)
    parts, meta = quantize_kv(t, bits, 64, axis)
    dst = torch.full((1, 2, tokens + 10, 16), 7.0, dtype=torch.bfloat16)
    dequantize_kv_into(dst, 3, parts, meta)
    assert torch.equal(dst[:, :, 3 : 3 + tokens], QuantCodec(bits, 64).decode(parts, meta, torch.bfloat16, t.shape))
    assert (dst[:, :, :3] == 7).all() and (dst[:, :, 3 + tokens :] == 7).all()
    with pytest.raises(CodecError, match="does not fit"):
        dequantize_kv_into(dst, 11, parts, meta)


def test_quantize_kv_refuses_bad_input_naming_it() -> None:
    with pytest.raises(CodecError, match=r"shape \(4, 16\) along axis -1"):
        quantize_kv(torch.ones(4, 16), 8, 64, -1)
    bad = kv(8)
    bad[0, 0, 1, 1] = float("nan")
    with pytest.raises(CodecError, match="inf or nan"):
        quantize_kv(bad, 8, 64, -1)


def test_reference_gather_scatter_round_trip() -> None:
    pages = torch.randn(9, 3, 20)
    ids = torch.tensor([6, 0, 3])
    flat = reference.gather_pages(pages, ids)
    assert flat.shape == (3, 60) and torch.equal(flat[:, 20:40], pages[0])
    again = torch.zeros_like(pages)
    reference.scatter_pages(again, ids, flat)
    assert torch.equal(again[ids], pages[ids]) and not again[[1, 2, 4, 5, 7, 8]].any()


def test_plan_runs_coalesces_small_pages_into_megabyte_copies() -> None:
    runs = plan_runs(40, 64 * 1024, 1 << 20)
    assert [len(r) for r in runs] == [16, 16, 8]  # the seed's 16 x 64 KB -> 1 MB
    assert [i for r in runs for i in r] == list(range(40))
    assert plan_runs(3, 4 << 20) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ConfigError, match="page_bytes=0"):
        plan_runs(3, 0)


_INTERPRETED = """
import torch
from kvmem.cuda import reference as R, triton_ops as T
from kvmem.codecs.quant import QuantCodec
pages = torch.randn(6, 3, 50); ids = torch.tensor([4, 0, 2])
assert torch.equal(T.gather_pages(pages, ids), R.gather_pages(pages, ids))
a, b, src = pages.clone(), pages.clone(), torch.randn(3, 150)
T.scatter_pages(a, ids, src); R.scatter_pages(b, ids, src); assert torch.equal(a, b)
for bits in (8, 4):
    for axis in (-2, -1):
        t = torch.randn(1, 2, 70, 16) * 3 + 1
        c = QuantCodec(bits, 64)
        p, m = c.encode(t, axis)
        x = t.movedim(axis, -1).reshape(-1, m["cols"]).float()
        x = torch.cat([x, x[:, -1:].expand(-1, -m["cols"] % m["group"])], 1).reshape(x.shape[0], -1, m["group"])
        lo, hi = R.group_minmax(x)
        assert all(torch.equal(u, v) for u, v in zip((lo, hi), T.group_minmax(x.contiguous())))
        assert torch.equal(T.quantize_groups(x, p["lo"], p["step"], bits), p["q"])
        for dtype in (torch.float32, torch.float16):  # NOTE: the interpreter truncates to bf16; GPUs round
            d1 = torch.zeros(1, 2, 79, 16, dtype=dtype); d2 = d1.clone()
            R.dequantize_into(d1, 4, p["q"], p["step"], p["lo"], bits, axis, m["cols"])
            T.dequantize_into(d2, 4, p["q"], p["step"], p["lo"], bits, axis, m["cols"])
            assert torch.equal(d1, d2), (bits, axis, dtype)
print("same bits")
"""


def test_triton_kernels_match_references_in_the_triton_interpreter() -> None:
    """The Triton source, run by Triton's CPU interpreter (a fresh process: the mode is read at import)."""
    if importlib.util.find_spec("triton") is None:
        missing("triton is not installed (torch's Linux wheels bring it)")  # NOTE: fails under CI, never skips
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "same bits" in done.stdout, done.stderr[-3000:]
