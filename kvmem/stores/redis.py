"""The remote tier on Redis: blobs as plain values under ``<prefix><storage key>``.

Built from ``remote_url``; the URL's form, its query options and the credential and
TLS rules are stated once, in docs/guides/several-nodes.md (*The Redis URL* and
*Securing the shared Redis*). Values are the blob bytes exactly as the other tiers
hold them, so every load is CRC-checked here like on disk; nothing is ever
unpickled. Keys are the prefix and the storage key (64 hex digits): a tenant salt
already makes two tenants' storage keys disjoint, a prefix keeps two deployments
apart on one server.

Redis evicts by itself (``maxmemory-policy``, and ``ttl`` when set), so the
tier is :class:`~kvmem.stores.base.SelfEvicting`: :class:`~kvmem.stores.tiered.TieredStore`
never sheds it by scanning keys, whose order Redis does not keep. ``usage()`` is the
server's ``used_memory``; ``capacity`` its ``maxmemory`` (or ``?capacity=``).

In cluster mode (``redis+cluster://``) the hosts are startup nodes: redis-py's
``RedisCluster`` learns the slot map from any of them and follows ``MOVED`` and
``ASK`` redirects by itself (resharding, failover). Keys carry their storage key
as a hash tag, ``<prefix>{<storage key>}``, and a quarantined value
``<prefix>quarantine:{<storage key>}``: both hash to the same slot, so the
quarantine ``RENAME`` (and its ``MULTI``) never spans slots, and entries still
spread over all masters (the 64 hex digits are uniform). A prefix holding ``{``
or ``}`` would take the hash tag's place (every entry on one slot) and is refused.
Batches (``contains_many``, ``get_many``) are cluster pipelines: redis-py groups
their commands by node, one round trip per node, never a cross-slot ``MGET``.
``usage()``, ``capacity`` and ``keys()`` cover every master. A cluster that
cannot be reached at start is connected to on first use.

Failures (what an operator sees: docs/guides/several-nodes.md, *Securing the shared Redis*): at
start, refused credentials or a failed TLS handshake are a
:class:`~kvmem.errors.ConfigError` (retrying will not heal them) and an unreachable
server is only logged; after start, every redis-py failure surfaces as
:class:`~kvmem.errors.TierUnavailable`, which the tiered store counts and answers by
skipping the tier for ``tier_retry_seconds``. URLs reach messages only through
:func:`kvmem.redaction.redact`.
"""

from __future__ import annotations

import logging
import re
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import crc32c
import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import ClusterError, NoPermissionError, RedisClusterException
from redis.retry import Retry

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob, empty_buffer
from kvmem.config import Config, parse_size
from kvmem.errors import CapacityError, ConfigError, IntegrityError, TierUnavailable
from kvmem.keys import is_storage_key
from kvmem.redaction import redact, url_password
from kvmem.stores.base import BatchLookups, OpensBlobs, Quarantine, SelfEvicting, TierBase, VerifiedReads
from kvmem.stores.readers import BlobReader, open_by_ranges
from kvmem.stores.resp import Gathered, GatherPacker, getrange_into, read_bulk

__all__ = ["RedisTier"]

log = logging.getLogger(__name__)

