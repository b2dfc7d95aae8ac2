"""``Memory``: the public face of kvmem, and the module-level default instance.

A ``Memory`` turns user keys into storage keys (namespace and tenant salt folded
in), values into blobs (codec pipeline), and drives the tiers and the catalog.
This module holds its data path (``store``, ``load``, ``fetch`` and their batched
forms); its state and the rest of its operations come from
:class:`~kvmem.core.MemoryCore`, :class:`~kvmem.lookup.SemanticLookup` (semantic
lookup) and :class:`~kvmem.ops.maintenance.Maintenance` (stats, verify, gc, migrate).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from kvmem.activity import serving
from kvmem.blob import EncodedBlob
from kvmem.catalog.catalog import StoreRow
from kvmem.catalog.records import EntryInfo, Loaded, Stats, TierStats
from kvmem.codecs import CodecSpec, parse_codec
from kvmem.codecs.serialization import check_owner, decode_value, encode_value, value_kind
from kvmem.errors import CapacityError, IntegrityError, OutputMismatch, TierUnavailable
from kvmem.loads import check_out, copy_into, fill, read_back
from kvmem.lookup import SemanticLookup
from kvmem.ops.maintenance import Maintenance
from kvmem.outputs import Out, out_nbytes
from kvmem.stores import CpuTier, Stored
from kvmem.threads import copy_pool, io_pool

if TYPE_CHECKING:  # kvmem.semantic loads only when a text is stored or looked up
    from kvmem.semantic import Match

__all__ = ["Memory", "Loaded", "EntryInfo", "TierStats", "Stats"]

V = TypeVar("V")
_THREADED_READ_BYTES = 1 << 20
# NOTE: load_many reads misses on kvmem's I/O threads only when a value is at least this large. A small
# value's read is mostly Python (parse, check, promote) holding the GIL: four threads taking turns at it,
# each waiting to get the GIL back after every system call, made the slowest loads several times slower
# (bench_prefetch.py) than reading them one after another on the caller's thread.


class Memory(SemanticLookup, Maintenance):
    """A content-addressed store of tensors, tensor trees, arrays, bytes and JSON.

    Args:
        path: data directory (default: the user cache dir, e.g. ``~/.cache/kvmem``).
        config: a full :class:`~kvmem.config.Config`; ``settings`` override it.
        config_file: YAML settings file (default: ``$KVMEM_CONFIG`` if set).
        registry: Prometheus registry for this instance's metrics (a private one if ``None``);
            with ``metrics_port`` set, this process serves it at :attr:`metrics_url`.
        embedder: embedder of the semantic layer (default: the packaged all-MiniLM-L6-v2,
            loaded on the first ``store(text=...)`` or :meth:`lookup_similar`).
        **settings: any :class:`~kvmem.config.Config` field, e.g. ``cpu_bytes="4GiB"``.

    Raises:
        ConfigError: a setting outside its accepted range, or ``metrics_port`` taken.
        TierUnavailable: the catalog database cannot be reached.
        SchemaError: the catalog database's schema is newer than this kvmem's, or migrating it failed.

    NOTE: its tiers and catalog are private. The feature layers (``kvmem.kv``, ``kvmem.agent``,
    ``kvmem.multimodal``, ``kvmem.semantic``, ``langchain-kvmem``) use its public operations
    and the ports of :mod:`kvmem.ports` (:attr:`database`, :meth:`chunk_store`, :meth:`record_hits`).
    """

    # -- store / load -----------------------------------------------------------
    @serving
    def store(
        self,
        key: str | bytes,
        value: object,
        *,
        metadata: dict[str, Any] | None = None,
        namespace: str | None = None,
        compression: str | None = None,
        text: str | None = None,
    ) -> str:
        """Store ``value`` under ``key``; a key that exists gets a new version.

        Args:
            key: any ``str`` or ``bytes``; it is hashed, never used as a path.
            value: tensor (any dtype, shape, device), numpy array, bytes, str, JSON
                scalars, or dict (str keys) / list / tuple nestings of those.
            metadata: JSON-able dict kept with the entry (``info(key).metadata``).
            namespace: scope of ``key``; the same key in two namespaces never collides.
            compression: codec spec for floating-point tensors (``none``, ``fp16``,
                ``bf16``, ``int8``, ``int4``, each optionally ``+lz4``). Default:
                lossless ``none``; ``config.compression`` is the default of the KV layers.
            text: index this text for :meth:`lookup_similar` in ``namespace`` (loads the embedder); its
                matches carry ``key`` in full.

        Returns:
            The storage key (64 hex digits) the entry lives under.

        Raises:
            InvalidKeyError, UnsupportedValueError, CodecError: bad input; nothing is stored.
            CapacityError: the encoded value is larger than every tier.
            TierUnavailable: no tier could take the value.
        """
        start = time.perf_counter()
        spec = parse_codec(compression)
        job = self._prepare(key, value, namespace, spec, metadata)
        stored = self._tiers.put(job.skey, job.encoded)
        self._record(job, stored)
        if text is not None:  # NOTE: a catalog outage costs the text its index row, never the store
            index = self.semantic_index()
            self._catalog_write(lambda: index.add(job.skey, text, namespace or "", key))
        self.metrics.store_seconds.observe(time.perf_counter() - start)
        return job.skey

    @serving
    def store_many(
        self,
        items: Mapping[str | bytes, object] | Sequence[tuple[str | bytes, object]],
        *,
        namespace: str | None = None,
        compression: str | None = None,
    ) -> list[str]:
        """Store several values in one call: each copied once into the top tier, the persistent tiers
        written in parallel and made durable together, the catalog rows written in one transaction.

        Args:
            items: ``{key: value}`` or ``[(key, value), ...]`` (see :meth:`store` for keys and values).
            namespace: scope of every key.
            compression: codec spec for floating-point tensors (see :meth:`store`).

        Returns:
            The storage keys, in order.

        Raises:
            InvalidKeyError, UnsupportedValueError, CodecError, CapacityError: bad input; nothing is stored.
            TierUnavailable: no tier could take some value (the others are stored).
        """
        start = time.perf_counter()
        spec = parse_codec(compression)
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        jobs = [self._prepare(key, value, namespace, spec, None) for key, value in pairs]
        for job, stored in zip(jobs, self._tiers.put_many([(job.skey, job.encoded) for job in jobs])):
            self._record(job, stored)
        self.metrics.store_seconds.observe(time.perf_counter() - start)
        return [job.skey for job in jobs]

    def _prepare(
        self, key: str | bytes, value: object, namespace: str | None, spec: CodecSpec, metadata: dict[str, Any] | None
    ) -> _Job:
        """``value`` encoded as the blob ``key`` will be stored as (checked against the tiers' sizes)."""
        skey = self.storage_key(key, namespace)
        # a str key may hold lone surrogates, which no database accepts as text
        if isinstance(key, str):
            preview = key if key.isascii() else key.encode("utf-8", "backslashreplace").decode()
        else:
            preview = key.hex()
        encoded, raw = encode_value(
            value,
            spec,
            metadata,
            info={"namespace": namespace or "", "key": preview[:256], "storage_key": skey},
            blob_format=self._tiers.blob_format,
        )
        largest = self._tiers.largest
        if encoded.nbytes > largest:
            raise CapacityError(
                f"value of {encoded.nbytes} bytes (encoded) under key {preview[:80]!r} is larger "
                f"than every tier (largest: {largest} bytes); raise cpu_bytes/disk_bytes "
                "or store it compressed"
            )
        return _Job(skey, preview, namespace or "", value_kind(value), str(spec), raw, encoded, metadata or {})

    def _record(self, job: _Job, stored: Stored) -> None:
        """Queue ``job``'s catalog row (write-behind) and count it.

        Raises:
            TierUnavailable: no tier took the value (and no write-back will).
        """
        if not stored.tiers and not self.config.write_policy == "back":
            raise TierUnavailable(
                f"no tier could store key {job.preview[:80]!r}: every tier that fits "
                f"{job.encoded.nbytes} bytes is failing (see kvmem_tier_errors_total)"
            )
        self._catalog.upsert_later(
            StoreRow(
                job.skey,
                job.namespace,
                job.preview,
                job.kind,
                job.raw,
                job.encoded.nbytes,
                job.codec,
                _crc_of(stored.blob),
                stored.tiers,
                job.metadata,
            ),
            # journaled only when its bytes outlive the process (a persistent tier, or a write-back to one)
            durable=self._tiers.write_back or not self._tiers.persistent.isdisjoint(stored.tiers),
        )
        self.metrics.stored(job.raw, job.encoded.nbytes)

    def load_match(self, match: Match, default: V | None = None, *, device: torch.device | str | None = None) -> Any:
        """The value of an entry :meth:`lookup_similar` returned, or ``default`` (e.g. evicted since).

        Loads by ``match.storage_key``, so it works whatever the key's type; checked like :meth:`load`.

        Raises:
            IntegrityError: only corrupt copies were found and ``config.strict`` is set.
        """
        start = time.perf_counter()
        label = match.key if match.key is not None else match.storage_key
        loaded = self._fetch_checked(match.storage_key, label, device)
        return self._loaded(default if loaded is None else loaded.value, start)

    @serving
    def fetch(
        self, key: str | bytes, *, namespace: str | None = None, device: torch.device | str | None = None
    ) -> Loaded | None:
        """Like :meth:`load` without ``default``/``regenerate``, also telling which tier served the value.

        Returns:
            ``Loaded(value, tier, metadata)``, or ``None`` on a miss.

        Raises:
            IntegrityError: only corrupt copies were found and ``config.strict`` is set.
        """
        return self._fetch_checked(self.storage_key(key, namespace), key, device)

    def _fetch_checked(self, skey: str, key: str | bytes, device: torch.device | str | None) -> Loaded | None:
        """:meth:`_fetch`, raising when only corrupt copies of ``skey`` were found under ``config.strict``."""
        loaded, corrupt = self._fetch(skey, device)
        if loaded is None and corrupt and self.config.strict:
            raise IntegrityError(
                f"key {str(key)[:80]!r}: every stored copy failed its integrity check ({corrupt} quarantined)"
            )
        return loaded

    def _fetch(self, skey: str, device: torch.device | str | None) -> tuple[Loaded | None, int]:
        if device is None:
            plain = self._from_ram(skey, None)
            if plain is not None:
                return Loaded(plain[0], plain[2], plain[1].get("metadata", {})), 0
        fetched, corrupt = self._tiers.get(skey)
        while fetched is not None:
            try:
                value, header = decode_value(fetched.buf, device, fetched.head, copy=not fetched.owned)
                check_owner(header, skey)
            except IntegrityError as exc:
                # the copy passed its CRC, so it was written whole, but it is not this
                # key's value (a file moved onto its name, or an unreadable header): look lower.
                self._tiers.quarantine(skey, fetched.tier, exc)
                fetched, more = self._tiers.get(skey)
                corrupt += 1 + more
                continue
            self.record_hits([skey], fetched.tier, header.get("kind", "tree"))
            return Loaded(value, fetched.tier, header.get("metadata", {})), corrupt
        self.metrics.miss("unknown")
        if corrupt:
            self._catalog_write(lambda: self._catalog.set_state(skey, "quarantined"))
        return None, corrupt

    @serving
    def load(
        self,
        key: str | bytes,
        default: V | None = None,
        *,
        namespace: str | None = None,
        device: torch.device | str | None = None,
        regenerate: Callable[[], Any] | None = None,
        strict: bool | None = None,
        out: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> Any:
        """The value stored under ``key``, or ``default``.

        Every copy read from disk or a remote tier is CRC-checked (the CPU tier's pages were
        checked as they came in; ``cpu_verify`` checks them again); a corrupt copy is
        quarantined and never returned.

        Args:
            key: the key given to :meth:`store`.
            default: returned on a miss (when there is no ``regenerate``).
            namespace: the namespace given to :meth:`store`.
            device: put tensors on this device.
            regenerate: called on a miss or corruption; its result is stored and returned.
            strict: raise :class:`IntegrityError` when only corrupt copies were found
                (default: ``config.strict``).
            out: a tensor of the stored tensor's shape and dtype, of any layout and device
                (e.g. a slice of a KV cache): the value is written into it, with no other
                buffer allocated (one copy for lossless values), and ``out`` is returned.
                Or a sequence of row tensors (a scatter load, e.g. the blocks ``cache[:, b]``
                of a paged KV cache in any order): the stored tensor must be of shape
                ``[len(out), *row_shape]``; its row ``i`` is written into ``out[i]`` (a tensor
                of ``row_shape`` and the stored dtype, any layout and device), a ``None`` row
                is skipped, and the rows are returned as a list. The whole value is
                CRC-checked either way. On a miss ``out`` is left as it is, unless a
                corrupt copy was read into it first (never returned as a hit).

        Raises:
            OutputMismatch: ``out`` does not match the stored value (wrong shape or dtype, the wrong
                number of rows, a value that is not one tensor): nothing is written.
        """
        start = time.perf_counter()
        skey = self.storage_key(key, namespace)
        target = check_out(out) if out is not None else None
        if target is not None:
            hit, corrupt = self._fetch_into(skey, target)
            value: Any = target
        else:
            loaded, corrupt = self._fetch(skey, device)
            hit, value = loaded is not None, loaded.value if loaded is not None else None
        if hit:
            return self._loaded(value, start)
        if corrupt and (strict if strict is not None else self.config.strict):
            raise IntegrityError(
                f"key {str(key)[:80]!r}: every stored copy failed its integrity check ({corrupt} quarantined)"
            )
        if regenerate is not None:
            value = regenerate()
            self.store(key, value, namespace=namespace)
            return self._loaded(copy_into(target, value) if target is not None else value, start)
        return self._loaded(default, start)

    def _loaded(self, value: V, start: float) -> V:
        """``value``, its load's latency observed."""
        self.metrics.load_seconds.observe(time.perf_counter() - start)
        return value

    @serving
    def load_many(
        self,
        keys: Sequence[str | bytes],
        *,
        namespace: str | None = None,
        out: Sequence[torch.Tensor | Sequence[torch.Tensor | None]] | None = None,
        device: torch.device | str | None = None,
    ) -> list[Any]:
        """:meth:`load` for several keys: one after another on this thread when they are small (under 1 MiB),
        else several at a time: those in memory on kvmem's copy threads, the others read from their files on
        its I/O threads.

        Args:
            keys: the keys given to :meth:`store`.
            namespace: their namespace.
            out: one output per key to load into (see :meth:`load`): a tensor (e.g. a slice of a KV
                cache) or a sequence of row tensors and ``None`` (e.g. the blocks of a paged KV cache
                that one stored chunk fills); tensors and row sequences may be mixed.
            device: put tensors on this device (without ``out``).

        Returns:
            Per key: the value (with ``out``: ``out[i]`` itself, or its rows as a list), or ``None`` on a miss.

        Raises:
            OutputMismatch: ``out`` is not one output per key, or one does not match its stored value.
        """
        start = time.perf_counter()
        skeys = [self.storage_key(k, namespace) for k in keys]
        outs = [check_out(t) for t in out] if out is not None else None
        if outs is not None and len(outs) != len(skeys):
            raise OutputMismatch(
                f"out holds {len(outs)} tensors for {len(skeys)} keys: expected one per key "
                "(a tensor, or a sequence of row tensors)"
            )

        def one(i: int) -> Any:
            if outs is not None:
                return outs[i] if self._fetch_into(skeys[i], outs[i])[0] else None
            loaded = self._fetch(skeys[i], device)[0]
            return None if loaded is None else loaded.value

        top = self._tiers.tiers[0] if self._tiers.tiers else None
        near = [i for i, k in enumerate(skeys) if top is not None and not top.persistent and top.contains(k)]
        far = [i for i in range(len(skeys)) if i not in set(near)]
        values: list[Any] = [None] * len(skeys)
        for group, pool in ((near, copy_pool), (far, io_pool)):
            if not group:
                continue
            values[group[0]] = one(group[0])  # NOTE: on this thread: its size says whether the others are worth threads
            rest = group[1:]
            threaded = len(rest) > 1 and not _small(values[group[0]], None if outs is None else outs[group[0]])
            for i, value in zip(rest, pool().map(one, rest) if threaded else map(one, rest)):
                values[i] = value
        self.metrics.load_seconds.observe(time.perf_counter() - start)
        return values

    def _from_ram(self, skey: str, out: Out | None) -> tuple[Out, dict[str, Any], str] | None:
        """``skey``'s tensor copied once out of the CPU tier into ``out`` (or a new tensor), its hit counted:
        ``(tensor, header, tier)``; ``None``: not there as one tensor ``out`` can hold (the general path
        reads it, or says why not)."""
        top = self._tiers.tiers[0] if self._tiers.tiers else None
        if not isinstance(top, CpuTier):
            return None
        got = top.copy_plain(skey, out)
        if got is None:
            return None
        self.record_hits([skey], top.name, "tensor")
        return got[0], got[1], top.name

    def _fetch_into(self, skey: str, out: Out) -> tuple[bool, int]:
        """Write ``skey``'s tensor into ``out`` (a tensor or rows); ``(hit, corrupt copies found)``. A hit below
        the top tier is promoted from ``out`` (no second read) when ``out`` holds all of it (no ``None`` row)."""
        if self._from_ram(skey, out) is not None:
            return True, 0
        header, reader, corrupt = self._tiers.read(skey, lambda r: fill(r, skey, out))
        if header is None or reader is None:
            self.metrics.miss("unknown")
            if corrupt:
                self._catalog_write(lambda: self._catalog.set_state(skey, "quarantined"))
            return False, corrupt
        self.record_hits([skey], reader.tier, header.get("kind", "tree"))
        if self._tiers.promotion_targets(reader.tier):
            blob = read_back(reader, out)
            if blob is not None:
                self._tiers.promote(skey, blob, reader.tier)
        return True, corrupt


class _Job(NamedTuple):
    """One value on its way into the tiers: its key, its blob, and its catalog facts."""

    skey: str
    preview: str
    namespace: str
    kind: str
    codec: str
    raw: int
    encoded: EncodedBlob
    metadata: dict[str, Any]


def _small(value: Any, out: Out | None) -> bool:
    """Whether ``value`` (a loaded value, or ``None``: a miss) is a tensor under :data:`_THREADED_READ_BYTES`
    (with ``out``: whether what was written into ``out`` is)."""
    if value is None:
        return False
    if out is not None:
        return out_nbytes(out) < _THREADED_READ_BYTES
    return isinstance(value, torch.Tensor) and out_nbytes(value) < _THREADED_READ_BYTES


def _crc_of(blob: EncodedBlob) -> int | Callable[[], int | None]:
    """What the catalog records as ``blob``'s CRC: the CRC, or a function computing it at the catalog's flush
    (off the caller's thread) while the blob is still held by a tier."""
    return blob.crc if blob.sealed else _CrcLater(blob)


class _CrcLater:
    """``blob``'s CRC when called (``None`` once no tier holds the blob any more).

    NOTE: a slotted object and its weak reference, not a closure (four objects): what a store leaves
    behind until the flush is scanned by the garbage collector (see ``kvmem.stores.cpu._Entry``).
    """

    __slots__ = ("_blob",)

    def __init__(self, blob: EncodedBlob) -> None:
        self._blob = weakref.ref(blob)

    def __call__(self) -> int | None:
        blob = self._blob()
        return None if blob is None else blob.crc


# -- the module-level default -----------------------------------------------------------
_default: Memory | None = None
_default_lock = threading.Lock()


def default_memory() -> Memory:
    """The lazily created default ``Memory`` (embedded: CPU + disk tiers, SQLite catalog)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = Memory()
        return _default


def configure(**settings: Any) -> Memory:
    """Replace the default ``Memory`` with one built from ``settings``.

    The old one is closed first, so the new one can take its ``metrics_port``; should the new
    one fail to open, the next :func:`default_memory` call opens one from the configuration.
    """
    global _default
    with _default_lock:
        old, _default = _default, None
    if old is not None:
        old.close()
    new = Memory(**settings)
    with _default_lock:
        _default = new
    return new


@atexit.register
def _close_default() -> None:
    if _default is not None:
        _default.close()
