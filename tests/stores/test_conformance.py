"""One conformance suite over every tier and every codec.

Two levels, both on real components (real files, real SQLite, a real Redis):

- the ``StorageTier`` contract, on each tier object alone (``CpuTier``, ``DiskTier``,
  ``GpuTier`` on device ``cpu``, ``RedisTier`` on the session's throwaway server), and
  on a tier that implements the core protocol only, through a ``TieredStore`` (which
  gives it every capability's fallback). Redis evicts by itself, in no LRU order, and
  its ``usage()`` is the server's memory: those checks are skipped for it alone;
- the store contract through a :class:`kvmem.Memory` whose tier stack is one of
  those tiers or a ``TieredStore`` of cpu + disk: round trip (bit-exact for lossless
  codecs, bounded for lossy ones), miss, overwrite -> new version, delete, LRU
  eviction order, corruption -> miss (counted), reopen after close.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem import blob as blobfmt
from kvmem.codecs import parse_codec
from kvmem.errors import IntegrityError
from kvmem.metrics import Metrics
from kvmem.stores import Capabilities, CpuTier, DiskTier, GpuTier, StorageTier, TieredStore
from kvmem.stores.eviction import Arc
from kvmem.stores.redis import RedisTier
from tests.bounds import assert_bit_exact, error_bound
from tests.conftest import MemoryFactory
from tests.stores.blobs import blob_of
from tests.stores.redis_helpers import unique_prefix, with_options

SPECS = ["none", "fp16", "bf16", "int8", "int4", "lz4", "int8+lz4", "int4+lz4"]
STACKS = ["cpu", "disk", "gpu", "cpu+disk"]
CRC_STACKS = ["cpu", "disk", "cpu+disk"]  # the GPU tier is not CRC-checked by design (bytes never left the device)
VERIFY = {"cpu_verify": True}  # NOTE: CPU-tier loads re-check CRCs only when asked (they trust the pool's pages)
PERSISTENT = {"disk", "cpu+disk"}
ENTRY = 16_900  # bytes of one 16 KiB fp32 entry once framed (header, alignment, CRC)
MISSING = object()


# =================================================================================================
# Level 1: the StorageTier contract on each tier alone
# =================================================================================================
class CoreTier:
    """A tier with the core protocol only, no capability: the tiered store's fallbacks serve the rest."""

    persistent = False

    def __init__(self, capacity: int) -> None:
        self.name = "core"
        self.capacity = capacity
        self.blobs: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        buf = self.blobs.get(key)
        if buf is not None:
            self.blobs.move_to_end(key)
        return None if buf is None else buf.clone()

    def put(self, key: str, blob: blobfmt.EncodedBlob) -> None:
        blob.seal()
        self.blobs.pop(key, None)
        self.blobs[key] = blob.to_tensor()

    def contains(self, key: str) -> bool:
        return key in self.blobs

    def delete(self, key: str) -> bool:
        return self.blobs.pop(key, None) is not None

    def keys(self) -> Iterator[str]:
        return iter(list(self.blobs))

    def usage(self) -> int:
        return sum(b.numel() for b in self.blobs.values())

    def close(self) -> None:
        return None


