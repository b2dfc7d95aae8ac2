"""``Memory.load(key, out=)``, ``load_many`` and ``store_many``: values written into the caller's tensors.

Every stack (cpu alone, disk alone, cpu + disk) and the two load paths: a value stored as
it is (codec ``none``, ``bf16`` of a bf16 tensor) is copied straight into ``out``; a value a
codec changed (``fp16`` of fp32, ``int8``) is decoded first. ``out`` is always a slice of a
bigger tensor filled with a sentinel, so a write outside it shows.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import kvmem
from kvmem.errors import IntegrityError, KVMemError, OutputMismatch
from kvmem.stores import CpuTier, DiskTier, files
from tests.bounds import assert_bit_exact, error_bound
from tests.conftest import MemoryFactory
from tests.stores.redis_helpers import unique_prefix, with_options

STACKS = ["cpu", "disk", "cpu+disk"]
SENTINEL = -7.0  # exact in bf16, fp16 and fp32
MISSING = object()

# codec -> dtype of the stored tensor (and of ``out``); whether the load copies the stored bytes as they are
CODECS = {
    "none": (torch.bfloat16, True),
    "bf16": (torch.bfloat16, True),
    "fp16": (torch.float32, False),
    "int8": (torch.bfloat16, False),
}
# (first, last) token of the slice: rows of 32 * 64 * 2 = 4096 bytes are read straight into ``out``;
# rows of 8 * 64 * 2 = 1024 bytes are too short for that (read whole, then copied)
SLICES = {"long-rows": (32, 64), "short-rows": (40, 48)}


def value_of(dtype: torch.dtype, tokens: int, seed: int = 0) -> torch.Tensor:
    """A chunk-shaped [2, 4, tokens, 64] tensor."""
    return torch.randn(2, 4, tokens, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)


def cache_of(dtype: torch.dtype) -> torch.Tensor:
    """The bigger tensor ``out`` is a slice of: [2, 4, 96, 64] full of the sentinel."""
    return torch.full((2, 4, 96, 64), SENTINEL, dtype=dtype)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_outside_untouched(cache: torch.Tensor, a: int, b: int) -> None:
    outside = torch.cat([cache[:, :, :a], cache[:, :, b:]], dim=2)
    assert as_bytes(outside) == as_bytes(torch.full_like(outside, SENTINEL)), "bytes outside out= were written"


def disk_of(mem: kvmem.Memory) -> DiskTier:
    tier = next(t for t in mem._tiers.tiers if t.name == "disk")
    assert isinstance(tier, DiskTier)
    return tier


def flip_payload_byte(mem: kvmem.Memory, skey: str) -> None:
    """Flip one byte of the value's bytes in its file (a bit rot on disk, made for real)."""
    path = disk_of(mem).path(skey)
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0xFF
    path.write_bytes(bytes(data))


# -- load(out=) into a slice -----------------------------------------------------------------------------
@pytest.mark.parametrize("rows", list(SLICES))
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("stack", STACKS)
def test_load_into_a_slice_writes_the_slice_only(make_memory: MemoryFactory, stack: str, codec: str, rows: str) -> None:
    dtype, as_is = CODECS[codec]
    a, b = SLICES[rows]
    mem = make_memory(stack=stack)
    value = value_of(dtype, b - a)
    mem.store("chunk", value, compression=codec)
    expected = mem.load("chunk")  # the value as the plain load decodes it
    if as_is:
        assert_bit_exact(value, expected)
    else:
        err = (expected.double() - value.double()).abs()
        assert bool((err <= error_bound(value, codec)).all())
        assert not torch.equal(expected, value), "a lossy codec left every value unchanged: not the decoded path"
    cache = cache_of(dtype)
    out = cache[:, :, a:b]
    assert not out.is_contiguous()
    got = mem.load("chunk", out=out)
    assert got is out
    assert_bit_exact(expected, out.contiguous())
    assert_outside_untouched(cache, a, b)
    # a second load (from the top tier now, where one was promoted) writes the same bytes
    out.fill_(0)
    assert mem.load("chunk", out=out) is out
    assert_bit_exact(expected, out.contiguous())
    assert_outside_untouched(cache, a, b)


