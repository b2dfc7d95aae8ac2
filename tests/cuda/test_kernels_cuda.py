"""On a GPU: every Triton kernel bit-for-bit against its torch reference, on the device."""

from __future__ import annotations

import pytest
import torch

from kvmem import cuda
from kvmem.codecs.quant import QuantCodec
from kvmem.cuda import reference
from kvmem.cuda.kvquant import quantize_kv
from kvmem.stores import CpuTier, GpuTier
from kvmem.stores.paged import PagedBuffer
from tests.stores.blobs import blob_of
from tests.stores.test_gpu_tier import key, raw

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def fast():  # type: ignore[no-untyped-def]
    from kvmem.cuda import triton_ops

    assert cuda.ACCELERATED, "CUDA is present: the Triton kernels must have been selected"
    return triton_ops


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_gather_scatter(fast, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    pages = (torch.randn(64, 4, 3000, device="cuda") * 50).to(dtype)
    ids = torch.randperm(64, device="cuda")[:20]
    assert torch.equal(fast.gather_pages(pages, ids), reference.gather_pages(pages, ids))
    src = (torch.randn(4, 20 * 3000, device="cuda") * 50).to(dtype)
    a, b = pages.clone(), pages.clone()
    fast.scatter_pages(a, ids, src)
    reference.scatter_pages(b, ids, src)
    assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_and_fused_dequantize(fast, bits: int, axis: int, dtype: torch.dtype) -> None:  # type: ignore
    t = (torch.randn(1, 8, 250, 128, device="cuda") * 4 + 2).to(dtype)
    codec = QuantCodec(bits, 64)
    parts, meta = codec.encode(t, axis)  # the codec's torch ops on the device: the reference
    got, got_meta = quantize_kv(t, bits, 64, axis)  # Triton min/max and coding
    assert got_meta == meta and all(torch.equal(got[k], parts[k]) for k in parts)
    d1 = torch.zeros(1, 8, 300, 128, dtype=dtype, device="cuda")
    d2 = d1.clone()
    reference.dequantize_into(d1, 20, parts["q"], parts["step"], parts["lo"], bits, axis, meta["cols"])
    fast.dequantize_into(d2, 20, parts["q"], parts["step"], parts["lo"], bits, axis, meta["cols"])
    assert torch.equal(d1, d2)


def test_paged_buffer_and_gpu_tier_on_the_device() -> None:
    buf = PagedBuffer(32, 2, 1024, torch.float16, "cuda")
    src = torch.randn(2, 5 * 1024, device="cuda").half()
    buf.write([3, 9, 0, 31, 7], src)
    assert torch.equal(buf.read([3, 9, 0, 31, 7]), src)
    tier = GpuTier(8 << 20)
    enc = blob_of(bytes(range(256)) * 9000)  # > 2 MB: several 1 MB staged runs
    tier.put(key(0), enc)
    got = tier.get(key(0))
    assert got is not None and got.is_cuda and got.cpu().numpy().tobytes() == raw(enc)


def test_gpu_tier_takes_pinned_cpu_tier_pages_as_they_are() -> None:
    """A blob lent by the CPU tier (pinned pages when CUDA is present) goes to the device without the host
    staging copy; the put has finished with the pages when it returns, so their reuse changes nothing."""
    cpu = CpuTier(64 << 20)
    assert cpu.pool.pinned
    enc = blob_of(bytes(range(256)) * 20_000)  # ~5 MB: several 1 MiB runs
    cpu.put(key(1), enc)
    lent = cpu.blob(key(1))
    assert lent is not None and all(torch.from_numpy(p).is_pinned() for p in lent.parts)
    tier = GpuTier(32 << 20)
    tier.put(key(1), lent)
    del lent
    assert cpu.delete(key(1))
    cpu.put(key(2), blob_of(b"\xff" * 5_000_000))  # takes the pages just freed
    got = tier.get(key(1))
    assert got is not None and got.cpu().numpy().tobytes() == raw(enc)
