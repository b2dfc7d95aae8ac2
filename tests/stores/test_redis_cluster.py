"""The Redis tier on a real 3-master Redis Cluster (tests/redis_cluster.py): entries spread over the
masters, batches across slots, quarantine within a slot, prefix reuse across nodes, and resharding.

Memories here have a small CPU tier and no disk tier, so whatever the CPU tier
does not hold is loaded from the cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from redis.cluster import RedisCluster as ClusterClient

import kvmem
from kvmem import blob as blobfmt
from kvmem.errors import ConfigError
from kvmem.stores import build_tiers
from kvmem.stores.redis import RedisTier, redact
from tests.redis_cluster import RedisCluster
from tests.stores.redis_helpers import (
    open_memories,
    redis_tier,
    second_node_reuses_first_nodes_prefix,
    unique_prefix,
    with_options,
)

MemoryFactory = Callable[..., kvmem.Memory]
ENTRIES = 50


def blob_of(payload: bytes) -> blobfmt.EncodedBlob:
    return blobfmt.encode({"kind": "test"}, [np.frombuffer(payload, dtype=np.uint8)])


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
def open_memory(tmp_path: Path, cluster: RedisCluster, request: pytest.FixtureRequest) -> Iterator[MemoryFactory]:
    """``open_memory(name="a", **settings)``: a Memory with a 1 MiB CPU tier, no disk, the cluster below."""
    yield from open_memories(tmp_path, with_options(cluster.url, prefix=unique_prefix(request)))




def per_master(tier: RedisTier) -> dict[int, int]:
    """Port of each master -> how many of ``tier``'s entries it holds (a SCAN of that node alone)."""
    client = tier.client
    assert isinstance(client, ClusterClient)
    return {node.port: sum(1 for _ in client.scan_iter(match=tier._pattern, target_nodes=node))
            for node in client.get_primaries()}


# -- the tier alone --------------------------------------------------------------------------------
def test_cluster_url_builds_a_cluster_tier(cluster: RedisCluster, tier: RedisTier, tmp_path: Path) -> None:
    assert tier.cluster and isinstance(tier.client, ClusterClient)
    assert {n.port for n in tier.client.get_primaries()} == {s.port for s in cluster.servers}
    enc = blob_of(b"hello cluster" * 100)
    tier.put(key(0), enc)
    raw = enc.to_tensor().numpy().tobytes()
    assert tier.client.get(tier.prefix + "{" + key(0) + "}") == raw  # hash-tagged by the storage key
    got = tier.get_verified(key(0))
    assert got is not None and got.numpy().tobytes() == raw
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
    with kvmem.Memory(str(tmp_path / "m"), cpu_bytes="1MiB", disk_bytes=0,
                      remote_url="redis+cluster://127.0.0.1:1/", tier_retry_seconds=60) as mem:
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
def test_memory_over_the_cluster(open_memory: MemoryFactory, cluster: RedisCluster) -> None:
    writer = open_memory("w")
    assert [t.name for t in writer.tiers.tiers] == ["cpu", "redis"]
    skeys = [writer.store(f"entry-{i}", value(i)) for i in range(ENTRIES)]
    tier = redis_tier(writer)
    spread = per_master(tier)
    assert sum(spread.values()) == ENTRIES and min(spread.values()) > 0, spread  # every master holds some
    assert all(cluster.dbsize(s.port) >= spread[s.port] for s in cluster.servers)
    assert sorted(tier.keys()) == sorted(skeys)

    reader = open_memory("r")  # another process's view: nothing local, all from the cluster, CRC-checked
    for i in range(ENTRIES):
        assert reader.tiers.get(skeys[i])[0].tier in ("redis", "cpu")
        assert torch.equal(reader.load(f"entry-{i}"), value(i))
    assert reader.metrics.total("kvmem_crc_failures_total") == 0
    names = [f"entry-{i}" for i in range(ENTRIES)] + ["missing-1", "missing-2"]
    assert open_memory("c").contains_many(names) == [True] * ENTRIES + [False, False]

    assert reader.delete("entry-0") and not tier.contains(skeys[0])
    assert open_memory("d").load("entry-0") is None

    # a value corrupted in the cluster: a miss, counted, moved aside within its slot, regenerated
    raw = bytearray(tier.client.get(tier._key(skeys[1])))
    header, start = blobfmt.parse(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    raw[start + header["payload_nbytes"] // 2] ^= 0xFF
    tier.client.set(tier._key(skeys[1]), bytes(raw))
    victim = open_memory("v")
    assert victim.load("entry-1") is None
    assert victim.metrics.total("kvmem_crc_failures_total") == 1
    assert tier.quarantined() == [tier.prefix + "quarantine:{" + skeys[1] + "}"]
    assert torch.equal(victim.load("entry-1", regenerate=lambda: value(1)), value(1))
    tier.purge_quarantine()


def test_second_node_reuses_the_first_nodes_prefix(tmp_path: Path, cluster: RedisCluster, postgres_url: str,
                                                   request: pytest.FixtureRequest, one_thread: None) -> None:
    """Node A prefills a prompt; node B (own local disk, same cluster and catalog) reuses A's chunks exactly."""
    def spread(node_a: kvmem.Memory) -> None:
        assert sum(1 for n in per_master(redis_tier(node_a)).values() if n) >= 2  # chunks on several masters

    second_node_reuses_first_nodes_prefix(tmp_path, with_options(cluster.url, prefix=unique_prefix(request)),
                                          postgres_url, spread)


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