@pytest.mark.parametrize("stack", STACKS)
def test_load_into_a_contiguous_tensor_and_a_scalar(make_memory: MemoryFactory, stack: str) -> None:
    mem = make_memory(stack=stack)
    value = torch.arange(1000, dtype=torch.float64) / 7
    mem.store("flat", value)
    out = torch.empty(1000, dtype=torch.float64)
    assert mem.load("flat", out=out) is out
    assert_bit_exact(value, out)
    mem.store("scalar", torch.tensor(2.5))
    zero_d = torch.tensor(0.0)
    assert mem.load("scalar", out=zero_d) is zero_d and zero_d.item() == 2.5


def test_load_into_from_disk_promotes_to_the_cpu_tier(make_memory: MemoryFactory) -> None:
    value = value_of(torch.bfloat16, 32, seed=1)
    with make_memory(stack="cpu+disk") as mem:
        skey = mem.store("chunk", value)
    with make_memory(stack="cpu+disk") as mem:  # reopened: the value is on disk alone
        assert [t.name for t in mem._tiers.tiers if t.contains(skey)] == ["disk"]
        cache = cache_of(torch.bfloat16)
        out = cache[:, :, 32:64]
        mem.load("chunk", out=out)
        assert_bit_exact(value, out.contiguous())
        assert mem.metrics.value("kvmem_hits_total", tier="disk", kind="tensor") == 1
        assert [t.name for t in mem._tiers.tiers if t.contains(skey)] == ["cpu", "disk"]
        out.fill_(0)  # the promoted copy is the tier's own, not a view of out
        mem.load("chunk", out=out)
        assert_bit_exact(value, out.contiguous())
        assert mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tensor") == 1
        assert mem.metrics.value("kvmem_hits_total", tier="disk", kind="tensor") == 1
        assert_bit_exact(value, mem.load("chunk"))
        assert mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tensor") == 2
        assert_outside_untouched(cache, 32, 64)


# -- what out= refuses ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stack", STACKS)
def test_a_mismatched_out_is_refused_and_left_as_it_is(make_memory: MemoryFactory, stack: str) -> None:
    mem = make_memory(stack=stack)
    mem.store("chunk", value_of(torch.bfloat16, 32))
    mem.store("tree", {"k": value_of(torch.bfloat16, 32), "v": value_of(torch.bfloat16, 32, seed=1)})
    mem.store("text", "not a tensor")
    cases: list[tuple[str, object]] = [
        ("chunk", torch.full((2, 4, 31, 64), SENTINEL, dtype=torch.bfloat16)),  # wrong shape
        ("chunk", torch.full((2, 4, 32, 64), SENTINEL, dtype=torch.float16)),  # wrong dtype
        ("chunk", torch.full((2, 4, 32, 64), SENTINEL, dtype=torch.float32)),  # wrong dtype, same numbers
        ("tree", torch.full((2, 4, 32, 64), SENTINEL, dtype=torch.bfloat16)),  # a dict value
        ("text", torch.full((12,), SENTINEL, dtype=torch.bfloat16)),  # a str value
        ("chunk", np.full((2, 4, 32, 64), SENTINEL, dtype=np.float32)),  # not a tensor
        ("chunk", [0.0] * 4),  # not a tensor
    ]
    for key, out in cases:
        before = out.clone() if isinstance(out, torch.Tensor) else np.copy(out)
        with pytest.raises(OutputMismatch) as info:
            mem.load(key, out=out)  # type: ignore[arg-type]
        assert isinstance(info.value, KVMemError)
        if isinstance(out, torch.Tensor):
            assert as_bytes(out) == as_bytes(before), f"{key}: out was written before the refusal"
        else:
            assert np.array_equal(np.asarray(out), np.asarray(before))
    assert mem.stats().crc_failures == 0
    assert_bit_exact(value_of(torch.bfloat16, 32), mem.load("chunk"))  # refusals quarantine nothing


@pytest.mark.parametrize("stack", STACKS)
def test_a_miss_returns_the_default_and_leaves_out(make_memory: MemoryFactory, stack: str) -> None:
    mem = make_memory(stack=stack)
    cache = cache_of(torch.bfloat16)
    out = cache[:, :, 32:64]
    assert mem.load("never stored", out=out) is None
    assert mem.load("never stored", MISSING, out=out) is MISSING
    assert_outside_untouched(cache, 0, 0)  # nothing written anywhere
    assert mem.stats().misses == 2


