"""The CPU tier on its host pool: page accounting, refusals, eviction, fragmentation, views that outlive entries.

Everything runs on real components: a real ``CpuTier`` (its pool is real memory), and
``Memory`` on a real directory for the paths that go through the tiered store.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem import blob as blobfmt
from kvmem.errors import CapacityError
from kvmem.stores import CpuTier
from tests.bounds import assert_bit_exact
from tests.stores.blobs import blob_of

MiB = 1 << 20


def key(i: int) -> str:
    return kvmem.content_hash(f"pool-entry-{i}")


def pages_of(tier: CpuTier, nbytes: int) -> int:
    """Bytes of the whole pages a blob of ``nbytes`` occupies in ``tier``."""
    page = tier.pool.page_bytes
    return -(-nbytes // page) * page


def blob_bytes(enc: blobfmt.EncodedBlob) -> bytes:
    return b"".join(p.tobytes() for p in enc.parts)


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Callable[..., kvmem.Memory]]:
    made: list[kvmem.Memory] = []

    def make(**settings: object) -> kvmem.Memory:
        mem = kvmem.Memory(str(tmp_path / "kvmem"), fsync="never", **settings)  # type: ignore[arg-type]
        made.append(mem)
        return mem

    yield make
    for mem in made:
        mem.close()


def cpu_tier(mem: kvmem.Memory) -> CpuTier:
    tier = next(t for t in mem._tiers.tiers if t.name == "cpu")
    assert isinstance(tier, CpuTier)
    return tier


# -- the tier alone ---------------------------------------------------------------------------------------
def test_usage_counts_whole_pages() -> None:
    tier = CpuTier(MiB)
    assert tier.pool.page_bytes == 1024  # the largest power of two giving a 1 MiB tier 1024 pages
    assert tier.pool.nbytes > MiB  # room beside the capacity, for views that outlive their entries
    small, odd = blob_of(b"s" * 10), blob_of(b"o" * 3000)
    tier.put(key(0), small)
    assert tier.usage() == 1024 and small.nbytes < 1024
    tier.put(key(1), odd)
    assert tier.usage() == 1024 + pages_of(tier, odd.nbytes) == 1024 + 4096  # 3000 B + head: 4 pages
    assert tier.pool.used_bytes == tier.usage()
    tier.put(key(0), odd)  # overwrite: counted once, in the new size
    assert tier.usage() == 2 * 4096
    tier.delete(key(1))
    assert tier.usage() == 4096
    gc.collect()
    assert tier.pool.used_bytes == 4096


def test_put_copies_into_the_pool_and_the_tier_lends_its_blob() -> None:
    tier = CpuTier(MiB)
    src = blob_of(bytes(range(256)) * 20)
    tier.put(key(0), src)
    entry = tier.lookup(key(0))
    assert entry is not None and entry.alloc.contiguous
    got = tier.get(key(0))
    assert got is not None and got.numpy().tobytes() == blob_bytes(src)
    base, end = tier.pool.buffer.data_ptr(), tier.pool.buffer.data_ptr() + tier.pool.nbytes
    assert base <= got.data_ptr() < end, "get() is a view of the pool pages"
    lent = tier.blob(key(0))
    assert lent is not None and lent.sealed and blob_bytes(lent) == blob_bytes(src)
    assert base <= lent.head.ctypes.data < end
    with tier.open_blob(key(0)) as reader:  # type: ignore[union-attr]
        assert reader.header["segments"] == lent.header["segments"]  # type: ignore[index]
        assert reader.head_bytes().tobytes() == blob_bytes(src)[: reader.start]
    assert tier.blob(key(1)) is None and tier.open_blob(key(1)) is None and tier.get(key(1)) is None


def test_put_larger_than_the_pool_is_a_capacity_error_and_changes_nothing() -> None:
    tier = CpuTier(MiB)
    tier.put(key(0), blob_of(b"kept" * 100))
    used = tier.usage()
    too_big = blob_of(bytes(tier.pool.nbytes))
    with pytest.raises(CapacityError, match="do not fit in the pool"):
        tier.put(key(1), too_big)
    gc.collect()
    assert list(tier.keys()) == [key(0)] and tier.usage() == used and tier.pool.used_bytes == used
    assert tier.get(key(0)) is not None


@pytest.mark.parametrize(("tokens", "threaded"), [(4, False), (256, True)])
def test_put_many_copies_large_values_on_the_copy_threads(
    monkeypatch: pytest.MonkeyPatch, tokens: int, threaded: bool
) -> None:
    """Values of 1 MiB and more (here strided slices of one KV tensor) are copied in several at a time on
    kvmem's copy threads; smaller ones one after another on the caller's thread. The bytes are the same."""
    kv = torch.randn(2, 4, 4 * tokens, 128)  # four chunks of 4 KiB per token: 16 KiB or 1 MiB each
    chunks = [kv[:, :, i * tokens : (i + 1) * tokens] for i in range(4)]
    assert not chunks[1].is_contiguous()
    tier = CpuTier(64 * MiB)
    copiers: list[str] = []
    copy_in = CpuTier._copy_in

    def spied(self: CpuTier, blob: blobfmt.EncodedBlob, k: str) -> object:
        copiers.append(threading.current_thread().name)
        return copy_in(self, blob, k)

    monkeypatch.setattr(CpuTier, "_copy_in", spied)
    blobs = [blobfmt.encode({"kind": "tensor"}, [c]) for c in chunks]
    tier.put_many([(key(i), b) for i, b in enumerate(blobs)])
    here = threading.current_thread().name
    assert len(copiers) == 4
    assert all(name.startswith("kvmem-copy") for name in copiers) if threaded else set(copiers) == {here}
    for i, b in enumerate(blobs):
        got = tier.get(key(i))
        assert got is not None and got.numpy().tobytes() == blob_bytes(b)


def test_put_many_that_does_not_fit_puts_none_of_it() -> None:
    tier = CpuTier(8 * MiB)
    tier.put(key(0), blob_of(b"kept" * 100))
    used = tier.usage()
    batch = [(key(i), blob_of(bytes([i]) * (3 * MiB))) for i in range(1, 5)]  # 12 MiB: over the pool
    with pytest.raises(CapacityError, match="do not fit in the pool"):
        tier.put_many(batch)
    gc.collect()
    assert list(tier.keys()) == [key(0)] and tier.usage() == used and tier.pool.used_bytes == used


def test_views_holding_the_pool_make_puts_refuse_until_they_go() -> None:
    tier = CpuTier(MiB)
    big = blob_of(b"B" * (400 * 1024))
    views = []
    for i in range(64):  # entries deleted at once, their views kept: until the pool has no room for `big`
        tier.put(key(i), blob_of(bytes([i]) * (120 * 1024)))
        views.append(tier.get(key(i)))
        tier.delete(key(i))
        if tier.pool.free_bytes < big.nbytes:
            break
    assert list(tier.keys()) == [] and tier.usage() == tier.pool.used_bytes > 0  # held by views alone
    assert tier.pool.free_bytes < big.nbytes
    with pytest.raises(CapacityError):
        tier.put(key(99), big)
    assert list(tier.keys()) == []
    views.clear()
    gc.collect()
    assert tier.pool.used_bytes == 0
    tier.put(key(99), big)
    got = tier.get(key(99))
    assert got is not None and got.numpy().tobytes() == blob_bytes(big)


def test_a_view_outliving_delete_and_later_puts_keeps_its_bytes() -> None:
    tier = CpuTier(MiB)
    old = blob_of(b"old bytes " * 3000)
    tier.put(key(0), old)
    view = tier.get(key(0))
    assert view is not None
    snapshot = view.clone()
    lo, hi = view.data_ptr(), view.data_ptr() + view.numel()
    assert tier.delete(key(0))
    gc.collect()
    held = tier.pool.used_bytes
    assert held == tier.usage() == pages_of(tier, old.nbytes), "the deleted entry's pages are held by the view"
    # fill the tier up to its capacity: every put succeeds (the pool keeps room beside the held pages)
    fresh = [blob_of(bytes([i % 251 + 1]) * (60 * 1024)) for i in range(16)]
    for i, enc in enumerate(fresh, 1):
        tier.put(key(i), enc)
    assert tier.usage() == 16 * pages_of(tier, fresh[0].nbytes) + held  # the pool's usage: the view's pages too
    assert torch.equal(view, snapshot), "bytes handed out changed after their entry was deleted"
    for i, enc in enumerate(fresh, 1):
        entry = tier.lookup(key(i))
        assert entry is not None
        for p in entry.alloc.pieces():
            assert p.data_ptr() + p.numel() <= lo or p.data_ptr() >= hi, "a new entry got pages a view still shows"
        got = tier.get(key(i))
        assert got is not None and got.numpy().tobytes() == blob_bytes(enc)
    del view
    gc.collect()
    assert tier.usage() == 16 * pages_of(tier, fresh[0].nbytes)


def test_overwrite_keeps_the_old_version_for_its_view() -> None:
    tier = CpuTier(MiB)
    tier.put(key(0), blob_of(b"v1" * 500))
    first = tier.get(key(0))
    assert first is not None
    snapshot = first.clone()
    for n in range(20):
        tier.put(key(0), blob_of(bytes([n]) * 1000))
    assert torch.equal(first, snapshot)
    held = pages_of(tier, blob_of(b"v1" * 500).nbytes)  # the first version's pages, held by its view
    assert tier.usage() == pages_of(tier, blob_of(bytes(1000)).nbytes) + held
    del first
    gc.collect()
    assert tier.usage() == pages_of(tier, blob_of(bytes(1000)).nbytes)


# -- through Memory -----------------------------------------------------------------------------------------
def test_value_larger_than_the_cpu_tier_goes_to_disk(opened: Callable[..., kvmem.Memory]) -> None:
    mem = opened(cpu_bytes=256 * 1024, disk_bytes=8 * MiB)
    big = torch.randn(128 * 1024)  # 512 KiB: more than the CPU tier and its pool
    assert big.numel() * 4 > cpu_tier(mem).pool.nbytes
    skey = mem.store("big", big)
    assert [t.name for t in mem._tiers.tiers if t.contains(skey)] == ["disk"]
    assert cpu_tier(mem).usage() == 0
    loaded = mem.fetch("big")
    assert loaded is not None and loaded.tier == "disk"
    assert_bit_exact(big, loaded.value)
    info = mem.info("big")
    assert info is not None and info.tiers == ["disk"] and info.version == 1


def test_a_store_many_larger_than_the_cpu_tier_keeps_its_newest_values_there(
    opened: Callable[..., kvmem.Memory],
) -> None:
    """A batch over the CPU tier's capacity goes in one value at a time: the tier keeps the batch's newest
    values (and an older entry only if room is left), every value is on disk, none is lost."""
    mem = opened(cpu_bytes=4 * MiB, disk_bytes=64 * MiB)
    mem.store("older", torch.zeros(1024))
    values = {f"v{i}": torch.full((256 * 1024,), float(i)) for i in range(8)}  # 1 MiB each, 8 MiB in all
    skeys = mem.store_many(values)
    cpu = cpu_tier(mem)
    held = [k for k, s in zip(values, skeys) if cpu.contains(s)]
    assert held and held == list(values)[-len(held) :] and cpu.usage() <= 4 * MiB
    for k, v in values.items():
        assert_bit_exact(v, mem.load(k))
    assert_bit_exact(torch.zeros(1024), mem.load("older"))


def test_value_larger_than_a_lone_cpu_tier_is_refused(opened: Callable[..., kvmem.Memory]) -> None:
    mem = opened(cpu_bytes=256 * 1024, disk_bytes=0)
    mem.store("small", torch.ones(16))
    with pytest.raises(CapacityError):
        mem.store("big", torch.randn(128 * 1024))
    assert not mem.contains("big")
    assert torch.equal(mem.load("small"), torch.ones(16))
    assert mem.stats().evictions == 0


def test_a_full_cpu_tier_evicts_least_recently_used(opened: Callable[..., kvmem.Memory]) -> None:
    mem = opened(cpu_bytes=256 * 1024, disk_bytes=0)
    tier = cpu_tier(mem)

    def value(i: int) -> torch.Tensor:
        return torch.arange(i * 10_000, i * 10_000 + 3000 + 100 * (i % 5), dtype=torch.int32)

    order: list[int] = []  # LRU order of the entries held, least recent first
    evicted: list[int] = []
    for i in range(40):
        mem.store(f"k{i}", value(i))
        order.append(i)
        present = [mem.contains(f"k{j}") for j in order]
        gone = present.index(True)
        assert present == [False] * gone + [True] * (len(order) - gone), (
            f"after storing k{i}: evicted {[j for j, p in zip(order, present) if not p]}, LRU order {order}"
        )
        evicted += order[:gone]
        order = order[gone:]
        if i % 7 == 3:  # a read makes an older entry the most recent
            j = order[len(order) // 2]
            assert_bit_exact(value(j), mem.load(f"k{j}"))
            order.remove(j)
            order.append(j)
        assert tier.usage() <= tier.capacity
    assert 5 < len(order) < 30 and len(evicted) == 40 - len(order)
    for i in order:
        assert_bit_exact(value(i), mem.load(f"k{i}"))
    for i in evicted:
        assert mem.load(f"k{i}") is None
    stats = mem.stats()
    assert stats.evictions == len(evicted)
    assert stats.entries == len(order)
    assert tier.usage() == sum(pages_of(tier, mem.info(f"k{i}").stored_size) for i in order)  # type: ignore[union-attr]


@pytest.mark.parametrize("cpu_verify", [False, True])
def test_fragmented_pool_stores_a_value_in_several_runs(opened: Callable[..., kvmem.Memory], cpu_verify: bool) -> None:
    mem = opened(cpu_bytes=MiB, disk_bytes=0, cpu_verify=cpu_verify)
    tier = cpu_tier(mem)
    page = tier.pool.page_bytes
    for i in range(24):  # mixed sizes, laid out in order, to 0.96 of the capacity
        mem.store(f"e{i}", torch.full(((6, 10, 14)[i % 3] * 1024,), float(i)))
    for i in range(1, 24, 2):
        assert mem.delete(f"e{i}")
    gc.collect()
    runs = tier.pool.free_runs()
    big = torch.arange(75 * 1024, dtype=torch.float32) * 0.5  # 300 KiB
    need = -(-(big.numel() * 4 + 1024) // page)
    assert max(n for _s, n in runs) < need < sum(n for _s, n in runs), "the setup did not fragment the pool"
    skey = mem.store("big", big)
    entry = tier.lookup(skey)
    assert entry is not None and len(entry.alloc.runs) > 1, "expected an allocation of several runs"
    assert mem.stats().evictions == 0
    assert_bit_exact(big, mem.load("big"))
    dst = torch.full((3, big.numel()), -1.0)
    row = dst[1]
    assert mem.load("big", out=row) is row
    assert_bit_exact(big, dst[1])
    assert bool((dst[0] == -1.0).all()) and bool((dst[2] == -1.0).all())
    strided = torch.full((big.numel(), 2), -1.0)
    mem.load("big", out=strided[:, 0])
    assert_bit_exact(big, strided[:, 0].contiguous())
    assert bool((strided[:, 1] == -1.0).all())
    for i in range(0, 24, 2):  # the entries around the holes are untouched
        assert_bit_exact(torch.full(((6, 10, 14)[i % 3] * 1024,), float(i)), mem.load(f"e{i}"))
    assert mem.stats().crc_failures == 0


def test_concurrent_stores_of_small_values_are_never_refused(opened: Callable[..., kvmem.Memory]) -> None:
    """Four threads store 64 KiB values into a 1 MiB CPU-only memory: the LRU makes room for each one.

    ``store`` raises CapacityError only for a value larger than every tier; here each one is a
    sixteenth of the tier, so every store must succeed, whatever the other threads put meanwhile.
    """
    mem = opened(cpu_bytes=MiB, disk_bytes=0)
    threads, per_thread = 4, 150
    errors: list[BaseException] = []
    last: dict[str, torch.Tensor] = {}

    def value(t: int, i: int) -> torch.Tensor:
        return torch.full((16 * 1024,), float(t * 1000 + i))

    def work(t: int) -> None:
        for i in range(per_thread):
            k = f"t{t}-{i % 5}"
            try:
                mem.store(k, value(t, i))
            except BaseException as exc:  # reported below, with how many there were
                errors.append(exc)
            else:
                last[k] = value(t, i)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == [], f"{len(errors)} of {threads * per_thread} stores failed, the first: {errors[0]!r}"
    held = 0
    for k, v in last.items():
        got = mem.load(k)
        if got is not None:
            assert_bit_exact(v, got)
            held += 1
    assert held >= 1 and cpu_tier(mem).usage() <= MiB


def test_a_full_tier_keeps_evicting_in_lru_order_past_the_first_keys_it_reads(
    opened: Callable[..., kvmem.Memory],
) -> None:
    """Making room reads keys lazily, the oldest first (see ``lru_keys``); with hundreds of entries and reads
    moving some to the back, what goes is still the least recently used."""
    mem = opened(cpu_bytes=1 * MiB, disk_bytes=0)
    value = torch.zeros(1000, dtype=torch.int32)  # 4 KiB + header: two pages
    order: list[int] = []  # the entries held, least recent first
    evicted = 0
    for i in range(600):
        mem.store(f"k{i}", value)
        order.append(i)
        present = [mem.contains(f"k{j}") for j in order]
        gone = present.index(True)
        assert present == [False] * gone + [True] * (len(order) - gone), f"not LRU after storing k{i}"
        evicted += gone
        order = order[gone:]
        if i % 5 == 0:  # a read makes an older entry the most recent
            j = order[len(order) // 3]
            assert mem.load(f"k{j}") is not None
            order.remove(j)
            order.append(j)
    assert len(order) > 64 and evicted > 64  # past the oldest keys read in one step


def test_lru_keys_copies_only_the_oldest_keys_for_a_reader_that_stops_early() -> None:
    from kvmem.stores.base import lru_keys

    class Counted(dict[str, int]):
        read = 0

        def __iter__(self) -> Iterator[str]:
            for k in super().__iter__():
                Counted.read += 1
                yield k

    entries = Counted((f"k{i}", i) for i in range(10_000))
    lock = threading.Lock()
    keys = lru_keys(entries, lock)
    assert [next(keys), next(keys)] == ["k0", "k1"]
    assert Counted.read <= 64  # not a copy of 10,000 keys for a put that evicts one or two
    del entries["k5"]  # evicted meanwhile: still in the snapshot of the oldest, as from any snapshot
    entries["k7"] = entries.pop("k7")  # read meanwhile (moved to the back): yielded once
    entries["k100"] = entries.pop("k100")
    seen = ["k0", "k1", *keys]
    assert seen[:8] == [f"k{i}" for i in range(8)] and seen[-1] == "k100"
    assert len(seen) == len(set(seen)) == 10_000


def test_an_entry_leaves_few_objects_for_the_garbage_collector(opened: Callable[..., kvmem.Memory]) -> None:
    """Each object a stored entry keeps is scanned by every full collection (~0.5 us each on this VM, with
    torch's ~200,000 objects around): a stream of stores pays for them (it was 17 per entry, then 9 once
    flushed; 6 since the sealed segment table is a tuple of int tuples and blobs share one sealing lock)."""
    mem = opened(cpu_bytes=64 * MiB, disk_bytes=0)
    values = [torch.full((16384,), float(i)) for i in range(300)]
    for i, v in enumerate(values[:100]):
        mem.store(f"warm{i}", v)
    mem.flush()
    gc.collect()
    before = len(gc.get_objects())
    for i, v in enumerate(values[100:]):
        mem.store(f"k{i}", v)
    mem.flush()
    gc.collect()
    per_entry = (len(gc.get_objects()) - before) / 200
    # 6 alone; up to ~7.1 inside the whole suite, where other threads leave objects of their own meanwhile
    assert per_entry <= 8, f"{per_entry:.1f} tracked objects per CPU-tier entry"


def test_a_large_plain_load_lands_in_the_pools_faulted_pages_and_gives_them_back(
    opened: Callable[..., kvmem.Memory],
) -> None:
    """A plain ``load`` of a large tensor is copied into free pages of the pool (faulted in already), which count
    in the tier's usage while the caller holds the tensor; writing to it never changes the stored value; with no
    free run left the load still succeeds, into a new buffer."""
    mem = opened(cpu_bytes=8 * MiB, disk_bytes=0)
    tier = cpu_tier(mem)
    value = torch.randn(MiB // 2)  # 2 MiB
    mem.store("big", value)
    stored = tier.usage()

    loaded = mem.load("big")
    assert_bit_exact(value, loaded)
    assert tier.usage() == stored + pages_of(tier, 2 * MiB)  # the pool's pages, not a new buffer
    loaded += 1.0  # the caller's own tensor: the stored value stays as it was
    assert_bit_exact(value, mem.load("big"))
    del loaded
    gc.collect()
    assert tier.usage() == stored

    held = [mem.load("big") for _ in range(8)]  # more than the free pages: the rest get new buffers
    assert tier.usage() <= tier.pool.nbytes
    for got in held:
        assert_bit_exact(value, got)
