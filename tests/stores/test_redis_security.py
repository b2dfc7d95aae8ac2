"""Redis tier security on real servers (tests/servers.py): an ACL user with a password, credentials from the
URL or from ``remote_password``, refusals reported clearly and without the password, credentials revoked
mid-run, TLS (server and client certificates), tenants kept apart on one server, and values that are not
kvmem blobs refused unread.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from redis.exceptions import NoPermissionError

from kvmem.config import describe
from kvmem.errors import ConfigError, IntegrityError, TierUnavailable
from tests.conftest import MemoryFactory
from tests.servers import RedisServer
from tests.stores.redis_helpers import over_remote, redis_tier, unique_prefix, with_options

SECRET = "p#ss/w?rd@Zq7"  # NOTE: every URL-special character: percent-encoded in URLs, raw in remote_password
ADMIN = "admin-Kx93"
# The least-privilege ACL of docs/guides/several-nodes.md: kvmem's keys only, no dangerous commands but INFO.
KVMEM_ACL = (
    f"kvmem on >{SECRET} ~kvmem:* resetchannels -@all +@read +@write +@keyspace +@scripting "
    "+@transaction +@connection -@dangerous +info"
)


def with_user(url: str, user: str, password: str | None = None) -> str:
    userinfo = user + ("" if password is None else ":" + quote(password, safe=""))
    return url.replace("://", f"://{userinfo}@", 1)


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server whose default user is off: ``kvmem`` (``KVMEM_ACL``) and ``admin`` (everything) log in."""
    server = RedisServer(tmp_path / "redis", users=[KVMEM_ACL, f"admin on >{ADMIN} ~* &* +@all"])
    yield server
    server.stop()


def admin(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, username="admin", password=ADMIN)


@pytest.fixture
def remote_memory(make_memory: MemoryFactory) -> MemoryFactory:
    """``remote_memory(name, url, **settings)``: no local tier unless ``settings`` give one: loads come from Redis."""
    return over_remote(make_memory, cpu_bytes=0)


# -- ACL user and password -------------------------------------------------------------------------
def test_acl_user_with_password_end_to_end(acl_server: RedisServer, remote_memory: MemoryFactory) -> None:
    """Every command the tier sends is allowed by the documented least-privilege ACL, and only kvmem's keys."""
    url = with_user(acl_server.url, "kvmem", SECRET)
    with remote_memory("m", url) as mem:
        skeys = [mem.store(f"k{i}", f"value {i}".encode()) for i in range(3)]
        assert [mem.load(f"k{i}") for i in range(3)] == [f"value {i}".encode() for i in range(3)]
        assert mem.contains_many(["k0", "k2", "nope"]) == [True, True, False]
        tier = redis_tier(mem)
        assert sorted(tier.keys()) == sorted(skeys) and tier.usage() > 0
        assert tier.get_many([skeys[0], skeys[1]])[1] is not None and tier.read_range(skeys[0], 0, 8) is not None
        tier.quarantine(skeys[2])  # EVAL: RENAME and EXPIRE within kvmem:*
        assert tier.quarantined() == ["kvmem:quarantine:" + skeys[2]] and tier.purge_quarantine() > 0
        assert mem.delete("k1") and mem.load("k1") is None
        assert mem.metrics.total("kvmem_tier_errors_total") == 0
        with pytest.raises(NoPermissionError):  # the ACL holds: the user reaches nothing outside kvmem:*
            tier.client.set("other:key", b"x")
        with pytest.raises(NoPermissionError):
            tier.client.flushall()
    with admin(acl_server) as root:
        assert root.keys("*") == [("kvmem:" + skeys[0]).encode()]


@pytest.mark.parametrize(
    "credentials",
    [None, ("kvmem", None), ("kvmem", "wrong"), ("nobody", SECRET), ("", SECRET)],
    ids=["none", "user-only", "wrong-password", "unknown-user", "password-only"],
)
def test_missing_or_wrong_credentials_are_refused_clearly(
    acl_server: RedisServer, remote_memory: MemoryFactory, credentials: tuple[str, str | None] | None
) -> None:
    url = acl_server.url if credentials is None else with_user(acl_server.url, *credentials)
    with pytest.raises(ConfigError, match=r"refused the credentials") as info:
        remote_memory("m", url)
    message = str(info.value)
    assert f"127.0.0.1:{acl_server.port}" in message and "remote_password" in message
    assert "wrong" not in message and SECRET not in message and quote(SECRET, safe="") not in message