@pytest.fixture(params=["cpu", "cpu-arc", "disk", "gpu", "gpu-arc", "redis", "core"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageTier]:
    made: StorageTier = {
        "cpu": lambda: CpuTier(1 << 20),
        "cpu-arc": lambda: CpuTier(1 << 20, eviction="arc"),
        "disk": lambda: DiskTier(tmp_path / "disk", 1 << 20, fsync="never"),
        "gpu": lambda: GpuTier(1 << 20, device="cpu"),
        "gpu-arc": lambda: GpuTier(1 << 20, device="cpu", eviction="arc"),
        "redis": lambda: RedisTier.from_url(
            with_options(request.getfixturevalue("redis_url"), prefix=unique_prefix(request))
        ),
        "core": lambda: CoreTier(1 << 20),
    }[request.param]()
    yield made
    if isinstance(made, RedisTier):
        made.client.delete(*made.client.keys(made.prefix + "*") or ["-"])
    made.close()


@pytest.fixture
def store(tier: StorageTier) -> TieredStore:
    """A tiered store of ``tier`` alone: its capabilities, or the store's fallbacks where it has none."""
    return TieredStore([tier], Metrics())


def key(i: int) -> str:
    return kvmem.content_hash(f"entry-{i}")


def footprint(tier: StorageTier, nbytes: int) -> int:
    """What ``tier.usage()`` counts for a blob of ``nbytes``: its bytes, or whole pages of the CPU tier's pool."""
    page = tier.pool.page_bytes if isinstance(tier, CpuTier) else 1
    return -(-nbytes // page) * page


def assert_usage(tier: StorageTier, nbytes: int) -> None:
    """``tier.usage()`` counts ``nbytes`` of blobs (a self-evicting tier's is its server's memory: not checked)."""
    if not Capabilities.of(tier).self_evicting:
        assert tier.usage() == footprint(tier, nbytes)


def lru_order_kept(tier: StorageTier) -> None:
    """Skip an LRU-order check for a tier that evicts by itself, in an order of its own."""
    if Capabilities.of(tier).self_evicting:
        pytest.skip(f"tier {tier.name} evicts by itself: its keys() are in no LRU order")
    if isinstance(getattr(tier, "_order", None), Arc):
        pytest.skip("eviction arc keeps entries read again after those read once (tests/stores/test_eviction.py)")


def test_tier_satisfies_protocol(tier: StorageTier) -> None:
    assert isinstance(tier, StorageTier)
    caps = Capabilities.of(tier)
    # loads from the CPU tier trust its pages unless verify=True; the GPU tier's bytes never left the device
    assert caps.trusted == (tier.name == "gpu") and caps.shares_buffers == (tier.name == "cpu")
    assert (caps.verified_reads is tier) == (tier.name not in ("gpu", "core"))
    assert (caps.opens_blobs is tier) == (tier.name != "core")
    assert (caps.quarantine is tier) == (tier.name in ("disk", "redis"))
    assert caps.self_evicting == (tier.name == "redis")
    assert tier.persistent == (tier.name in ("disk", "redis"))


def test_tier_put_get_miss(tier: StorageTier) -> None:
    enc = blob_of(b"hello tier" * 10)
    assert tier.get(key(0)) is None
    assert not tier.contains(key(0))
    tier.put(key(0), enc)
    assert tier.contains(key(0))
    got = tier.get(key(0))
    assert got is not None and got.dtype == torch.uint8
    assert got.cpu().numpy().tobytes() == b"".join(p.tobytes() for p in enc.parts)
    blobfmt.verify(got.cpu())
    assert_usage(tier, enc.nbytes)
    assert list(tier.keys()) == [key(0)]


def test_tier_overwrite_replaces_and_accounts_once(tier: StorageTier) -> None:
    tier.put(key(0), blob_of(b"a" * 100))
    new = blob_of(b"b" * 1000)
    tier.put(key(0), new)
    got = tier.get(key(0))
    assert got is not None and got.cpu().numpy().tobytes() == b"".join(p.tobytes() for p in new.parts)
    assert_usage(tier, new.nbytes)
    assert list(tier.keys()) == [key(0)]


def test_tier_delete(tier: StorageTier) -> None:
    tier.put(key(0), blob_of(b"x" * 10))
    tier.put(key(1), blob_of(b"y" * 10))
    assert tier.delete(key(0)) is True
    assert tier.delete(key(0)) is False
    assert tier.get(key(0)) is None and not tier.contains(key(0))
    assert list(tier.keys()) == [key(1)]
    assert_usage(tier, blob_of(b"y" * 10).nbytes)


def test_tier_keys_in_lru_order(tier: StorageTier) -> None:
    lru_order_kept(tier)
    for i in range(4):
        tier.put(key(i), blob_of(bytes([i]) * 50))
    assert list(tier.keys()) == [key(0), key(1), key(2), key(3)]
    tier.get(key(1))
    tier.get(key(0))
    assert list(tier.keys()) == [key(2), key(3), key(1), key(0)]
    tier.contains(key(2))  # contains is not a use
    tier.put(key(2), blob_of(b"new" * 5))  # a write is
    assert list(tier.keys()) == [key(3), key(1), key(0), key(2)]


def test_tier_batched_lookups_match_single_calls(tier: StorageTier, store: TieredStore) -> None:
    tier.put(key(0), blob_of(b"zero"))
    keys = [key(0), key(1)]
    assert store.contains_many(keys) == [True, False]  # the tier's own batch, or one contains per key


def test_tier_reads_verified_and_in_parts(tier: StorageTier, store: TieredStore) -> None:
    enc = blob_of(b"parts" * 300)
    tier.put(key(0), enc)
    fetched, corrupt = store.get(key(0))
    assert fetched is not None and corrupt == 0 and fetched.tier == tier.name
    assert fetched.buf.cpu().numpy().tobytes() == enc.to_tensor().numpy().tobytes()
    reader = store.open_blob(key(0), tier)
    assert reader is not None
    with reader:
        assert reader.header == blobfmt.parse(enc.to_tensor())[0]
        assert reader.read(0, int(reader.header["payload_nbytes"])).cpu().numpy().tobytes() == b"parts" * 300
    assert store.open_blob(key(1), tier) is None and store.get(key(1)) == (None, 0)


def test_tier_quarantine_takes_entry_out_of_service(tier: StorageTier, store: TieredStore) -> None:
    tier.put(key(0), blob_of(b"bad" * 30))
    store.quarantine_copy(tier, key(0))
    assert tier.get(key(0)) is None and not tier.contains(key(0))
    assert_usage(tier, 0)
    if isinstance(tier, DiskTier | RedisTier):
        assert len(tier.quarantined()) == 1
        freed = store.purge_quarantine(tier)
        assert freed == blob_of(b"bad" * 30).nbytes
        assert tier.quarantined() == []
    else:
        assert store.purge_quarantine(tier) == 0


def test_store_checks_a_core_tier_and_takes_a_corrupt_copy_out() -> None:
    core = CoreTier(1 << 20)
    checked = TieredStore([core], Metrics())
    core.put(key(0), blob_of(b"flip" * 50))
    core.blobs[key(0)][-10] ^= 0x01  # NOTE: a byte flips where the tier keeps it
    assert checked.get(key(0)) == (None, 1)
    assert not core.contains(key(0)), "quarantined: deleted, as the tier keeps no quarantine"
    assert checked.metrics.total("kvmem_crc_failures_total") == 1


def test_memory_tiers_store_immutable_copies() -> None:
    """Copy-on-write: a put copies the blob; a later put never writes into a buffer handed out."""
    for tier in (CpuTier(1 << 20), GpuTier(1 << 20, device="cpu")):
        src = blob_of(b"v1" * 20)
        tier.put(key(0), src)
        first = tier.get(key(0))
        assert first is not None
        snapshot = first.clone()
        tier.put(key(0), blob_of(b"v2" * 20))
        assert torch.equal(first, snapshot), "the old version's buffer was written over"


def test_disk_tier_reopen_keeps_entries_and_lru_order(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    tier = DiskTier(root, 1 << 20, fsync="always")
    blobs = {i: blob_of(bytes([i]) * (100 + i)) for i in range(5)}
    for i, enc in blobs.items():
        tier.put(key(i), enc)
    tier.get(key(1))
    tier.get(key(0))
    order = list(tier.keys())
    assert order == [key(2), key(3), key(4), key(1), key(0)]
    usage = tier.usage()
    tier.close()

    again = DiskTier(root, 1 << 20)
    assert list(again.keys()) == order
    assert again.usage() == usage
    for i, enc in blobs.items():
        got = again.get(key(i))
        assert got is not None and got.numpy().tobytes() == b"".join(p.tobytes() for p in enc.parts)


def test_disk_tier_cleans_stray_temp_files_and_ignores_foreign_files(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    tier = DiskTier(root, 1 << 20)
    tier.put(key(0), blob_of(b"kept"))
    tier.close()
    shard = tier.path(key(0)).parent
    stray = shard / f"{key(1)}.999999999.0.tmp"  # a pid that cannot be alive
    stray.write_bytes(b"half a blob")
    (shard / "notes.txt").write_text("not a blob")
    again = DiskTier(root, 1 << 20)
    assert not stray.exists()
    assert list(again.keys()) == [key(0)]
    assert (shard / "notes.txt").exists()


def test_disk_tier_refuses_non_storage_keys(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "disk", 1 << 20)
    for bad in ("../../etc/passwd", "A" * 64, "a" * 63, key(0) + "/x"):
        with pytest.raises(ValueError, match="storage key"):
            tier.put(bad, blob_of(b"x"))
    assert [p.name for p in (tmp_path / "disk").rglob("*") if p.is_file()] == ["areas.json"]


def test_memory_tier_on_meta_device_keeps_device() -> None:
    tier = GpuTier(1 << 20, device="meta")
    tier.put(key(0), blob_of(b"somewhere else"))
    got = tier.get(key(0))
    assert got is not None and got.device.type == "meta"


# =================================================================================================
# Level 2: the store contract through Memory, over every tier stack and codec
# =================================================================================================
@pytest.fixture
def opened(make_memory: MemoryFactory) -> MemoryFactory:
    """``opened(stack, cpu=64 MiB, disk=64 MiB, **settings)``: ``make_memory`` over the tiers ``stack`` names.

    ``"gpu"``: one GPU tier alone, built on the CPU device (``gpu_bytes`` needs CUDA; the GPU tier's
    code path runs on any torch device).
    """

    def make(stack: str, *, cpu: int = 64 << 20, disk: int = 64 << 20, **settings: object) -> kvmem.Memory:
        if stack != "gpu":
            return make_memory(stack=stack, cpu_bytes=cpu, disk_bytes=disk, **settings)
        mem = make_memory(stack="cpu", cpu_bytes=cpu, **settings)
        mem._tiers.close()
        mem._tiers = TieredStore(
            [GpuTier(cpu, device="cpu")],
            mem.metrics,
            offload_threshold=mem.config.offload_threshold,
            on_removed=mem._catalog.record_removed,
        )
        return mem

    return make


def kv(seed: int = 0, shift: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(1, 2, 64, 32, generator=g) + shift,
        "v": torch.randn(1, 2, 64, 32, generator=g) + shift,
        "ids": torch.arange(64),
    }


def assert_kv_matches(expected: dict[str, torch.Tensor], got: object, spec: str) -> None:
    """Bit-exact for lossless codecs; within the codec's bound (keys per channel) for lossy ones."""
    assert isinstance(got, dict) and set(got) == set(expected)
    assert_bit_exact(expected["ids"], got["ids"])
    codec = parse_codec(spec).tensor
    for name, axis in (("k", -2), ("v", -1)):
        if codec == "none":
            assert_bit_exact(expected[name], got[name])
        else:
            assert got[name].dtype == expected[name].dtype and got[name].shape == expected[name].shape
            err = (got[name].double() - expected[name].double()).abs()
            assert bool((err <= error_bound(expected[name], codec, axis)).all())


def tier_named(mem: kvmem.Memory, name: str) -> StorageTier:
    return next(t for t in mem._tiers.tiers if t.name == name)


def crc_failures(mem: kvmem.Memory) -> int:
    return int(mem.metrics.total("kvmem_crc_failures_total"))


def corrupt(mem: kvmem.Memory, tier_name: str, skey: str, where: str) -> None:
    """Flip one byte of ``skey``'s copy in the tier, in place (the file, or the tier's own buffer)."""
    tier = tier_named(mem, tier_name)
    if isinstance(tier, DiskTier):
        path = tier.path(skey)
        data = bytearray(path.read_bytes())
        data[_position(torch.frombuffer(bytearray(data), dtype=torch.uint8), where)] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        assert Capabilities.of(tier).shares_buffers
        buf = tier.get(skey)  # the tier's own buffer
        assert buf is not None
        buf[_position(buf, where)] ^= 0xFF


def _position(buf: torch.Tensor, where: str) -> int:
    header, start = blobfmt.parse(buf)
    return {"header": 30, "payload": start + header["payload_nbytes"] // 2, "trailer": buf.numel() - 2}[where]


# -- round trip, miss, overwrite, delete -----------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("stack", STACKS)
def test_round_trip(opened: MemoryFactory, stack: str, spec: str) -> None:
    mem = opened(stack)
    value = kv()
    skey = mem.store("chunk", value, compression=spec)
    assert kvmem.keys.is_storage_key(skey)
    assert_kv_matches(value, mem.load("chunk"), spec)
    assert_kv_matches(value, mem.load("chunk"), spec)  # a second load (now from the top tier) as well
    info = mem.info("chunk")
    assert info is not None and info.codec == str(parse_codec(spec)) and info.version == 1
    assert mem.stats().hits == 2


@pytest.mark.parametrize("stack", STACKS)
def test_miss(opened: MemoryFactory, stack: str) -> None:
    mem = opened(stack)
    assert mem.load("never stored") is None
    assert mem.load("never stored", MISSING) is MISSING
    assert not mem.contains("never stored")
    assert mem.info("never stored") is None
    assert mem.stats().misses == 2 and mem.stats().hits == 0


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("stack", STACKS)
def test_overwrite_makes_new_version(opened: MemoryFactory, stack: str, spec: str) -> None:
    mem = opened(stack)
    v1, v2 = kv(1), kv(2, shift=10.0)
    mem.store("chunk", v1, compression=spec)
    held = mem.load("chunk")
    held_copy = {k: t.clone() for k, t in held.items()}
    mem.store("chunk", v2, compression=spec, metadata={"v": 2})
    info = mem.info("chunk")
    assert info is not None and info.version == 2 and info.metadata == {"v": 2}
    assert_kv_matches(v2, mem.load("chunk"), spec)
    for name in held:  # the reader that held version 1 keeps it
        assert_bit_exact(held_copy[name], held[name])
    mem.store("chunk", v1, compression=spec)
    assert mem.info("chunk").version == 3  # type: ignore[union-attr]
    assert_kv_matches(v1, mem.load("chunk"), spec)
    assert mem.stats().entries == 1


@pytest.mark.parametrize("stack", STACKS)
def test_delete(opened: MemoryFactory, stack: str) -> None:
    mem = opened(stack)
    skey = mem.store("a", kv(1))
    mem.store("b", kv(2))
    assert mem.delete("a") is True
    assert mem.delete("a") is False
    assert not mem.contains("a") and mem.load("a", MISSING) is MISSING and mem.info("a") is None
    assert not any(t.contains(skey) for t in mem._tiers.tiers)
    assert_kv_matches(kv(2), mem.load("b"), "none")
    assert mem.stats().entries == 1


# -- eviction --------------------------------------------------------------------------------------------
def entry_value(i: int) -> torch.Tensor:
    return torch.full((4096,), float(i))  # 16 KiB: ENTRY bytes framed


@pytest.mark.parametrize("stack", STACKS)
def test_eviction_is_lru_and_a_recent_read_survives(opened: MemoryFactory, stack: str) -> None:
    # One tier: room for 5 entries. cpu + disk: the cpu tier holds 2 (0.7 threshold), the disk 5.
    if stack == "cpu+disk":
        mem = opened(stack, cpu=int(3.5 * ENTRY), disk=int(5.5 * ENTRY))
    else:
        mem = opened(stack, cpu=int(5.5 * ENTRY), disk=int(5.5 * ENTRY))
    for i in range(5):
        mem.store(f"e{i}", entry_value(i))
    assert all(mem.contains(f"e{i}") for i in range(5))
    assert mem.info("e0").stored_size < ENTRY  # type: ignore[union-attr]
    assert mem.stats().evictions == 0
    assert torch.equal(mem.load("e0"), entry_value(0))  # e0 is now the most recently used

    mem.store("e5", entry_value(5))
    assert not mem.contains("e1"), "the least recently used entry goes first"
    assert mem.contains("e0"), "an entry read since is kept"
    mem.store("e6", entry_value(6))
    assert not mem.contains("e2")

    assert [mem.contains(f"e{i}") for i in range(7)] == [True, False, False, True, True, True, True]
    for i in (0, 3, 4, 5, 6):
        assert torch.equal(mem.load(f"e{i}"), entry_value(i))
    assert mem.load("e1", MISSING) is MISSING and mem.info("e1") is None
    assert mem.stats().evictions >= 2
    for t in mem._tiers.tiers:
        assert t.usage() <= t.capacity


@pytest.mark.parametrize("stack", STACKS)
def test_value_larger_than_every_tier_is_refused(opened: MemoryFactory, stack: str) -> None:
    mem = opened(stack, cpu=4 * ENTRY, disk=4 * ENTRY)
    mem.store("small", entry_value(1))
    with pytest.raises(kvmem.CapacityError):
        mem.store("big", torch.zeros(5 * 4096))
    assert not mem.contains("big")
    assert torch.equal(mem.load("small"), entry_value(1))


# -- corruption -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, where", [(spec, "payload") for spec in SPECS] + [("none", "header"), ("none", "trailer")]
)
@pytest.mark.parametrize("stack", CRC_STACKS)
def test_corruption_is_a_miss_never_wrong_data(opened: MemoryFactory, stack: str, spec: str, where: str) -> None:
    mem = opened(stack, **VERIFY)
    skey = mem.store("chunk", kv(3), compression=spec)
    holders = [t.name for t in mem._tiers.tiers if t.contains(skey)]
    for name in holders:
        corrupt(mem, name, skey, where)
    assert mem.load("chunk", MISSING) is MISSING
    assert crc_failures(mem) == len(holders)
    assert not any(t.contains(skey) for t in mem._tiers.tiers), "corrupt copies are taken out of service"
    assert mem.load("chunk", MISSING) is MISSING  # now a plain miss
    assert crc_failures(mem) == len(holders)
    if "disk" in holders:
        assert len(tier_named(mem, "disk").quarantined()) == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec", ["none", "int4+lz4"])
def test_corrupt_upper_copy_falls_back_to_a_good_lower_copy(opened: MemoryFactory, spec: str) -> None:
    mem = opened("cpu+disk", **VERIFY)
    value = kv(4)
    skey = mem.store("chunk", value, compression=spec)
    corrupt(mem, "cpu", skey, "payload")
    assert_kv_matches(value, mem.load("chunk"), spec)
    assert crc_failures(mem) == 1
    assert mem.metrics.value("kvmem_hits_total", tier="disk", kind="tree") == 1
    assert tier_named(mem, "cpu").contains(skey), "the good copy was promoted back up"
    assert_kv_matches(value, mem.load("chunk"), spec)
    assert mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tree") == 1


@pytest.mark.parametrize("stack", CRC_STACKS)
def test_corruption_strict_raises_and_regenerate_rebuilds(opened: MemoryFactory, stack: str) -> None:
    mem = opened(stack, **VERIFY)
    skey = mem.store("chunk", kv(5))
    for t in mem._tiers.tiers:
        if t.contains(skey):
            corrupt(mem, t.name, skey, "payload")
    with pytest.raises(IntegrityError, match="integrity"):
        mem.load("chunk", strict=True)
    mem.store("chunk", kv(5))
    for t in mem._tiers.tiers:
        if t.contains(skey):
            corrupt(mem, t.name, skey, "payload")
    calls: list[int] = []
    got = mem.load("chunk", regenerate=lambda: calls.append(1) or kv(6))
    assert calls == [1]
    assert_kv_matches(kv(6), got, "none")
    assert_kv_matches(kv(6), mem.load("chunk"), "none")


@pytest.mark.parametrize("stack", sorted(PERSISTENT))
def test_truncated_or_emptied_file_is_a_miss(opened: MemoryFactory, stack: str) -> None:
    mem = opened(stack, cpu=1)  # the cpu tier (if any) is too small: disk is the only copy
    skey = mem.store("a", kv(1))
    mem.store("b", kv(2))
    disk = tier_named(mem, "disk")
    assert isinstance(disk, DiskTier)
    path_a, path_b = disk.path(skey), disk.path(mem.storage_key("b"))
    path_a.write_bytes(path_a.read_bytes()[:-100])
    path_b.write_bytes(b"")
    assert mem.load("a", MISSING) is MISSING and mem.load("b", MISSING) is MISSING
    assert crc_failures(mem) == 2


# -- reopen ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("stack", STACKS)
def test_reopen_after_close(opened: MemoryFactory, stack: str, spec: str) -> None:
    values = {f"c{i}": kv(i) for i in range(3)}
    with opened(stack) as mem:
        for name, value in values.items():
            mem.store(name, value, compression=spec, metadata={"name": name})
        mem.store("c0", values["c0"], compression=spec, metadata={"name": "c0"})  # version 2
    with opened(stack) as mem:
        if stack in PERSISTENT:
            for name, value in values.items():
                assert mem.contains(name)
                assert_kv_matches(value, mem.load(name), spec)
            info = mem.info("c0")
            assert info is not None and info.version == 2 and info.metadata == {"name": "c0"}
            assert mem.metrics.value("kvmem_hits_total", tier="disk", kind="tree") == 3
            if stack == "cpu+disk":  # served from disk once, then promoted to cpu
                assert_kv_matches(values["c1"], mem.load("c1"), spec)
                assert mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tree") == 1
        else:  # memory tiers are naturally empty after a restart
            for name in values:
                assert not mem.contains(name)
                assert mem.load(name, MISSING) is MISSING


def test_reopen_sees_no_corrupt_data_after_a_file_is_damaged_while_closed(opened: MemoryFactory) -> None:
    with opened("disk") as mem:
        skey = mem.store("a", kv(1))
        mem.store("b", kv(2))
        path = tier_named(mem, "disk").path(skey)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with opened("disk") as mem:
        assert mem.load("a", MISSING) is MISSING
        assert crc_failures(mem) == 1
        assert_kv_matches(kv(2), mem.load("b"), "none")


def test_stored_size_is_what_every_tier_holds(opened: MemoryFactory) -> None:
    mem = opened("cpu+disk")
    mem.store("x", kv(1))
    stored = mem.info("x").stored_size  # type: ignore[union-attr]
    assert stored > sum(t.numel() * t.element_size() for t in kv(1).values())
    assert [t.usage() for t in mem._tiers.tiers] == [footprint(t, stored) for t in mem._tiers.tiers]
    assert os.path.getsize(tier_named(mem, "disk").path(mem.storage_key("x"))) == stored  # type: ignore[attr-defined]
