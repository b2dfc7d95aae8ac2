"""The Redis tier on a real 3-master Redis Cluster (tests/redis_cluster.py): entries spread over the
masters, batches across slots, quarantine within a slot, prefix reuse across nodes, resharding (MOVED)
and a live slot migration (ASK).

Memories here have a small CPU tier and no disk tier, so whatever the CPU tier
does not hold is loaded from the cluster.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import redis
import torch
from redis.cluster import RedisCluster as ClusterClient

import kvmem
from kvmem import blob as blobfmt
from kvmem.errors import ConfigError
from kvmem.redaction import redact
from kvmem.stores import build_tiers
from kvmem.stores.redis import RedisTier
from tests.conftest import MemoryFactory
from tests.redis_cluster import RedisCluster
from tests.stores.blobs import blob_of
from tests.stores.redis_helpers import (
    over_remote,
    redis_tier,
    second_node_reuses_first_nodes_prefix,
    unique_prefix,
    with_options,
)

ENTRIES = 50


def key(i: int) -> str:
    return kvmem.content_hash(f"entry-{i}")


def value(i: int) -> torch.Tensor:
    return torch.full((8192,), float(i))  # 32 KiB: 50 of them overflow the 1 MiB CPU tier


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    made = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    yield made
    made.stop()


@pytest.fixture
def tier(cluster: RedisCluster, request: pytest.FixtureRequest) -> Iterator[RedisTier]:
    made = RedisTier.from_url(with_options(cluster.url, prefix=unique_prefix(request)))
    yield made
    made.close()


@pytest.fixture
def remote_memory(make_memory: MemoryFactory, cluster: RedisCluster, request: pytest.FixtureRequest) -> MemoryFactory:
    """``remote_memory(name="a", **settings)``: a Memory with a 1 MiB CPU tier, no disk, the cluster below."""
    return over_remote(make_memory, with_options(cluster.url, prefix=unique_prefix(request)))


def per_master(tier: RedisTier) -> dict[int, int]:
    """Port of each master -> how many of ``tier``'s entries it holds (a SCAN of that node alone)."""
    client = tier.client
    assert isinstance(client, ClusterClient)
    return {
        node.port: sum(1 for _ in client.scan_iter(match=tier._pattern, target_nodes=node))
        for node in client.get_primaries()
    }


# -- the tier alone --------------------------------------------------------------------------------
def test_cluster_url_builds_a_cluster_tier(cluster: RedisCluster, tier: RedisTier, tmp_path: Path) -> None:
    assert tier.cluster and isinstance(tier.client, ClusterClient)
    assert {n.port for n in tier.client.get_primaries()} == {s.port for s in cluster.servers}
    enc = blob_of(b"hello cluster" * 100)
    tier.put(key(0), enc)
    raw = enc.to_tensor().numpy().tobytes()
    assert tier.client.get(tier.prefix + "{" + key(0) + "}") == raw  # hash-tagged by the storage key
    got = tier.read_verified(key(0))
    assert got is not None and got.buf.numpy().tobytes() == raw
    assert list(tier.keys()) == [key(0)] and tier.contains(key(0))
    assert tier.read_range(key(0), 4, 12).numpy().tobytes() == raw[4:12]
    many = tier.get_many([key(i) for i in range(6)])
    assert many[0].numpy().tobytes() == raw and many[1:] == [None] * 5
    assert tier.usage() > 0 and tier.capacity > 0
    assert tier.delete(key(0)) and not tier.delete(key(0)) and list(tier.keys()) == []
    # the registry knows the schemes; a cluster has one database; braces would defeat the hash tag
    tiers = build_tiers(kvmem.Config(path=str(tmp_path), remote_url=cluster.url))
    assert isinstance(tiers[-1], RedisTier) and tiers[-1].cluster
    tiers[-1].close()
    with pytest.raises(ConfigError, match="only database 0"):
        RedisTier.from_url(cluster.url.rstrip("/") + "/3")
    with pytest.raises(ConfigError, match="may not hold"):
        RedisTier.from_url(with_options(cluster.url, prefix="{app}:"))
    assert redact("redis+cluster://u:pw@h1:1,h2:2/?prefix=x") == "redis+cluster://u:***@h1:1,h2:2/?prefix=x"