REDIS_MAX_VALUE = 512 * 1024**2  # Redis's default proto-max-bulk-len: the largest string it accepts
_STEP = 1 << 20  # a whole value is received a step at a time, each CRC'd while it is in cache
_UNBOUNDED = 1 << 50  # capacity when the server sets no maxmemory: Redis, not kvmem, decides what fits
_QUARANTINE = "quarantine:"
_QUARANTINE_TTL = 7 * 24 * 3600  # a quarantined value is kept a week for inspection, then Redis drops it
_QUARANTINE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 1
"""
_USAGE_TTL = 1.0  # seconds a used_memory reading is reused (usage() is called per put)
_DEFAULT_TIMEOUT = 2.0  # socket timeouts: a dead server costs at most this per attempt
_OPTIONS = ("prefix", "ttl", "max_value", "capacity")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_FAILURES = (redis.RedisError, RedisClusterException)  # NOTE: redis-py's cluster errors are not all RedisErrors
_ACCEPTED = (
    "redis://[[user]:password@]host[:port][/db][?prefix=...&ttl=SECONDS&max_value=SIZE&capacity=SIZE], "
    "or redis+cluster://[[user]:password@]host:port,host:port,...[?...] (rediss: TLS)"
)

Client = redis.Redis | RedisCluster


def _cluster_connect(url: str, theirs: list[tuple[str, str]], password: str | None) -> Callable[[], RedisCluster]:
    """A function making the ``RedisCluster`` client for a ``redis+cluster://`` URL (redis-py options in ``theirs``;
    ``password`` when the URL has none).

    Raises:
        ValueError: no host, a bad port, a database other than 0, or a bad redis-py option.
    """
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes: list[ClusterNode] = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or host.endswith(":"):  # no port, or a bare IPv6 address
            host, port = item.strip(), "6379"
        host = host.strip("[]")
        if not host:
            raise ValueError(f"empty host in {item!r}")
        nodes.append(ClusterNode(host, int(port)))
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"database {parts.path.strip('/')!r}: a Redis Cluster has only database 0")
    tls = parts.scheme == "rediss+cluster"
    # redis-py's own URL parser converts its query options (timeouts, ssl_*) and unquotes the credentials.
    single = urlunsplit(
        ("rediss" if tls else "redis", (userinfo + "@" if userinfo else "") + "localhost", "", urlencode(theirs), "")
    )
    kwargs = parse_url(single)
    for name in ("host", "port", "db", "connection_class"):
        kwargs.pop(name, None)
    if tls:
        kwargs["ssl"] = True
    if password and not kwargs.get("password"):
        kwargs["password"] = password
    return lambda: RedisCluster(startup_nodes=list(nodes), retry=Retry(NoBackoff(), 1), **kwargs)


def _misconfiguration(exc: BaseException) -> str | None:
    """What ``exc`` says is wrong with the settings (credentials, TLS), or ``None`` for a plain outage."""
    if isinstance(exc, redis.AuthenticationError):
        return (
            f"the server refused the credentials ({exc}); give the user in the URL "
            "(redis://USER@host) and the password there or in remote_password"
        )
    seen: BaseException | None = exc
    while seen is not None:  # redis-py raises its ConnectionError inside the handler of the ssl error
        if isinstance(seen, ssl.SSLError) or (isinstance(seen, TimeoutError) and "handshake" in str(seen)):
            return (
                f"the TLS handshake failed ({type(seen).__name__}: {seen}); check that the port serves TLS "
                "and the ssl_ca_certs, ssl_certfile, ssl_keyfile options"
            )
        seen = seen.__cause__ or seen.__context__
    return None


class RedisTier(TierBase, SelfEvicting, VerifiedReads, OpensBlobs, Quarantine, BatchLookups):
    """Blobs on a Redis server, one string value per entry.

    Loads are CRC-checked as the reply is copied out; a blob is read in parts with
    ``GETRANGE``; corrupt values are renamed aside; lookups are pipelined.

    Args:
        client: a redis-py client, ``Redis`` or ``RedisCluster`` (``decode_responses`` off).
        prefix: prepended to every storage key (one per deployment).
        ttl: seconds an entry lives after its last write or read, or ``None`` (Redis's eviction only).
        max_value: largest blob accepted, bytes (Redis refuses strings over 512 MiB by default).
        capacity: bytes the tier may hold; ``None``: the server's ``maxmemory`` when set.
        url: the URL the client came from, for messages (its password is never shown).
        connect: instead of ``client``: makes the client on first use (a cluster client connects when made).

    Raises:
        ConfigError: the server refuses the credentials or the TLS handshake, or an option is out of range.
    """

    persistent = True

    def __init__(
        self,
        client: Client | None = None,
        *,
        prefix: str = "kvmem:",
        ttl: int | None = None,
        max_value: int = REDIS_MAX_VALUE,
        capacity: int | None = None,
        url: str = "redis://",
        connect: Callable[[], Client] | None = None,
    ) -> None:
        if ttl is not None and ttl <= 0:
            raise ConfigError(f"remote_url ttl={ttl!r}: accepted a whole number of seconds > 0")
        if not 0 < max_value <= REDIS_MAX_VALUE:
            raise ConfigError(f"remote_url max_value={max_value!r}: accepted 1 to {REDIS_MAX_VALUE} bytes")
        if (client is None) == (connect is None):
            raise TypeError("RedisTier takes a client or a connect function, one of the two")
        self.name = "redis"
        self._client = client
        self._connect = connect
        self.cluster = isinstance(client, RedisCluster) or urlsplit(url).scheme in _CLUSTER_SCHEMES
        if self.cluster and ("{" in prefix or "}" in prefix):
            raise ConfigError(
                f"remote_url prefix={prefix!r}: a cluster prefix may not hold '{{' or '}}' "
                "(kvmem hash-tags each key with its storage key)"
            )
        self.prefix = prefix
        self.ttl = ttl
        self.max_value = max_value
        self.url = redact(url)
        # a cluster client drops redis-py's command_packer option: its puts join the blob's parts once
        self._gather = isinstance(client, redis.Redis) and isinstance(
            client.connection_pool.connection_kwargs.get("command_packer"), GatherPacker
        )
        self._pattern = self._glob("") + ("{" + "?" * 64 + "}" if self.cluster else "?" * 64)
        self._usage = (0, float("-inf"))  # (bytes, monotonic time read)
        self.capacity = capacity if capacity is not None else self._server_capacity()

    @classmethod
    def from_url(cls, url: str, config: Config | None = None) -> RedisTier:
        """A tier for ``url`` (``redis://``, ``rediss://``, ``redis+cluster://``, ``rediss+cluster://``).

        kvmem's options are taken from the URL's query, redis-py's left; the password is the URL's, else
        ``config.remote_password`` (the rules: docs/guides/several-nodes.md, *The Redis URL* and *Securing the
        shared Redis*).

        Raises:
            ConfigError: a bad option, credentials the server refuses, or a failed TLS handshake.
        """
        in_url = url_password(url)
        password = None if in_url or config is None else config.remote_password
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        ours = {k: v for k, v in query if k in _OPTIONS}
        theirs = [(k, v) for k, v in query if k not in _OPTIONS]
        for name in ("socket_timeout", "socket_connect_timeout"):
            if name not in dict(theirs):
                theirs.append((name, str(_DEFAULT_TIMEOUT)))
        try:
            ttl = int(ours["ttl"]) if ours.get("ttl") else None
            max_value = parse_size(ours["max_value"], "max_value") if ours.get("max_value") else REDIS_MAX_VALUE
            capacity = parse_size(ours["capacity"], "capacity") if ours.get("capacity") else None
        except ValueError as exc:
            raise ConfigError(f"remote_url={redact(url)!r}: {exc}; accepted {_ACCEPTED}") from exc
        try:
            # one quick retry covers a pooled connection the server closed (restart, idle timeout);
            # more would multiply what a dead server costs each call.
            if parts.scheme in _CLUSTER_SCHEMES:
                client, connect = None, _cluster_connect(url, theirs, password)
            else:
                # redis-py lets a password in the URL override this one: ours goes only where it has none
                extra = {"password": password} if password else {}
                client_url = urlunsplit(parts._replace(query=urlencode(theirs)))
                client = redis.Redis.from_url(
                    client_url, retry=Retry(NoBackoff(), 1), command_packer=GatherPacker(), **extra
                )
                connect = None
        except (ValueError, TypeError) as exc:
            # NOTE: a parse error may quote a piece of a password that was not percent-encoded: not shown then
            detail = "cannot be parsed (percent-encode @ : / ? # in the password)" if in_url else str(exc)
            raise ConfigError(f"remote_url={redact(url)!r}: {detail}; accepted {_ACCEPTED}") from None
        return cls(
            client,
            prefix=ours.get("prefix", "kvmem:"),
            ttl=ttl,
            max_value=max_value,
            capacity=capacity,
            url=url,
            connect=connect,
        )

    @property
    def client(self) -> Client:
        """The redis-py client, made on first use when the tier was given a connect function.

        Raises:
            TierUnavailable: the client could not be made (no startup node answers); tried again next call.
        """
        if self._client is None:
            assert self._connect is not None
            try:
                self._client = self._connect()
            except _FAILURES as exc:
                raise TierUnavailable(f"redis tier at {self.url}: {type(exc).__name__}: {exc}") from exc
        return self._client

    # -- errors -----------------------------------------------------------------
    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Re-raise redis-py failures as ``TierUnavailable`` naming the (redacted) URL."""
        try:
            yield
        except _FAILURES as exc:
            raise TierUnavailable(f"redis tier at {self.url}: {type(exc).__name__}: {exc}") from exc

    def _server_capacity(self) -> int:
        """The server's ``maxmemory``, or unbounded; checks the credentials and the TLS handshake on the way.

        A server that cannot be reached now is not an error here (the tiered store
        skips the tier until it answers); one that refuses the credentials or the
        TLS handshake is: retrying will not mend it.

        Raises:
            ConfigError: the server refused the credentials, or the TLS handshake failed.
        """
        try:
            infos = self._memory_infos()
        except NoPermissionError as exc:  # an ACL user without INFO: kvmem works, blind to memory
            log.warning(
                "kvmem: redis tier at %s may not run INFO (%s); capacity unbounded, usage unknown", self.url, exc
            )
            return _UNBOUNDED
        except (*_FAILURES, TierUnavailable) as exc:
            cause = exc.__cause__ if isinstance(exc, TierUnavailable) and exc.__cause__ is not None else exc
            problem = _misconfiguration(cause)
            if problem is not None:
                raise ConfigError(f"remote_url={self.url!r}: {problem}") from exc
            log.warning(
                "kvmem: redis tier at %s is not reachable (%s: %s); local tiers serve until it is",
                self.url,
                type(cause).__name__,
                cause,
            )
            return _UNBOUNDED
        self._usage = (sum(int(i.get("used_memory", 0)) for i in infos), time.monotonic())
        limits = [int(i.get("maxmemory", 0)) for i in infos]
        return sum(limits) if limits and all(limits) else _UNBOUNDED  # one master without a limit: unbounded

    def _memory_infos(self) -> list[dict]:
        """``INFO memory`` of the server, or of every master of a cluster."""
        if not self.cluster:
            return [self.client.info("memory")]
        found = self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return [found] if "used_memory" in found else list(found.values())  # one master: not keyed by node

    def _tagged(self, key: str) -> str:
        """``key`` as it appears inside Redis keys: in cluster mode, a hash tag (its slot decides the node)."""
        return "{" + key + "}" if self.cluster else key

    def _key(self, key: str) -> str:
        if not is_storage_key(key):
            raise ValueError(f"RedisTier key {key[:80]!r}: expected a storage key of 64 hex digits")
        return self.prefix + self._tagged(key)

    # -- StorageTier ------------------------------------------------------------
    def _fetch(self, key: str, verify: bool = False) -> tuple[torch.Tensor, blobfmt.StreamVerifier | None] | None:
        """``key``'s whole value in a new buffer (``None``: absent), received straight into it (a cluster client's
        reply is copied); with ``verify``, the verifier that checked its CRCs as it arrived (a step at a time,
        in cache).

        Raises:
            IntegrityError: with ``verify``, the value is not a whole blob matching its CRCs.
        """
        skey = self._key(key)
        if not isinstance(self.client, redis.Redis):  # NOTE: a cluster client routes the command itself
            with self._errors():
                data = self.client.get(skey) if self.ttl is None else self.client.getex(skey, ex=self.ttl)
            if data is None:
                return None
            src = np.frombuffer(data, dtype=np.uint8)  # type: ignore[arg-type]  # bytes: replies are never decoded
            checker = blobfmt.StreamVerifier() if verify else None
            return (blobfmt.copy_verified(src, checker=checker) if verify else torch.from_numpy(src.copy())), checker
        command: tuple[str | int, ...] = ("GET", skey) if self.ttl is None else ("GETEX", skey, "EX", self.ttl)
        received = _Received(verify)
        with self._errors():
            n = read_bulk(self.client, command, received.arrays_for, received.filled)
        if n < 0:
            return None
        if received.failure is not None:
            raise received.failure
        if received.checker is not None:
            received.checker.finish(n)
        return received.buf, received.checker

    def get(self, key: str) -> torch.Tensor | None:
        got = self._fetch(key)
        return None if got is None else got[0]

    def read_verified(self, key: str) -> blobfmt.Verified | None:
        """``get`` with the CRCs checked as the reply arrives in the returned buffer, and the header the check
        parsed (a load through ``Memory`` then parses it once).

        Raises:
            IntegrityError: the value is not a whole blob matching its CRCs.
        """
        got = self._fetch(key, verify=True)
        if got is None:
            return None
        buf, checker = got
        assert checker is not None
        return blobfmt.Verified(buf, checker.parsed)

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """``get`` for several keys in one round trip (``MGET``, or pipelined ``GETEX`` with a TTL)."""
        if not keys:
            return []
        with self._errors():
            if self.ttl is None and not self.cluster:
                found = self.client.mget([self._key(k) for k in keys])
            elif self.ttl is None:  # NOTE: a cluster pipeline: one request per node, never a cross-slot MGET
                pipe = self.client.pipeline(transaction=False)
                for k in keys:
                    pipe.get(self._key(k))
                found = pipe.execute()
            else:
                pipe = self.client.pipeline(transaction=False)
                for k in keys:
                    pipe.getex(self._key(k), ex=self.ttl)
                found = pipe.execute()
        # redis-py types a reply as bytes | str; this client never decodes replies (bytes only)
        return [
            None if d is None else torch.from_numpy(np.frombuffer(d, dtype=np.uint8).copy())  # type: ignore[arg-type]
            for d in found
        ]

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        """Bytes ``[start, stop)`` of ``key``'s value with one ``GETRANGE`` (not CRC-checked)."""
        if stop <= start:
            return None if not self.contains(key) else empty_buffer(0)
        buf = empty_buffer(stop - start)
        got, _crc = self.read_range_into(key, start, [buf.numpy()])
        if not got and not self.contains(key):  # NOTE: GETRANGE answers an absent key as an empty value
            return None
        return buf[:got]

    def read_range_into(self, key: str, start: int, arrays: Sequence[np.ndarray]) -> tuple[int, int]:
        """``key``'s value from byte ``start`` into ``arrays`` (contiguous uint8), in order, with one ``GETRANGE``:
        ``(bytes read, their CRC32C)``; fewer bytes where the value ends sooner, none where it is absent.

        The reply is received straight into the arrays (:func:`~kvmem.stores.resp.getrange_into`); a cluster
        client's is copied into them.
        """
        want = sum(a.size for a in arrays)
        with self._errors():
            if isinstance(self.client, redis.Redis):
                return getrange_into(self.client, self._key(key), start, arrays)
            data = self.client.getrange(self._key(key), start, start + want - 1)
        src = np.frombuffer(data, dtype=np.uint8)  # type: ignore[arg-type]  # bytes: replies are never decoded
        at = crc = 0
        for arr in arrays:
            piece = src[at : at + arr.size]
            arr[: piece.size] = piece
            crc = crc32c.crc32c(arr[: piece.size].data, crc)
            at += piece.size
        return at, crc

    def open_blob(self, key: str) -> BlobReader | None:
        """``key``'s value read in parts, one ``GETRANGE`` each, every part CRC-checked; a part for the caller's
        tensors is received straight into them.

        Raises:
            IntegrityError: its header is not intact.
        """
        return open_by_ranges(
            lambda lo, hi: self.read_range(key, lo, hi),
            self.name,
            checks_crc=True,
            read_into=lambda at, arrays: self.read_range_into(key, at, arrays),
        )

    def put(self, key: str, blob: EncodedBlob) -> None:
        """``SET`` the blob (with ``EX ttl``); one value, replaced atomically, sent from its parts without a copy.

        Raises:
            CapacityError: the blob is larger than ``max_value``.
            TierUnavailable: Redis failed or refused the write (e.g. out of memory).
        """
        if blob.nbytes > self.max_value:
            raise CapacityError(
                f"value of {blob.nbytes} bytes is larger than the redis tier accepts per value "
                f"({self.max_value} bytes; Redis's own limit is {REDIS_MAX_VALUE}): store it "
                "compressed, or on local tiers only"
            )
        data: Gathered | memoryview
        if self._gather:
            data = Gathered(blob.parts, blob.nbytes)
        else:  # a single part goes out as a memoryview without a copy; several are joined once
            data = blob.parts[0].data if len(blob.parts) == 1 else blob.to_tensor().numpy().data
        with self._errors():
            self.client.set(self._key(key), data, ex=self.ttl)  # type: ignore[arg-type]  # GatherPacker frames it

    def contains(self, key: str) -> bool:
        with self._errors():
            return bool(self.client.exists(self._key(key)))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``EXISTS`` of each key, pipelined: one round trip for the whole batch (per node in a cluster)."""
        if not keys:
            return []
        with self._errors():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._key(k))
            return [bool(n) for n in pipe.execute()]

    def delete(self, key: str) -> bool:
        with self._errors():
            return bool(self.client.delete(self._key(key)))

    def quarantine(self, key: str) -> None:
        """Rename the value to ``<prefix>quarantine:<key>``, kept a week for inspection (deleted while migrating)."""
        aside = self.prefix + _QUARANTINE + self._tagged(key)
        with self._errors():
            # NOTE: one script, atomic like MULTI/RENAME/EXPIRE, which redis-py refuses in a cluster pipeline;
            # both keys share the hash tag, hence the slot.
            try:
                renamed = self.client.eval(_QUARANTINE_SCRIPT, 2, self._key(key), aside, _QUARANTINE_TTL)
            except ClusterError:  # a migrating slot answers TRYAGAIN to keys not all on one node (``aside``
                # never is; redis-py retries, then raises this): DEL, one key, follows ASK; nothing is kept aside
                if self.client.delete(self._key(key)):
                    log.warning("kvmem: deleted corrupt entry %s (its slot is migrating: not kept aside)", key)
                return
            if not renamed:
                return  # no such key: deleted or quarantined by another process meanwhile
        log.warning("kvmem: quarantined corrupt entry %s to redis key %s", key, aside)

    def quarantined(self) -> list[str]:
        """Redis keys of values moved aside by :meth:`quarantine`."""
        with self._errors():
            return sorted(k.decode() for k in self.client.scan_iter(match=self._glob(_QUARANTINE) + "*", count=1000))

    def purge_quarantine(self) -> int:
        freed = 0
        for name in self.quarantined():
            with self._errors():
                pipe = self.client.pipeline(transaction=True)
                pipe.strlen(name)
                pipe.delete(name)
                size, deleted = pipe.execute()
            freed += size if deleted else 0
        return freed

    def keys(self) -> Iterator[str]:
        """Stored keys under this prefix, in the server's scan order (Redis keeps the LRU order itself).

        Raises:
            TierUnavailable: Redis failed during the scan.
        """
        start = len(self.prefix)
        with self._errors():
            found = [k.decode()[start:].strip("{}") for k in self.client.scan_iter(match=self._pattern, count=1000)]
        return iter([k for k in found if is_storage_key(k)])

    def usage(self) -> int:
        """The server's ``used_memory``, summed over a cluster's masters (read at most once a second; the last
        reading when it is down)."""
        used, when = self._usage
        if time.monotonic() - when < _USAGE_TTL:
            return used
        try:
            used = sum(int(i.get("used_memory", 0)) for i in self._memory_infos())
        except (*_FAILURES, TierUnavailable):
            return used  # a gauge, not a decision: a stale reading beats failing stats()
        self._usage = (used, time.monotonic())
        return used

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def _glob(self, suffix: str) -> str:
        return re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix + suffix)


class _Received:
    """A whole value received into a new buffer (:func:`~kvmem.stores.resp.read_bulk`); with ``verify``, its CRCs
    checked a step at a time as it arrives, while the step is in cache (a failure is kept, not raised, until the
    reply has been read whole)."""

    def __init__(self, verify: bool) -> None:
        self.verify = verify
        self.buf = empty_buffer(0)
        self.checker: blobfmt.StreamVerifier | None = None
        self.failure: IntegrityError | None = None
        self._arr = self.buf.numpy()
        self._at = 0

    def arrays_for(self, n: int) -> list[np.ndarray]:
        """The buffer for a reply of ``n`` bytes, in steps (made anew when a command is tried again)."""
        self.buf = empty_buffer(n)
        self._arr = self.buf.numpy()
        self.checker = blobfmt.StreamVerifier() if self.verify else None
        self.failure, self._at = None, 0
        return [self._arr[i : i + _STEP] for i in range(0, n, _STEP)]

    def filled(self, view: memoryview) -> None:
        self._at += len(view)
        if self.checker is not None and self.failure is None:
            try:
                self.checker.feed(self._arr, self._at)
            except IntegrityError as exc:
                self.failure = exc