@pytest.mark.parametrize("stack", ["disk", "cpu+disk"])
def test_a_corrupt_file_is_a_miss_counted_and_quarantined(make_memory: MemoryFactory, stack: str) -> None:
    value = value_of(torch.bfloat16, 32, seed=2)
    with make_memory(stack=stack) as mem:
        skey = mem.store("chunk", value)
    with make_memory(stack=stack) as mem:  # the file is the only copy
        flip_payload_byte(mem, skey)
        out = cache_of(torch.bfloat16)[:, :, 32:64]
        assert mem.load("chunk", MISSING, out=out) is MISSING
        assert mem.metrics.value("kvmem_crc_failures_total", tier="disk") == 1
        assert len(disk_of(mem).quarantined()) == 1 and not mem.contains("chunk")
        assert mem.load("chunk", MISSING, out=out) is MISSING  # now a plain miss
        assert mem.metrics.value("kvmem_crc_failures_total", tier="disk") == 1


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_corrupt_file_raises_with_strict(make_memory: MemoryFactory, codec: str) -> None:
    with make_memory(stack="disk") as mem:
        skey = mem.store("chunk", value_of(torch.bfloat16, 32, seed=3), compression=codec)
        flip_payload_byte(mem, skey)
        out = cache_of(torch.bfloat16)[:, :, 32:64]
        with pytest.raises(IntegrityError, match="integrity check"):
            mem.load("chunk", out=out, strict=True)
        assert mem.metrics.value("kvmem_crc_failures_total", tier="disk") == 1
        assert len(disk_of(mem).quarantined()) == 1


# -- load_many ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stack", STACKS)
def test_load_many_fills_hits_and_gives_none_for_misses(make_memory: MemoryFactory, stack: str) -> None:
    mem = make_memory(stack=stack)
    values = {f"c{i}": value_of(torch.bfloat16, 32, seed=10 + i) for i in range(5)}
    for k, v in values.items():
        mem.store(k, v)
    keys = ["c0", "gone-1", "c3", "c1", "gone-2", "c4"]
    got = mem.load_many(keys)
    assert [g is None for g in got] == [False, True, False, False, True, False]
    for k, g in zip(keys, got):
        if g is not None:
            assert_bit_exact(values[k], g)
    cache = torch.full((2, 4, 32 * len(keys), 64), SENTINEL, dtype=torch.bfloat16)
    outs = [cache[:, :, 32 * i : 32 * (i + 1)] for i in range(len(keys))]
    got = mem.load_many(keys, out=outs)
    for i, (k, g) in enumerate(zip(keys, got)):
        if k in values:
            assert g is outs[i]
            assert_bit_exact(values[k], outs[i].contiguous())
        else:
            assert g is None
            assert as_bytes(outs[i]) == as_bytes(torch.full_like(outs[i], SENTINEL)), f"{k}: a miss wrote out"
    assert mem.metrics.total("kvmem_misses_total") == 4


@pytest.mark.parametrize(("elements", "threaded"), [(16 << 10, False), (1 << 20, True)])
def test_load_many_reads_small_values_on_the_callers_thread(
    make_memory: MemoryFactory, monkeypatch: pytest.MonkeyPatch, elements: int, threaded: bool
) -> None:
    """Values under 1 MiB are read one after another on the caller's thread (their reads are mostly Python,
    which threads only take turns at); from 1 MiB on, all but the first on kvmem's I/O threads."""
    mem = make_memory(stack="disk", disk_bytes="64MiB")
    values = {f"c{i}": value_of(torch.bfloat16, 1, seed=i).new_full((elements,), float(i)) for i in range(4)}
    for k, v in values.items():
        mem.store(k, v)
    readers: list[str] = []
    read = DiskTier.read_verified

    def spied(tier: DiskTier, key: str) -> object:
        readers.append(threading.current_thread().name)
        return read(tier, key)

    monkeypatch.setattr(DiskTier, "read_verified", spied)
    got = mem.load_many(list(values))
    assert all(torch.equal(g, values[k]) for k, g in zip(values, got))
    here = threading.current_thread().name
    assert len(readers) == 4 and readers[0] == here
    assert all(r.startswith("kvmem-io") for r in readers[1:]) if threaded else set(readers) == {here}