def test_unreachable_cluster_is_built_and_skipped(tmp_path: Path) -> None:
    tier = RedisTier.from_url("rediss+cluster://127.0.0.1:1,127.0.0.1:2/?ssl_cert_reqs=none&prefix=p:")
    assert tier.cluster and tier.prefix == "p:" and tier.capacity > 0
    with pytest.raises(kvmem.errors.TierUnavailable, match="127.0.0.1:1"):
        tier.contains(key(0))
    assert tier.usage() == 0
    tier.close()
    with kvmem.Memory(
        str(tmp_path / "m"),
        cpu_bytes="1MiB",
        disk_bytes=0,
        remote_url="redis+cluster://127.0.0.1:1/",
        tier_retry_seconds=60,
    ) as mem:
        mem.store("k", b"v")  # the local tier serves; the cluster is skipped
        assert mem.load("k") == b"v"


def test_contains_many_is_one_round_trip_per_master(tier: RedisTier, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(0, 60, 2):
        tier.put(key(i), blob_of(bytes([i]) * 10))
    probe = [key(i) for i in range(60)]
    assert len({tier.client.get_node_from_key(tier._key(k)).port for k in probe}) == 3  # keys on every master
    sends: list[object] = []
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self: object, *args: object, **kwargs: object) -> object:
        sends.append(self)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    found = tier.contains_many(probe)
    assert found == [i % 2 == 0 for i in range(60)]
    assert len(sends) == 3  # one pipelined request to each master, no CROSSSLOT
    sends.clear()
    got = tier.get_many(probe)
    assert [g is not None for g in got] == found and len(sends) == 3


def test_quarantine_stays_in_the_slot(tier: RedisTier) -> None:
    enc = blob_of(b"bad" * 30)
    for i in range(10):  # different slots, on different masters
        tier.put(key(i), enc)
        tier.quarantine(key(i))
    aside = [tier.prefix + "quarantine:{" + key(i) + "}" for i in range(10)]
    assert list(tier.keys()) == [] and tier.quarantined() == sorted(aside)
    for i, name in enumerate(aside):
        assert tier.client.keyslot(name) == tier.client.keyslot(tier._key(key(i)))
        assert 0 < tier.client.ttl(name) <= 7 * 24 * 3600
    assert tier.purge_quarantine() == 10 * enc.nbytes and tier.quarantined() == []
    tier.quarantine(key(11))  # nothing there: no error


def test_ttl_in_cluster_mode(cluster: RedisCluster, request: pytest.FixtureRequest) -> None:
    tier = RedisTier.from_url(with_options(cluster.url, prefix=unique_prefix(request), ttl=30))
    try:
        for i in range(6):
            tier.put(key(i), blob_of(b"x" * 10))
        assert all(0 < tier.client.ttl(tier._key(key(i))) <= 30 for i in range(6))
        assert all(g is not None for g in tier.get_many([key(i) for i in range(6)]))  # pipelined GETEX
    finally:
        tier.close()