def test_password_from_config_and_environment(
    acl_server: RedisServer, remote_memory: MemoryFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remote_password`` (argument or ``KVMEM_REMOTE_PASSWORD``) completes a URL naming only the user; a
    password in the URL wins over it."""
    url = with_user(acl_server.url, "kvmem")
    with remote_memory("arg", url, remote_password=SECRET) as mem:
        mem.store("k", b"v")
        assert mem.load("k") == b"v" and mem._tiers.get(mem.storage_key("k"))[0].tier == "redis"
    monkeypatch.setenv("KVMEM_REMOTE_PASSWORD", SECRET)
    with remote_memory("env", url) as mem:
        assert mem.load("k") == b"v"
        assert ("remote_password", "***", "env KVMEM_REMOTE_PASSWORD") in describe(mem.config)
    monkeypatch.delenv("KVMEM_REMOTE_PASSWORD")
    with remote_memory("url-wins", with_user(acl_server.url, "kvmem", SECRET), remote_password="stale"):
        pass
    with pytest.raises(ConfigError, match="refused the credentials"):
        remote_memory("url-wins-2", with_user(acl_server.url, "kvmem", "stale"), remote_password=SECRET)


def test_password_never_shown(
    acl_server: RedisServer, remote_memory: MemoryFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Not in errors (start, bad URL, mid-run), logs, ``repr`` of the tier or config, or ``kvmem config``."""
    caplog.set_level(logging.DEBUG)
    shown: list[str] = []
    for url, password in [
        (with_user(acl_server.url, "kvmem", "wrong-" + SECRET), None),
        (with_user(acl_server.url, "kvmem"), "wrong-" + SECRET),
        (acl_server.url.replace("://", f"://kvmem:{SECRET}@"), None),
    ]:  # not percent-encoded
        with pytest.raises(ConfigError) as info:
            remote_memory("bad", url, remote_password=password)
        shown.append(str(info.value))
        assert f"127.0.0.1:{acl_server.port}" in shown[-1]
    assert "cannot be parsed" in shown[-1] and "kvmem:***@" in shown[-1]
    with remote_memory(
        "m", with_user(acl_server.url, "kvmem"), cpu_bytes="1MiB", remote_password=SECRET, tier_retry_seconds=60
    ) as mem:
        tier = redis_tier(mem)
        shown += [repr(tier), tier.url, repr(mem.config), str(mem.config), str(describe(mem.config)), repr(tier.client)]
        acl_server.stop()
        mem.store("k", b"v")  # Redis gone: logged and counted, the CPU tier serves
        assert mem.metrics.total("kvmem_tier_errors_total") >= 1
    shown += [r.getMessage() for r in caplog.records] + [str(r.exc_info) for r in caplog.records]
    assert any("refused the credentials" in s for s in shown) and any("tier redis failed" in s for s in shown)
    for text in shown:
        assert SECRET not in text and quote(SECRET, safe="") not in text and "p#ss" not in text, text


def test_password_as_a_query_option_is_never_shown(
    acl_server: RedisServer, remote_memory: MemoryFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """redis-py also takes ``?password=``: it logs in, and no error, log line or repr shows it."""
    caplog.set_level(logging.DEBUG)
    url = with_user(acl_server.url, "kvmem") + "?password=" + quote(SECRET, safe="")
    with remote_memory("m", url, cpu_bytes="1MiB", tier_retry_seconds=60) as mem:
        mem.store("k", b"v")
        tier = redis_tier(mem)
        assert tier.contains(mem.storage_key("k"))  # logged in with the password from the query
        acl_server.stop()
        with pytest.raises(TierUnavailable) as gone:
            tier.contains(mem.storage_key("k"))
        mem.store("k2", b"v")  # Redis gone: logged and counted, the CPU tier serves
        shown = [str(gone.value), repr(tier), tier.url, repr(mem.config), str(describe(mem.config))]
    shown += [r.getMessage() for r in caplog.records]
    assert any("tier redis failed" in s for s in shown) and "password=***" in tier.url
    for text in shown:
        assert "p#ss" not in text and quote(SECRET, safe="") not in text, text


def test_credentials_revoked_mid_run_degrade_to_local_tiers(
    acl_server: RedisServer, remote_memory: MemoryFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The user's password changes while kvmem runs: Redis is skipped and counted like an outage, the local
    tier serves, and the tier comes back once the credentials work again."""
    url = with_user(acl_server.url, "kvmem", SECRET)
    with remote_memory("m", url, cpu_bytes="8MiB", tier_retry_seconds=0.2) as mem, admin(acl_server) as root:
        mem.store("before", b"b" * 100)
        root.acl_setuser("kvmem", enabled=True, passwords=[f"-{SECRET}", "+rotated"])
        root.client_kill_filter(user="kvmem")  # its open connections go; reconnecting needs the new password
        for i in range(5):
            mem.store(f"during-{i}", bytes([i]) * 100)
            assert mem.load(f"during-{i}") == bytes([i]) * 100
        assert mem.load("before") == b"b" * 100
        assert mem.metrics.registry.get_sample_value("kvmem_tier_errors_total", {"tier": "redis"}) >= 1
        assert not mem._tiers.healthy(redis_tier(mem))
        assert any(
            "AuthenticationError" in r.getMessage() and f"127.0.0.1:{acl_server.port}" in r.getMessage()
            for r in caplog.records
        )

        root.acl_setuser("kvmem", enabled=True, passwords=["-rotated", f"+{SECRET}"])
        time.sleep(0.3)
        mem.store("after", b"a" * 100)
        assert redis_tier(mem).contains(mem.storage_key("after")) and mem._tiers.healthy(redis_tier(mem))


# -- TLS ---------------------------------------------------------------------------------------------
@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[RedisServer]:
    """TLS only, client certificates required, and the ACL users of ``acl_server``."""
    server = RedisServer(tmp_path / "redis-tls", users=[KVMEM_ACL], tls=True, client_certs=True)
    yield server
    server.stop()


def test_tls_with_client_certificate_and_acl_user(tls_server: RedisServer, remote_memory: MemoryFactory) -> None:
    certs = tls_server.certificates
    assert certs is not None and tls_server.url.startswith("rediss://")
    url = with_options(
        with_user(tls_server.url, "kvmem"),
        ssl_ca_certs=certs.ca,
        ssl_certfile=certs.client_cert,
        ssl_keyfile=certs.client_key,
    )
    with remote_memory("m", url, remote_password=SECRET) as mem:
        mem.store("k", b"over TLS")
        assert mem.load("k") == b"over TLS" and mem._tiers.get(mem.storage_key("k"))[0].tier == "redis"
        connection = redis_tier(mem).client.connection_pool.get_connection()
        try:
            assert connection._sock.version().startswith("TLS")  # type: ignore[union-attr]
        finally:
            redis_tier(mem).client.connection_pool.release(connection)
    # redis-py's certificate options pass through: no CA, but verification turned off
    insecure = with_options(
        with_user(tls_server.url, "kvmem"),
        ssl_cert_reqs="none",
        ssl_certfile=certs.client_cert,
        ssl_keyfile=certs.client_key,
    )
    with remote_memory("n", insecure, remote_password=SECRET) as mem:
        assert mem.load("k") == b"over TLS"


def test_tls_misconfigurations_are_refused_clearly(
    tls_server: RedisServer, redis_url: str, remote_memory: MemoryFactory
) -> None:
    certs = tls_server.certificates
    assert certs is not None
    base = with_user(tls_server.url, "kvmem")
    plain_port = redis_url.replace("redis://", "rediss://").split("?")[0]
    cases = {
        "unknown CA": (base, "CERTIFICATE_VERIFY_FAILED"),
        "no client certificate": (with_options(base, ssl_ca_certs=certs.ca), "SSL"),  # SSLError or SSLEOFError
        "plain port behind rediss://": (with_options(plain_port, socket_connect_timeout="0.5"), "handshake"),
    }
    for case, (url, detail) in cases.items():
        with pytest.raises(ConfigError, match="TLS handshake failed") as info:
            remote_memory("m", url, remote_password=SECRET)
        assert detail in str(info.value) and "127.0.0.1:" in str(info.value), case
        assert SECRET not in str(info.value), case


# -- tenants -----------------------------------------------------------------------------------------
def test_tenant_salt_keeps_tenants_keys_disjoint(
    redis_url: str, remote_memory: MemoryFactory, request: pytest.FixtureRequest
) -> None:
    """Two tenants on one server and prefix store the same names: their Redis keys never meet, and neither
    sees the other's entries."""
    url = with_options(redis_url, prefix=unique_prefix(request))
    names = [f"doc-{i}" for i in range(10)]
    with remote_memory("t1", url, tenant_salt="tenant-1") as t1, remote_memory("t2", url, tenant_salt="tenant-2") as t2:
        keys1 = {t1.store(n, f"tenant 1: {n}".encode()) for n in names}
        keys2 = {t2.store(n, f"tenant 2: {n}".encode()) for n in names[:5]}
        t1.store("only-tenant-1", b"private")
        on_server = set(redis_tier(t1).keys())
        assert keys1.isdisjoint(keys2) and keys1 | keys2 | {t1.storage_key("only-tenant-1")} == on_server
        assert [t2.load(n) for n in names[:5]] == [f"tenant 2: {n}".encode() for n in names[:5]]
        assert [t2.load(n) for n in names[5:]] == [None] * 5  # tenant 1 stored these; tenant 2 never sees them
        assert t2.load("only-tenant-1") is None and not t2.contains("only-tenant-1")
        assert t2.contains_many(names) == [True] * 5 + [False] * 5
    with remote_memory("t1-again", url, tenant_salt="tenant-1") as again:  # another process, same tenant
        assert [again.load(n) for n in names] == [f"tenant 1: {n}".encode() for n in names]
        tier = redis_tier(again)
        tier.client.delete(*[tier.prefix + k for k in tier.keys()])


# -- nothing but blobs is ever decoded ------------------------------------------------------------------
class _Trap:
    """Unpickling this would create ``marker``: the proof that nobody unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return Path.touch, (self.marker,)


def test_value_that_is_not_a_blob_is_refused_never_deserialized(
    redis_url: str, tmp_path: Path, remote_memory: MemoryFactory, request: pytest.FixtureRequest
) -> None:
    """A pickle written raw under a kvmem key (by anyone who can write to Redis) is a corrupt entry: a miss,
    counted and quarantined (or ``IntegrityError`` in strict mode), and it is never unpickled."""
    url = with_options(redis_url, prefix=unique_prefix(request))
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Trap(marker))
    with remote_memory("w", url) as writer:
        skey = writer.store("x", {"a": 1})
        tier = redis_tier(writer)
        tier.client.set(tier.prefix + skey, payload)
    with remote_memory("r", url) as reader:
        assert reader.load("x") is None
        assert reader.metrics.total("kvmem_crc_failures_total") == 1
        assert tier.quarantined() == [tier.prefix + "quarantine:" + skey]
        assert reader.load("x", regenerate=lambda: {"a": 1}) == {"a": 1}
    tier.client.set(tier.prefix + skey, payload)
    with (
        remote_memory("s", url, strict=True) as strict,
        pytest.raises(IntegrityError, match="failed its integrity check"),
    ):
        strict.load("x")
    tier.client.set(tier.prefix + skey, payload)  # (the strict load quarantined it too)
    with pytest.raises(IntegrityError, match="not a kvmem blob"):
        tier.read_verified(skey)
    assert not marker.exists()
    tier.client.delete(*[tier.prefix + skey, *tier.quarantined()])
    tier.close()
