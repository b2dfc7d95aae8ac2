"""The pool-backed GPU tier's logic on the CPU device: pages, reuse without allocation, copy-on-write, ranges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvmem
from kvmem.blob import EncodedBlob
from kvmem.errors import CapacityError
from kvmem.stores import CpuTier, GpuTier
from tests.stores.blobs import blob_of


def key(i: int) -> str:
    return kvmem.content_hash(f"entry-{i}")


def raw(enc: EncodedBlob) -> bytes:
    return b"".join(p.tobytes() for p in enc.parts)


def test_blobs_span_pages_written_in_staged_runs_and_read_back() -> None:
    tier = GpuTier(64 << 10, device="cpu", page_bytes=256, transfer_bytes=1024)  # runs of 4 pages
    pages_before = tier._buffer.pages.data_ptr()
    enc = blob_of(bytes(range(256)) * 20)  # ~5 KiB: 21 pages, 6 staged runs
    tier.put(key(0), enc)
    got = tier.get(key(0))
    assert got is not None and got.numpy().tobytes() == raw(enc)
    assert tier.free_pages == tier._buffer.pool.num_blocks - -(-enc.nbytes // 256)
    assert tier.read_range(key(0), 300, 1000).numpy().tobytes() == raw(enc)[300:1000]  # type: ignore[union-attr]
    assert tier.read_range(key(0), enc.nbytes - 5, enc.nbytes + 99).numel() == 5  # type: ignore[union-attr]
    assert tier._buffer.pages.data_ptr() == pages_before, "the pool is never reallocated"


def test_deleted_and_replaced_entries_give_their_pages_back() -> None:
    tier = GpuTier(16 << 10, device="cpu", page_bytes=512)
    total = tier.free_pages
    for round_ in range(5):  # NOTE: far more bytes than the pool over the rounds: pages are reused
        for i in range(4):
            tier.put(key(i), blob_of(bytes([round_]) * 3000))
        assert tier.free_pages == total - 4 * -(-tier.get(key(0)).numel() // 512)  # type: ignore[union-attr]
    for i in range(4):
        assert tier.delete(key(i))
    assert tier.free_pages == total and tier.usage() == 0


def test_a_buffer_handed_out_never_changes_when_its_pages_are_reused() -> None:
    tier = GpuTier(4 << 10, device="cpu", page_bytes=256)
    tier.put(key(0), blob_of(b"a" * 1000))
    held = tier.get(key(0))
    assert held is not None
    snapshot = held.clone()
    tier.delete(key(0))
    tier.put(key(1), blob_of(b"b" * 3000))  # takes the freed pages
    assert torch.equal(held, snapshot)


def test_a_full_pool_refuses_the_value_not_the_tier() -> None:
    tier = GpuTier(2048, device="cpu", page_bytes=256)
    pages = tier._buffer.pool.num_blocks
    for i in range(pages):
        tier.put(key(i), blob_of(b"x"))  # tiny entries: one page each
    with pytest.raises(CapacityError, match="pages of 256 B, 0 are free"):
        tier.put(key(999), blob_of(b"y"))
    assert tier.contains(key(0)) and not tier.contains(key(999))


def test_a_cpu_tier_entry_feeds_the_gpu_tier_without_a_host_copy() -> None:
    cpu, gpu = CpuTier(1 << 20), GpuTier(1 << 20, device="cpu")
    enc = blob_of(b"shared" * 500)
    cpu.put(key(0), enc)
    buf = cpu.get(key(0))
    assert buf is not None
    lent = EncodedBlob.from_buffer(buf)  # what the tiered store hands a promotion
    assert np.shares_memory(lent.parts[0], buf.numpy()), "a view of the CPU tier's buffer, not a copy"
    cpu.delete(key(0))  # the view keeps the bytes alive (torch's refcount)
    gpu.put(key(0), lent)
    assert gpu.get(key(0)).numpy().tobytes() == raw(enc)  # type: ignore[union-attr]


def test_memory_with_a_gpu_tier_on_the_cpu_device_demotes_to_the_cpu_tier(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mem = kvmem.Memory(str(tmp_path / "kvmem"), cpu_bytes="8MiB", disk_bytes=0, fsync="never")
    try:
        mem._tiers.close()
        gpu, cpu = GpuTier(64 << 10, device="cpu"), CpuTier(8 << 20)
        mem._tiers = kvmem.stores.TieredStore([gpu, cpu], mem.metrics, offload_threshold=0.7)
        values = {f"v{i}": torch.full((4096,), float(i)) for i in range(6)}  # 16 KiB each
        for name, value in values.items():
            mem.store(name, value)
        assert gpu.usage() <= 0.7 * gpu.capacity and cpu.usage() > 0
        for name, value in values.items():
            assert torch.equal(mem.load(name), value)
    finally:
        mem.close()