# -- through Memory -------------------------------------------------------------------------------
def test_memory_over_the_cluster(remote_memory: MemoryFactory, cluster: RedisCluster) -> None:
    writer = remote_memory("w")
    assert [t.name for t in writer._tiers.tiers] == ["cpu", "redis"]
    skeys = [writer.store(f"entry-{i}", value(i)) for i in range(ENTRIES)]
    tier = redis_tier(writer)
    spread = per_master(tier)
    assert sum(spread.values()) == ENTRIES and min(spread.values()) > 0, spread  # every master holds some
    assert all(cluster.dbsize(s.port) >= spread[s.port] for s in cluster.servers)
    assert sorted(tier.keys()) == sorted(skeys)

    reader = remote_memory("r")  # another process's view: nothing local, all from the cluster, CRC-checked
    for i in range(ENTRIES):
        assert reader._tiers.get(skeys[i])[0].tier in ("redis", "cpu")
        assert torch.equal(reader.load(f"entry-{i}"), value(i))
    assert reader.metrics.total("kvmem_crc_failures_total") == 0
    names = [f"entry-{i}" for i in range(ENTRIES)] + ["missing-1", "missing-2"]
    assert remote_memory("c").contains_many(names) == [True] * ENTRIES + [False, False]

    assert reader.delete("entry-0") and not tier.contains(skeys[0])
    assert remote_memory("d").load("entry-0") is None

    # a value corrupted in the cluster: a miss, counted, moved aside within its slot, regenerated
    raw = bytearray(tier.client.get(tier._key(skeys[1])))
    header, start = blobfmt.parse(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    raw[start + header["payload_nbytes"] // 2] ^= 0xFF
    tier.client.set(tier._key(skeys[1]), bytes(raw))
    victim = remote_memory("v")
    assert victim.load("entry-1") is None
    assert victim.metrics.total("kvmem_crc_failures_total") == 1
    assert tier.quarantined() == [tier.prefix + "quarantine:{" + skeys[1] + "}"]
    assert torch.equal(victim.load("entry-1", regenerate=lambda: value(1)), value(1))
    tier.purge_quarantine()


def test_second_node_reuses_the_first_nodes_prefix(
    tmp_path: Path, cluster: RedisCluster, postgres_url: str, request: pytest.FixtureRequest, one_thread: None
) -> None:
    """Node A prefills a prompt; node B (own local disk, same cluster and catalog) reuses A's chunks exactly."""

    def spread(node_a: kvmem.Memory) -> None:
        assert sum(1 for n in per_master(redis_tier(node_a)).values() if n) >= 2  # chunks on several masters

    second_node_reuses_first_nodes_prefix(
        tmp_path, with_options(cluster.url, prefix=unique_prefix(request)), postgres_url, spread
    )


# -- resharding -------------------------------------------------------------------------------------
def test_loads_follow_moved_after_resharding(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Slots holding stored entries move to another master; a client with the old slot map still loads
    every entry (redis-py follows ``MOVED`` and refreshes its map), and new writes land on the new owner."""
    own = RedisCluster(tmp_path / "cluster")
    try:
        url = with_options(own.url, prefix=unique_prefix(request))
        with kvmem.Memory(str(tmp_path / "m"), cpu_bytes=0, disk_bytes=0, remote_url=url) as mem:
            skeys = [mem.store(f"entry-{i}", value(i)) for i in range(20)]
            tier = redis_tier(mem)
            client = tier.client
            assert isinstance(client, ClusterClient)
            slots = sorted({client.keyslot(tier._key(k)) for k in skeys})
            ports = [s.port for s in own.servers]
            moved_slots = {}
            for slot in slots[:8]:
                src = own.owner(slot)
                dst = ports[(ports.index(src) + 1) % len(ports)]
                assert own.move_slot(slot, dst) >= 1
                moved_slots[slot] = dst
            stale = {slot: client.nodes_manager.get_node_from_slot(slot).port for slot in moved_slots}
            assert all(stale[s] != moved_slots[s] for s in moved_slots)  # the client's map is out of date

            for i in range(20):  # every load goes to the cluster (no local tier); some get MOVED
                assert torch.equal(mem.load(f"entry-{i}"), value(i))
            assert mem.contains_many([f"entry-{i}" for i in range(20)]) == [True] * 20
            assert {s: client.nodes_manager.get_node_from_slot(s).port for s in moved_slots} == moved_slots
            assert mem.metrics.total("kvmem_tier_errors_total") == 0
            for skey in skeys:  # each value is where the cluster now says its slot lives
                owner = own.owner(client.keyslot(tier._key(skey)))
                with redis.Redis(port=owner) as direct:
                    assert direct.exists(tier._key(skey)) == 1
    finally:
        own.stop()


# -- a live slot migration (ASK) ------------------------------------------------------------------------
def names_in_one_slot(mem: kvmem.Memory, count: int) -> tuple[int, list[str]]:
    """A hash slot and ``count`` user keys whose Redis keys (hash-tagged storage keys) all fall in it."""
    tier = redis_tier(mem)
    found: defaultdict[int, list[str]] = defaultdict(list)
    for i in range(100_000):  # NOTE: deterministic names; 6 in one of 16384 slots takes ~10^4 tries
        name = f"ask-{i}"
        slot = tier.client.keyslot(tier._key(mem.storage_key(name)))
        found[slot].append(name)
        if len(found[slot]) == count:
            return slot, found[slot]
    raise AssertionError(f"no slot holds {count} of the names")


def reset_stats(own: RedisCluster) -> None:
    for server in own.servers:
        with own.client(server.port) as node:
            node.config_resetstat()


def redirects(own: RedisCluster, source: int, target: int) -> tuple[int, int]:
    """Since :func:`reset_stats`: (``ASK`` replies the source sent, ``ASKING`` commands the target took)."""
    with own.client(source) as src, own.client(target) as dst:
        asked = src.info("errorstats").get("errorstat_ASK", {}).get("count", 0)
        return asked, dst.info("commandstats").get("cmdstat_asking", {}).get("calls", 0)


def test_loads_and_stores_follow_ask_during_a_live_slot_migration(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A slot holding entries is half migrated (MIGRATING on its owner, IMPORTING on the target, some keys
    moved): its owner keeps it in every slot map and answers ``ASK`` for the keys it no longer holds. Loads,
    stores and batched probes (pipelines, one per node) are served from whichever node holds each key,
    CRC-checked, with no tier error; after the migration ends everything loads from the new owner."""
    own = RedisCluster(tmp_path / "cluster")
    try:
        url = with_options(own.url, prefix=unique_prefix(request))
        with (
            kvmem.Memory(str(tmp_path / "m"), cpu_bytes=0, disk_bytes=0, remote_url=url) as mem,
            closing(RedisTier.from_url(with_options(url, ttl=600))) as ttl_tier,
        ):
            tier = redis_tier(mem)
            client = tier.client
            assert isinstance(client, ClusterClient)
            slot, (moved, moved2, kept, kept2, new, absent) = names_in_one_slot(mem, 6)
            elsewhere = [f"entry-{i}" for i in range(12)]
            stored = {n: value(i) for i, n in enumerate([moved, moved2, kept, kept2, *elsewhere])}
            for name, v in stored.items():
                mem.store(name, v)
            rkey = {n: tier._key(mem.storage_key(n)) for n in (moved, moved2, kept, kept2, new, absent)}
            ports = [s.port for s in own.servers]
            assert {client.get_node_from_key(tier._key(mem.storage_key(n))).port for n in elsewhere} == set(ports)
            src = own.owner(slot)
            dst = ports[(ports.index(src) + 1) % len(ports)]

            assert own.begin_migration(slot, dst) == src
            assert own.migrate_keys(slot, dst, [rkey[moved], rkey[moved2]]) == 2
            assert own.keys_in_slot(slot, src) == {rkey[kept], rkey[kept2]}
            assert own.keys_in_slot(slot, dst) == {rkey[moved], rkey[moved2]}
            reset_stats(own)
            for name in (moved, kept, moved2, kept2):  # no local tier: every load is a GET on the cluster
                got = mem.fetch(name)
                assert got is not None and got.tier == "redis" and torch.equal(got.value, stored[name])
            assert redirects(own, src, dst) == (2, 2)  # the moved two, each ASKed once, then ASKING on the target
            assert client.nodes_manager.get_node_from_slot(slot).port == src  # ASK leaves the slot map as it was

            # writes: a new key is created on the target (the source ASKs for a key it lacks); an existing key is
            # rewritten on the node holding it
            stored[new], stored[kept], stored[moved] = value(40), value(41), value(42)
            for name in (new, kept, moved):
                mem.store(name, stored[name])
            assert own.keys_in_slot(slot, src) == {rkey[kept], rkey[kept2]}
            assert own.keys_in_slot(slot, dst) == {rkey[moved], rkey[moved2], rkey[new]}

            # batches across the migrating slot and the others: a pipeline per node, the keys the source lacks
            # retried one by one after ASK
            probe = [moved, kept, new, *elsewhere[:6], absent, moved2, kept2, *elsewhere[6:]]
            skeys = [mem.storage_key(n) for n in probe]
            reset_stats(own)
            assert mem.contains_many(probe) == [n != absent for n in probe]
            assert redirects(own, src, dst)[1] == 4  # moved, new, absent, moved2: each reached the target once
            for batch_tier in (tier, ttl_tier):  # pipelined GET, and pipelined GETEX (a write command)
                reset_stats(own)
                got = batch_tier.get_many(skeys)
                assert redirects(own, src, dst)[1] == 4
                for name, skey, raw in zip(probe, skeys, got):
                    if name == absent:
                        assert raw is None
                        continue
                    assert raw is not None
                    assert torch.equal(blobfmt.copy_verified(raw), tier.read_verified(skey).buf)  # type: ignore[union-attr]  # CRC-checked, whole

            # the migration ends: the slot and all its keys are on the target, every master says so
            assert own.finish_migration(slot, dst) == 2  # kept, kept2
            assert own.keys_in_slot(slot, src) == set()
            assert own.keys_in_slot(slot, dst) == {rkey[n] for n in (moved, moved2, kept, kept2, new)}
            reset_stats(own)
            for name, v in stored.items():
                assert torch.equal(mem.load(name), v)
            assert mem.contains_many(probe) == [n != absent for n in probe]
            assert ttl_tier.get_many(skeys)[probe.index(absent)] is None
            assert redirects(own, src, dst) == (0, 0)
            assert client.nodes_manager.get_node_from_slot(slot).port == dst  # learnt from MOVED
            assert mem.metrics.total("kvmem_tier_errors_total") == 0
            assert mem.metrics.total("kvmem_crc_failures_total") == 0
            with kvmem.Memory(str(tmp_path / "fresh"), cpu_bytes=0, disk_bytes=0, remote_url=url) as fresh:
                assert all(torch.equal(fresh.load(n), v) for n, v in stored.items())
    finally:
        own.stop()


def test_corrupt_entry_in_a_migrating_slot_costs_the_entry_not_the_tier(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Corrupt values in a half-migrated slot, on the source and on the target: each load is a miss, counted
    as a CRC failure, the value is taken out of service, and the tier stays up for every other key.

    NOTE: the quarantine ``RENAME`` names two keys; a slot in migration answers ``TRYAGAIN`` to a command whose
    keys are not all on one node, and the quarantine key never exists yet."""
    own = RedisCluster(tmp_path / "cluster")
    try:
        url = with_options(own.url, prefix=unique_prefix(request))
        with kvmem.Memory(str(tmp_path / "m"), cpu_bytes=0, disk_bytes=0, remote_url=url) as mem:
            tier = redis_tier(mem)
            slot, (on_target, on_source, healthy) = names_in_one_slot(mem, 3)
            for i, name in enumerate((on_target, on_source, healthy)):
                mem.store(name, value(i))
            ports = [s.port for s in own.servers]
            dst = ports[(ports.index(own.owner(slot)) + 1) % len(ports)]
            own.begin_migration(slot, dst)
            assert own.migrate_keys(slot, dst, [tier._key(mem.storage_key(on_target))]) == 1
            for name in (on_target, on_source):  # flip a payload byte, through the cluster client (ASK)
                rkey = tier._key(mem.storage_key(name))
                raw = bytearray(tier.client.get(rkey))
                raw[-10] ^= 0xFF
                tier.client.set(rkey, bytes(raw))

            for n, name in enumerate((on_target, on_source), 1):
                assert mem.load(name) is None
                assert mem.metrics.total("kvmem_crc_failures_total") == n
                assert not mem.contains(name)  # out of service: the next load does not meet it again
            got = mem.fetch(healthy)  # the tier was not skipped
            assert got is not None and got.tier == "redis" and torch.equal(got.value, value(2))
            assert mem.metrics.total("kvmem_tier_errors_total") == 0
            own.finish_migration(slot, dst)
            assert torch.equal(mem.load(on_target, regenerate=lambda: value(0)), value(0))
            assert torch.equal(mem.load(healthy), value(2))
            assert mem.metrics.total("kvmem_tier_errors_total") == 0
    finally:
        own.stop()