@pytest.mark.parametrize(("elements", "threaded"), [(16 << 10, False), (1 << 20, True)])
def test_load_many_copies_large_values_out_of_ram_on_the_copy_threads(
    make_memory: MemoryFactory, monkeypatch: pytest.MonkeyPatch, elements: int, threaded: bool
) -> None:
    """From the CPU tier as from files: values under 1 MiB one after another on the caller's thread, larger
    ones (here into the slices of one destination) several at a time, on kvmem's copy threads."""
    mem = make_memory(stack="cpu+disk")
    values = {f"c{i}": value_of(torch.bfloat16, 1, seed=i).new_full((2, elements // 2), float(i)) for i in range(4)}
    mem.store_many(values)
    copiers: list[str] = []
    copy_plain = CpuTier.copy_plain

    def spied(tier: CpuTier, key: str, out: torch.Tensor | None) -> object:
        copiers.append(threading.current_thread().name)
        return copy_plain(tier, key, out)

    monkeypatch.setattr(CpuTier, "copy_plain", spied)
    dst = torch.zeros(2, 4 * elements // 2, dtype=torch.bfloat16)
    outs = [dst[:, i * elements // 2 : (i + 1) * elements // 2] for i in range(4)]
    got = mem.load_many(list(values), out=outs)
    assert all(g is o and torch.equal(o, values[k]) for k, g, o in zip(values, got, outs))
    here = threading.current_thread().name
    assert len(copiers) == 4 and copiers[0] == here
    assert all(c.startswith("kvmem-copy") for c in copiers[1:]) if threaded else set(copiers) == {here}


def test_load_many_refuses_an_out_of_the_wrong_length(make_memory: MemoryFactory) -> None:
    mem = make_memory(stack="cpu+disk")
    mem.store("a", torch.ones(4))
    mem.store("b", torch.ones(4))
    outs = [torch.zeros(4)]
    with pytest.raises(OutputMismatch, match="1 tensors for 2 keys"):
        mem.load_many(["a", "b"], out=outs)
    assert torch.equal(outs[0], torch.zeros(4))
    with pytest.raises(OutputMismatch):
        mem.load_many(["a"], out=[np.zeros(4)])  # type: ignore[list-item]
    with pytest.raises(OutputMismatch):
        mem.load_many(["a", "b"], out=[torch.zeros(4), torch.zeros(5)])
    assert mem.stats().crc_failures == 0


# -- store_many -------------------------------------------------------------------------------------------
CHUNK = 32
CHUNKS = 16


def chunked_cache() -> torch.Tensor:
    """A [2, 4, 16 * 32, 64] bf16 KV cache: 16 chunks of 32 tokens."""
    return torch.randn(2, 4, CHUNKS * CHUNK, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)


def chunk(t: torch.Tensor, i: int) -> torch.Tensor:
    return t[:, :, i * CHUNK : (i + 1) * CHUNK]


@pytest.mark.parametrize("stack", STACKS)
def test_store_many_then_load_many_round_trips_chunk_slices(make_memory: MemoryFactory, stack: str) -> None:
    mem = make_memory(stack=stack)
    kv = chunked_cache()
    original = kv.clone()
    keys = [f"chunk-{i}" for i in range(CHUNKS)]
    skeys = mem.store_many({k: chunk(kv, i) for i, k in enumerate(keys)})
    assert skeys == [mem.storage_key(k) for k in keys]
    kv.fill_(0)  # the caller may reuse its tensors as soon as store_many returns
    dst = torch.full_like(kv, SENTINEL)
    outs = [chunk(dst, i) for i in range(CHUNKS)]
    got = mem.load_many(keys, out=outs)
    assert all(g is o for g, o in zip(got, outs))
    assert_bit_exact(original, dst)
    plain = mem.load_many(keys)
    for i, v in enumerate(plain):
        assert_bit_exact(chunk(original, i).contiguous(), v)
    assert [mem.info(k).version for k in keys] == [1] * CHUNKS  # type: ignore[union-attr]

    mem.store_many([(k, chunk(original, CHUNKS - 1 - i)) for i, k in enumerate(keys)])  # list form, reversed
    assert [mem.info(k).version for k in keys] == [2] * CHUNKS  # type: ignore[union-attr]
    info = mem.info(keys[0])
    assert info is not None and info.kind == "tensor" and info.size == 2 * 4 * CHUNK * 64 * 2
    got = mem.load_many(keys, out=outs)
    for i in range(CHUNKS):
        assert_bit_exact(chunk(original, CHUNKS - 1 - i).contiguous(), outs[i].contiguous())
    assert mem.stats().entries == CHUNKS


@pytest.mark.parametrize("stack", ["disk", "cpu+disk"])
def test_store_many_with_fsync_always_leaves_no_temporary_files(
    tmp_path: Path, make_memory: MemoryFactory, stack: str
) -> None:
    kv = chunked_cache()
    keys = [f"chunk-{i}" for i in range(CHUNKS)]
    with make_memory(stack=stack, fsync="always") as mem:
        mem.store_many({k: chunk(kv, i) for i, k in enumerate(keys)})
        mem.store_many({k: chunk(kv, i) for i, k in enumerate(keys[:4])})
        assert list((tmp_path / "kvmem").rglob("*.tmp")) == []
        assert len(list((tmp_path / "kvmem" / "disk").rglob("*.kvb"))) == CHUNKS
    with make_memory(stack=stack) as mem:  # every chunk is on disk, whole
        assert_bit_exact(kv, torch.cat(mem.load_many(keys), dim=2))
        assert [mem.info(k).version for k in keys] == [2] * 4 + [1] * (CHUNKS - 4)  # type: ignore[union-attr]


def test_store_many_refuses_a_bad_item_and_stores_nothing(make_memory: MemoryFactory) -> None:
    mem = make_memory(stack="cpu+disk")
    with pytest.raises(kvmem.KVMemError):
        mem.store_many([("good", torch.ones(4)), ("bad", object())])
    assert not mem.contains("good") and mem.info("good") is None


def test_a_store_many_whose_write_fails_leaves_no_temporary_file(tmp_path: Path, make_memory: MemoryFactory) -> None:
    """One file of a batch cannot be created (a file stands where its shard directory goes, a fault made
    for real): the batch fails on that tier, and the files the other writes made are removed with it."""
    kv = chunked_cache()
    keys = [f"chunk-{i}" for i in range(CHUNKS)]
    with make_memory(stack="disk", fsync="always", tier_retry_seconds=0) as mem:
        blobs = tmp_path / "kvmem" / "disk" / "blobs"
        blocked = blobs / mem.storage_key(keys[-1])[:2]
        blocked.write_bytes(b"a file where a shard directory goes")
        with pytest.raises(kvmem.TierUnavailable):
            mem.store_many({k: chunk(kv, i) for i, k in enumerate(keys)})
        assert list(blobs.rglob("*.tmp")) == [], "the writes that succeeded left their temporary files"
        assert mem.metrics.value("kvmem_tier_errors_total", tier="disk") == 1
        blocked.unlink()  # the fault goes: the same batch stores whole
        mem.store_many({k: chunk(kv, i) for i, k in enumerate(keys)})
        assert list(blobs.rglob("*.tmp")) == []
        assert_bit_exact(kv, torch.cat(mem.load_many(keys), dim=2))


# -- the CPU tier's one-copy lane (a tensor stored as it is, in one run of pages) ------------------------------
@pytest.mark.parametrize("tokens", [8, 2048], ids=["64KiB", "2MiB"])  # below and above rows.TORCH_COPY_FROM
def test_a_ram_hit_is_one_copy_into_out_or_a_new_tensor_never_a_view(make_memory: MemoryFactory, tokens: int) -> None:
    mem = make_memory(stack="cpu")
    value = torch.randn(2, 4, tokens, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    mem.store("v", value)
    loaded = mem.load("v")
    assert torch.equal(loaded, value)
    loaded.fill_(0)  # the caller's: the pages are not behind it
    cache = torch.full((2, 4, tokens + 16, 256), SENTINEL, dtype=torch.bfloat16)
    out = cache[:, :, 8 : 8 + tokens]  # strided: torch's copy, not one memmove
    assert mem.load("v", out=out) is out and torch.equal(out, value)
    assert_outside_untouched(cache, 8, 8 + tokens)
    flat = torch.empty_like(value)
    assert mem.load("v", out=flat) is flat and torch.equal(flat, value)
    assert mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tensor") == 3


def test_a_ram_entry_written_for_another_key_is_never_returned(make_memory: MemoryFactory) -> None:
    # the lane trusts an entry only if its header names the key it is stored under
    mem = make_memory(stack="cpu")
    mem.store("a", torch.arange(16.0))
    mem.store("b", torch.arange(16.0) + 100)
    cpu = mem._tiers.tiers[0]
    blob_a = cpu.blob(mem.storage_key("a"))
    assert blob_a is not None
    cpu.put(mem.storage_key("b"), blob_a)  # a's bytes under b's name
    assert mem.load("b") is None and mem.load("b", out=torch.empty(16)) is None
    assert torch.equal(mem.load("a"), torch.arange(16.0))


@pytest.mark.parametrize("stack", ["disk", "cpu+disk"])
def test_a_durable_store_starts_the_writeback_of_its_payload_as_it_writes(
    tmp_path: Path, make_memory: MemoryFactory, monkeypatch: pytest.MonkeyPatch, stack: str
) -> None:
    """With ``fsync="always"`` each 8 MiB of payload written goes to the disk while the rest is checksummed and
    written (the fsync then waits for the tail only); with ``fsync="batch"`` the kernel keeps choosing when."""
    real = files._START_WRITEBACK
    if real is None:
        pytest.skip("no sync_file_range here (not Linux)")
    started: list[tuple[int, int]] = []

    def counted(fd: int, offset: int, nbytes: int) -> object:
        started.append((offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(files, "_START_WRITEBACK", counted)
    value = torch.randn(2, 4, 2048, 512, generator=torch.Generator().manual_seed(3))[:, :, 512:1792]  # 20 MiB, strided
    with make_memory(stack=stack, fsync="always") as mem:
        mem.store("big", value)
        path = next((tmp_path / "kvmem" / "disk").rglob("*.kvb"))
        head = path.stat().st_size - value.numel() * 4
        # 20 MiB: two ranges of 8 MiB and the step (1 MiB, or the piece of a row) that crossed it, in order from
        # the payload's first byte; the rest is left to the fsync
        (o1, n1), (o2, n2) = started
        assert o1 == head and o2 == o1 + n1 and all(8 << 20 <= n < 10 << 20 for n in (n1, n2))
        assert 0 < value.numel() * 4 - n1 - n2 < 8 << 20
        assert_bit_exact(value.contiguous(), mem.load("big"))
    started.clear()
    with make_memory(stack=stack, fsync="batch") as mem:
        mem.store("big2", value)
    assert started == []


# -- load(out=rows): one stored chunk scattered into blocks (a paged KV cache, as vLLM keeps it) -----------------
# the tier a value is read from ("cpu+disk": the disk, under a CPU tier it is promoted to; "redis": the same)
ROW_TIERS = ["cpu", "disk", "cpu+disk", "redis"]
ROW_CODECS = {"none": torch.bfloat16, "fp16": torch.float32, "int8": torch.bfloat16, "lz4": torch.bfloat16}
BLOCKS = [9, 2, 7, 0, 11]  # the block ids one chunk fills, in no order
# layout -> (layers, tokens per block, hidden) of a paged cache; a block is ``cache[:, b]`` (layer-major: one
# strided row per layer) or ``cache[b]`` (block-major: contiguous); "large" blocks are 2 MiB (streaming copies)
LAYOUTS = {"layer-major": (3, 16, 64), "block-major": (3, 16, 64), "large": (2, 64, 8192)}


def row_memory(make_memory: MemoryFactory, tier: str, request: pytest.FixtureRequest, redis_url: str) -> kvmem.Memory:
    if tier == "redis":
        return make_memory(disk_bytes=0, remote_url=with_options(redis_url, prefix=unique_prefix(request)))
    return make_memory(stack=tier)


def below_cpu(mem: kvmem.Memory, key: str) -> None:
    """Leave ``key`` in the tiers below the CPU tier only (as after the CPU tier evicted it)."""
    mem.flush()
    cpu = mem._tiers.tiers[0]
    if isinstance(cpu, CpuTier) and len(mem._tiers.tiers) > 1:
        cpu.delete(mem.storage_key(key))


def tiers_holding(mem: kvmem.Memory, key: str) -> list[str]:
    return [t.name for t in mem._tiers.tiers if t.contains(mem.storage_key(key))]


def paged_cache(layout: str, dtype: torch.dtype, blocks: int = 12) -> torch.Tensor:
    layers, tokens, hidden = LAYOUTS[layout]
    if layout == "block-major":
        return torch.full((blocks, layers, tokens, hidden), SENTINEL, dtype=dtype)
    return torch.full((layers, blocks, tokens, hidden), SENTINEL, dtype=dtype)


def block(cache: torch.Tensor, layout: str, b: int) -> torch.Tensor:
    return cache[b] if layout == "block-major" else cache[:, b]


def chunk_of(layout: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """One stored chunk: ``[len(BLOCKS), layers, tokens, hidden]``."""
    return torch.randn(len(BLOCKS), *LAYOUTS[layout], generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_blocks(cache: torch.Tensor, layout: str, expected: dict[int, torch.Tensor]) -> None:
    """Block ``b`` holds ``expected[b]``; every other block only the sentinel."""
    for b in range(cache.shape[0 if layout == "block-major" else 1]):
        want = expected.get(b)
        got = block(cache, layout, b)
        if want is None:
            assert as_bytes(got) == as_bytes(torch.full_like(got, SENTINEL)), f"block {b} was written"
        else:
            assert_bit_exact(want, got.contiguous())


@pytest.mark.parametrize(
    ("codec", "layout"),
    [(codec, layout) for codec in ROW_CODECS for layout in LAYOUTS if layout != "large" or codec == "none"],
)  # the large blocks are for the one-copy lanes (streaming copies)
@pytest.mark.parametrize("tier", ROW_TIERS)
def test_load_into_rows_fills_the_blocks_in_any_order(
    make_memory: MemoryFactory, request: pytest.FixtureRequest, redis_url: str, tier: str, codec: str, layout: str
) -> None:
    dtype = ROW_CODECS[codec]
    mem = row_memory(make_memory, tier, request, redis_url)
    value = chunk_of(layout, dtype)
    mem.store("chunk", value, compression=codec)
    expected = mem.load("chunk")  # as the plain load decodes it
    below_cpu(mem, "chunk")
    cache = paged_cache(layout, dtype)
    rows = [block(cache, layout, b) for b in BLOCKS]

    got = mem.load("chunk", out=rows)

    assert isinstance(got, list) and len(got) == len(rows) and all(g is r for g, r in zip(got, rows))
    assert_blocks(cache, layout, {b: expected[i] for i, b in enumerate(BLOCKS)})
    if codec in ("none", "lz4"):
        assert_bit_exact(value, expected)
    if tier in ("cpu+disk", "redis") and codec == "none":  # promoted from the rows: the next load is from RAM
        assert tiers_holding(mem, "chunk")[0] == "cpu"
    for r in rows:
        r.fill_(0)  # a promoted copy is the tier's own, not a view of the rows
    assert mem.load("chunk", out=tuple(rows)) == rows  # any sequence; returned as a list
    assert_blocks(cache, layout, {b: expected[i] for i, b in enumerate(BLOCKS)})
    assert_bit_exact(expected, mem.load("chunk"))


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("tier", ROW_TIERS)
def test_a_none_row_is_left_as_it_is_and_the_load_not_promoted(
    make_memory: MemoryFactory, request: pytest.FixtureRequest, redis_url: str, tier: str, codec: str
) -> None:
    mem = row_memory(make_memory, tier, request, redis_url)
    mem.store("chunk", chunk_of("layer-major", torch.bfloat16), compression=codec)
    expected = mem.load("chunk")
    below_cpu(mem, "chunk")
    before = tiers_holding(mem, "chunk")
    cache = paged_cache("layer-major", torch.bfloat16)
    rows: list[torch.Tensor | None] = [block(cache, "layer-major", b) for b in BLOCKS]
    rows[1] = rows[4] = None  # blocks the cache holds already

    got = mem.load("chunk", out=rows)

    assert got == rows and got[1] is None and got[4] is None
    assert_blocks(cache, "layer-major", {b: expected[i] for i, b in enumerate(BLOCKS) if i not in (1, 4)})
    assert tiers_holding(mem, "chunk") == before, "a load of some rows was promoted"
    assert mem.load("chunk", out=[None] * len(BLOCKS)) == [None] * len(BLOCKS)  # nothing to write: still a hit


@pytest.mark.parametrize("stack", STACKS)
def test_mismatched_rows_are_refused_with_nothing_written(make_memory: MemoryFactory, stack: str) -> None:
    mem = make_memory(stack=stack)
    mem.store("chunk", chunk_of("layer-major", torch.bfloat16))
    mem.store("tree", {"k": torch.ones(2, 3)})
    mem.store("scalar", torch.tensor(1.0))
    cache = paged_cache("layer-major", torch.bfloat16)
    other = torch.full((len(BLOCKS), 3, 16, 64), SENTINEL, dtype=torch.float16)
    rows = [block(cache, "layer-major", b) for b in BLOCKS]
    cases: list[tuple[str, object, str]] = [
        ("chunk", rows[:4], "4 rows cannot hold"),  # too few rows
        ("chunk", [*rows, None], "6 rows cannot hold"),  # too many
        ("chunk", [*rows[:4], cache[:, 5, :8]], "row 4 of shape"),  # a row of the wrong shape, last
        ("chunk", [*rows[:4], other[0]], "dtype float16"),  # a row of the wrong dtype
        ("chunk", [rows[0], "row", *rows[2:]], r"out\[1\]=str"),  # not a tensor
        ("chunk", "rows", "out=str"),  # a str is no sequence of rows
        ("tree", rows, "not one tensor"),
        ("scalar", [torch.zeros(())], "no rows"),
    ]
    for key, out, message in cases:
        with pytest.raises(OutputMismatch, match=message):
            mem.load(key, out=out)  # type: ignore[arg-type]
        assert_blocks(cache, "layer-major", {})
    with pytest.raises(OutputMismatch, match="row 4 of shape"):
        mem.load_many(["chunk"], out=[[*rows[:4], cache[:, 5, :8]]])
    assert_blocks(cache, "layer-major", {})
    assert mem.stats().crc_failures == 0


@pytest.mark.parametrize("tier", ROW_TIERS)
def test_load_many_mixes_tensors_and_row_lists(
    make_memory: MemoryFactory, request: pytest.FixtureRequest, redis_url: str, tier: str
) -> None:
    mem = row_memory(make_memory, tier, request, redis_url)
    chunks = {f"c{i}": chunk_of("layer-major", torch.bfloat16, seed=i) for i in range(3)}
    mem.store_many(chunks)
    for key in chunks:
        below_cpu(mem, key)
    cache = paged_cache("layer-major", torch.bfloat16, blocks=16)
    flat = torch.full_like(chunks["c1"], SENTINEL)
    outs: list[object] = [
        [block(cache, "layer-major", b) for b in BLOCKS],  # c0 into blocks
        flat,  # c1 into one tensor
        [block(cache, "layer-major", b) for b in (1, 3, 5, 6, 8)],  # a miss: its blocks stay as they are
        [None, *(block(cache, "layer-major", b) for b in (10, 12, 13, 14))],  # c2, its first row skipped
    ]

    got = mem.load_many(["c0", "c1", "gone", "c2"], out=outs)  # type: ignore[arg-type]

    assert got[0] == outs[0] and got[1] is flat and got[2] is None and got[3] == outs[3]
    assert_bit_exact(chunks["c1"], flat)
    want = {b: chunks["c0"][i] for i, b in enumerate(BLOCKS)}
    want.update({b: chunks["c2"][i + 1] for i, b in enumerate((10, 12, 13, 14))})
    assert_blocks(cache, "layer-major", want)


@pytest.mark.parametrize("stack", STACKS)
def test_regenerate_copies_the_new_tensors_rows_in(make_memory: MemoryFactory, stack: str) -> None:
    mem = make_memory(stack=stack)
    value = chunk_of("layer-major", torch.bfloat16)
    cache = paged_cache("layer-major", torch.bfloat16)
    rows: list[torch.Tensor | None] = [block(cache, "layer-major", b) for b in BLOCKS]
    rows[2] = None

    got = mem.load("chunk", out=rows, regenerate=lambda: value)

    assert got == rows
    assert_blocks(cache, "layer-major", {b: value[i] for i, b in enumerate(BLOCKS) if i != 2})
    assert_bit_exact(value, mem.load("chunk"))  # stored as regenerated
    with pytest.raises(OutputMismatch, match="6 rows cannot hold"):
        mem.load("other", out=[*rows, None], regenerate=lambda: value)
    with pytest.raises(OutputMismatch, match="cannot hold a dict"):
        mem.load("third", out=rows, regenerate=lambda: {"k": value})
    assert_blocks(cache, "layer-major", {b: value[i] for i, b in enumerate(BLOCKS) if i != 2})


@pytest.mark.cuda
@pytest.mark.parametrize("tier", ["cpu", "disk", "cpu+disk"])
def test_load_into_rows_on_the_gpu(make_memory: MemoryFactory, tier: str) -> None:
    """Blocks of a paged cache in GPU memory: each row copied to the device; a disk hit promoted from them."""
    mem = make_memory(stack=tier)
    value = chunk_of("layer-major", torch.bfloat16)
    mem.store("chunk", value)
    below_cpu(mem, "chunk")
    cache = paged_cache("layer-major", torch.bfloat16).cuda()
    rows = [block(cache, "layer-major", b) for b in BLOCKS]
    assert mem.load("chunk", out=rows) == rows
    assert_blocks(cache.cpu(), "layer-major", {b: value[i] for i, b in enumerate(BLOCKS)})
    if tier == "cpu+disk":
        assert tiers_holding(mem, "chunk")[0] == "cpu"
    assert_bit_exact(value, mem.load("chunk"))
