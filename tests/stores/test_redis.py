"""The Redis remote tier on a real redis-server (see tests/servers.py): round trip, CRC, batching,
TTL, prefix, size limit, faults, a password in the URL, and cross-node KV reuse (ACL users, TLS, tenants and
values that are not blobs: test_redis_security.py).

Memories here have a small CPU tier and no disk tier, so whatever the CPU tier
does not hold is loaded from Redis.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

import kvmem
from kvmem import blob as blobfmt
from kvmem.errors import CapacityError, ConfigError, IntegrityError
from kvmem.redaction import redact
from kvmem.stores import Capabilities, StorageTier, build_tiers
from kvmem.stores.redis import RedisTier
from tests.conftest import MemoryFactory
from tests.servers import RedisServer
from tests.stores.blobs import blob_of
from tests.stores.redis_helpers import (
    over_remote,
    redis_tier,
    second_node_reuses_first_nodes_prefix,
    unique_prefix,
    with_options,
)


def key(i: int) -> str:
    return kvmem.content_hash(f"entry-{i}")


@pytest.fixture
def tier(redis_url: str, request: pytest.FixtureRequest) -> Iterator[RedisTier]:
    made = RedisTier.from_url(with_options(redis_url, prefix=unique_prefix(request)))
    yield made
    made.client.delete(*made.client.keys(made.prefix + "*") or ["-"])
    made.close()


@pytest.fixture
def remote_memory(make_memory: MemoryFactory, redis_url: str, request: pytest.FixtureRequest) -> MemoryFactory:
    """``remote_memory(name="a", url=None, **settings)``: a Memory with a 1 MiB CPU tier, no disk, Redis below."""
    return over_remote(make_memory, with_options(redis_url, prefix=unique_prefix(request)))


def commands(client: redis.Redis) -> int:
    return int(client.info("stats")["total_commands_processed"])


# -- the tier alone --------------------------------------------------------------------------------
def test_tier_contract(tier: RedisTier) -> None:
    assert isinstance(tier, StorageTier) and tier.persistent
    caps = Capabilities.of(tier)
    assert caps.self_evicting and caps.verified_reads is tier and not caps.trusted
    enc = blob_of(b"hello redis" * 100)
    assert tier.get(key(0)) is None and not tier.contains(key(0))
    tier.put(key(0), enc)
    verified = tier.read_verified(key(0))
    assert verified is not None
    got = verified.buf
    assert got.numpy().tobytes() == enc.to_tensor().numpy().tobytes()
    got[0] ^= 0xFF  # the caller owns (and may write) the buffer
    assert tier.client.get(tier.prefix + key(0)) == enc.to_tensor().numpy().tobytes()
    assert list(tier.keys()) == [key(0)]
    assert tier.read_range(key(0), 4, 12) is not None
    assert tier.read_range(key(0), 4, 12).numpy().tobytes() == enc.to_tensor().numpy().tobytes()[4:12]
    assert tier.read_range(key(1), 0, 8) is None
    many = tier.get_many([key(0), key(1)])
    assert many[1] is None and torch.equal(many[0], tier.get(key(0)))
    assert tier.delete(key(0)) is True and tier.delete(key(0)) is False
    assert tier.usage() > 0 and tier.capacity > 0
    with pytest.raises(ValueError, match="storage key"):
        tier.get("../etc/passwd")


def test_contains_many_is_one_round_trip(tier: RedisTier) -> None:
    for i in range(0, 40, 2):
        tier.put(key(i), blob_of(bytes([i]) * 10))
    probe = [key(i) for i in range(40)]
    before = commands(tier.client)
    found = tier.contains_many(probe)
    sent = commands(tier.client) - before - 1  # the INFO call itself counts once
    assert found == [i % 2 == 0 for i in range(40)]
    # NOTE: one pipelined request carrying 40 EXISTS: the server counts the commands, not the round trips
    assert sent == 40
    calls: list[int] = []
    real = tier.client.connection_pool.get_connection

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    tier.client.connection_pool.get_connection = counting  # type: ignore[method-assign]
    try:
        tier.contains_many(probe)
    finally:
        tier.client.connection_pool.get_connection = real  # type: ignore[method-assign]
    assert len(calls) == 1


def test_put_sends_large_parts_from_where_they_lie(
    redis_url: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blob's large parts go to the socket as views of the codec's arrays (no joined copy), its small ones
    inside the command's framing; Redis holds exactly the blob's bytes, and the TTL after it still applies."""
    tier = RedisTier.from_url(with_options(redis_url, prefix=unique_prefix(request), ttl=60))
    segments = [
        np.full(100_000, 7, dtype=np.uint8),
        np.arange(1000, dtype=np.uint8),
        np.full(200_000, 9, dtype=np.uint8),
    ]
    enc = blobfmt.encode({"kind": "test"}, segments)
    sent: list[object] = []
    real = redis.connection.AbstractConnection.send_packed_command

    def recording(self: object, command: list[object], *args: object, **kwargs: object) -> object:
        sent.extend(command)
        return real(self, command, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", recording)
    try:
        tier.put(key(0), enc)
        views = [item for item in sent if isinstance(item, memoryview)]
        big = [p for p in enc.parts if p.size >= 64 * 1024]
        assert [np.asarray(v.obj).ctypes.data for v in views] == [p.ctypes.data for p in big]  # the arrays themselves
        assert sum(len(item) for item in sent) < enc.nbytes + 1000  # nothing sent twice
        assert tier.client.get(tier._key(key(0))) == enc.to_tensor().numpy().tobytes()
        assert 0 < tier.client.ttl(tier._key(key(0))) <= 60
        assert tier.read_verified(key(0)) is not None
    finally:
        tier.client.delete(tier._key(key(0)))
        tier.close()


def test_quarantine_moves_the_value_aside(tier: RedisTier) -> None:
    enc = blob_of(b"bad" * 30)
    tier.put(key(0), enc)
    tier.quarantine(key(0))
    assert not tier.contains(key(0)) and list(tier.keys()) == []
    assert tier.quarantined() == [tier.prefix + "quarantine:" + key(0)]
    assert 0 < tier.client.ttl(tier.quarantined()[0]) <= 7 * 24 * 3600
    assert tier.purge_quarantine() == enc.nbytes and tier.quarantined() == []
    tier.quarantine(key(1))  # nothing there: no error


def test_ttl_expires_entries_and_reads_extend_them(redis_url: str, request: pytest.FixtureRequest) -> None:
    tier = RedisTier.from_url(with_options(redis_url, prefix=unique_prefix(request), ttl=1))
    try:
        tier.put(key(0), blob_of(b"short-lived"))
        assert 0 < tier.client.pttl(tier.prefix + key(0)) <= 1000
        time.sleep(0.6)
        assert tier.read_verified(key(0)) is not None  # a read restarts the clock
        time.sleep(0.6)
        assert tier.contains(key(0))
        time.sleep(1.2)
        assert tier.get(key(0)) is None and not tier.contains(key(0))
    finally:
        tier.close()


def test_size_limit_is_a_clear_error(redis_url: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    tier = RedisTier.from_url(with_options(redis_url, prefix=unique_prefix(request), max_value="1KiB"))
    with pytest.raises(CapacityError, match=r"2\d\d\d bytes .* \(1024 bytes; Redis's own limit is 536870912\)"):
        tier.put(key(0), blob_of(b"x" * 2000))
    tier.close()
    url = with_options(redis_url, prefix=unique_prefix(request), max_value="1KiB")
    # remote only: the caller gets the error; with a local tier: stored there, Redis skipped (and still up)
    with (
        kvmem.Memory(str(tmp_path / "r"), cpu_bytes=0, disk_bytes=0, remote_url=url) as only,
        pytest.raises(CapacityError, match="1024 bytes"),
    ):
        only.store("big", b"x" * 2000)
    with kvmem.Memory(str(tmp_path / "l"), cpu_bytes="1MiB", disk_bytes=0, remote_url=url) as both:
        both.store("big", b"x" * 2000)
        both.store("small", b"y")
        assert redis_tier(both).contains(both.storage_key("small")) and both.load("big") == b"x" * 2000
        assert both.metrics.total("kvmem_tier_errors_total") == 0
    with pytest.raises(ConfigError, match="max_value"):
        RedisTier.from_url(with_options(redis_url, max_value="1GiB"))
    with pytest.raises(ConfigError, match="ttl"):
        RedisTier.from_url(with_options(redis_url, ttl=0))


# -- through Memory -------------------------------------------------------------------------------
def test_round_trip_through_memory_loads_from_redis(remote_memory: MemoryFactory) -> None:
    mem = remote_memory()
    assert [t.name for t in mem._tiers.tiers] == ["cpu", "redis"]
    big = {"k": torch.randn(4, 64, 1024), "v": torch.randn(4, 64, 1024)}  # 2 MiB: larger than the CPU tier
    mem.store("kv", big)
    mem.store("bytes", b"\x00payload\xff" * 1000)
    assert mem._tiers.get(mem.storage_key("kv"))[0].tier == "redis"
    got = mem.load("kv")
    assert torch.equal(got["k"], big["k"]) and torch.equal(got["v"], big["v"])
    other = remote_memory("b")  # another process's view: nothing local, all from Redis
    assert other._tiers.get(other.storage_key("bytes"))[0].tier == "redis"  # (and promoted to cpu)
    assert other.load("bytes") == b"\x00payload\xff" * 1000


def test_corruption_in_redis_is_a_miss_and_regenerates(remote_memory: MemoryFactory) -> None:
    writer = remote_memory("w")
    value = torch.arange(4096, dtype=torch.float32)
    skey = writer.store("x", value)
    tier = redis_tier(writer)
    raw = bytearray(tier.client.get(tier.prefix + skey))
    header, start = blobfmt.parse(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    raw[start + header["payload_nbytes"] // 2] ^= 0xFF
    tier.client.set(tier.prefix + skey, bytes(raw))

    reader = remote_memory("r")
    assert reader.load("x") is None
    assert reader.metrics.total("kvmem_crc_failures_total") == 1
    assert tier.quarantined() == [tier.prefix + "quarantine:" + skey]
    assert torch.equal(reader.load("x", regenerate=lambda: value), value)
    strict = remote_memory("s", strict=True)
    tier.client.set(tier.prefix + skey, bytes(raw))
    with pytest.raises(IntegrityError):
        strict.load("x")


def test_prefix_keeps_deployments_apart(remote_memory: MemoryFactory, redis_url: str) -> None:
    """(Tenants within one deployment: test_redis_security.py.)"""
    a = remote_memory("a", url=with_options(redis_url, prefix="deploy-a:"))
    b = remote_memory("b", url=with_options(redis_url, prefix="deploy-b:"))
    a.store("same-key", b"from a")
    assert b.load("same-key") is None and not b.contains("same-key")
    for mem in (a, b):
        tier = redis_tier(mem)
        tier.client.delete(*[tier.prefix + k for k in list(tier.keys())] or ["-"])


def test_redis_stopped_mid_run_degrades_to_local_tiers_and_comes_back(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    mem = kvmem.Memory(
        str(tmp_path / "m"),
        cpu_bytes="8MiB",
        disk_bytes="8MiB",
        fsync="never",
        remote_url=redis_server.url,
        tier_retry_seconds=0.2,
    )
    try:
        mem.store("before", b"b" * 100)
        redis_server.stop()
        t0 = time.monotonic()
        for i in range(20):  # every call still returns, served by the local tiers
            mem.store(f"during-{i}", torch.full((256,), float(i)))
            assert torch.equal(mem.load(f"during-{i}"), torch.full((256,), float(i)))
        assert mem.load("before") == b"b" * 100
        assert mem.contains_many(["before", "nothing"]) == [True, False]
        assert time.monotonic() - t0 < 10
        errors = mem.metrics.registry.get_sample_value("kvmem_tier_errors_total", {"tier": "redis"})
        assert errors is not None and errors >= 1
        assert not mem._tiers.healthy(redis_tier(mem))
        info = mem.info("before")  # stats and info answer from what still works, never raise
        assert info is not None and "redis" not in info.tiers
        assert [t.healthy for t in mem.stats().tiers if t.name == "redis"] == [False]

        redis_server.start()  # reconnects by itself once the retry delay has passed
        time.sleep(0.3)
        mem.store("after", b"a" * 100)
        assert redis_tier(mem).contains(mem.storage_key("after"))
        assert mem._tiers.healthy(redis_tier(mem))
    finally:
        mem.close()


def test_password_in_url(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "auth", "--requirepass", "s3cret")
    try:
        with kvmem.Memory(
            str(tmp_path / "ok"),
            cpu_bytes=0,
            disk_bytes=0,
            remote_url=server.url.replace("redis://", "redis://:s3cret@"),
        ) as mem:
            mem.store("k", b"v")
            assert mem.load("k") == b"v" and mem._tiers.get(mem.storage_key("k"))[0].tier == "redis"
        for url in (server.url, server.url.replace("redis://", "redis://:wrong@")):
            with pytest.raises(ConfigError, match="remote_url") as info:
                build_tiers(kvmem.Config(path=str(tmp_path / "bad"), remote_url=url))
            assert "wrong" not in str(info.value) and "127.0.0.1" in str(info.value)
    finally:
        server.stop()
    assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact("rediss://h:1/0?prefix=x") == "rediss://h:1/0?prefix=x"


def test_unknown_scheme_and_tls_scheme_are_registered(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"redis://, redis\+cluster://, rediss://, rediss\+cluster://"):
        build_tiers(kvmem.Config(path=str(tmp_path), remote_url="memcached://h:1"))
    tier = RedisTier.from_url("rediss://127.0.0.1:1/0?ssl_cert_reqs=none&prefix=p:", None)
    assert tier.prefix == "p:" and tier.capacity > 0  # unreachable: built anyway, skipped until it answers
    tier.close()


# -- cross-node reuse ---------------------------------------------------------------------------------
def test_second_node_reuses_the_first_nodes_prefix(
    tmp_path: Path, redis_url: str, postgres_url: str, request: pytest.FixtureRequest, one_thread: None
) -> None:
    """Node A prefills a prompt; node B (own local disk, same Redis and catalog) reuses A's chunks exactly."""
    second_node_reuses_first_nodes_prefix(
        tmp_path, with_options(redis_url, prefix=unique_prefix(request)), postgres_url
    )
