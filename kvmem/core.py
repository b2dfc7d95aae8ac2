"""``MemoryCore``: what every part of :class:`~kvmem.api.Memory` builds on.

A memory's tiers, catalog, pinned versions and semantic indexes, opened and closed; the ports of the
feature layers (:mod:`kvmem.ports`); and the operations on entries that are neither the data path
(``store``/``load``, in :mod:`kvmem.api`) nor a layer's (semantic lookup, :mod:`kvmem.lookup`;
maintenance, :mod:`kvmem.ops.maintenance`). ``Memory`` is this class with those mixed in.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

import torch
from prometheus_client import CollectorRegistry
from sqlalchemy.exc import SQLAlchemyError

from kvmem import blob as blobfmt
from kvmem.activity import Activity
from kvmem.catalog.catalog import Catalog
from kvmem.catalog.versions import Pin, Versions
from kvmem.codecs import parse_codec
from kvmem.codecs.serialization import decode_value, encode_value
from kvmem.config import Config, load_config
from kvmem.errors import ConfigError
from kvmem.keys import storage_key
from kvmem.metrics import Exporter, Metrics
from kvmem.ports import ChunkStore, Database
from kvmem.stores import CpuTier, TieredStore, build_tiers

if TYPE_CHECKING:  # kvmem.semantic loads only when a text is stored or looked up
    from kvmem.semantic import Embedder, SemanticIndex

__all__ = ["Flushable", "MemoryCore"]

log = logging.getLogger(__name__)
V = TypeVar("V")
_CATALOG_FLUSH_SECONDS = 1.0


class Flushable(Protocol):
    """A queue of background work that :meth:`MemoryCore.flush` waits for."""

    def flush(self) -> None: ...


class MemoryCore:
    """A memory's state and its operations besides the data path and the layers'; see
    :class:`~kvmem.api.Memory` for the arguments (it is this class with those mixed in)."""

    def __init__(
        self,
        path: str | None = None,
        *,
        config: Config | None = None,
        config_file: str | None = None,
        registry: CollectorRegistry | None = None,
        embedder: Embedder | None = None,
        **settings: Any,
    ) -> None:
        if path is not None:
            settings["path"] = path
        self.config = config.replace(**settings) if config is not None else load_config(config_file, **settings)
        self.metrics = Metrics(registry)
        self.activity = Activity()
        """Requests in flight (``load``, ``load_many``, ``fetch``, ``store``, ``store_many``), counted once a
        predictive prefetcher watches: its copies wait for none (see :mod:`kvmem.activity`)."""
        self._embedder = embedder
        self._semantics: dict[str, SemanticIndex] = {}  # "" -> the text layer; else an embedder's name
        self._writers: weakref.WeakSet[Flushable] = weakref.WeakSet()  # stores queued by caches over this memory
        self._semantic_lock = threading.Lock()
        self._recovered: set[str] = set()  # labels of damaged metadata files set aside while opening
        self._catalog = Catalog(
            self.config.resolved_catalog_url,
            flush_seconds=_CATALOG_FLUSH_SECONDS,
            on_error=self._catalog_failed,
            journal=Path(self.config.path) / "catalog-pending",
            on_recovered=self._file_recovered,
        )
        self._tiers = TieredStore(
            build_tiers(self.config, self._file_recovered),
            self.metrics,
            offload_threshold=self.config.offload_threshold,
            write_policy=self.config.write_policy,
            queue_size=self.config.write_back_queue,
            retry_seconds=self.config.tier_retry_seconds,
            on_removed=self._removed,
        )
        self._versions = Versions(self._catalog, self._tiers, self.config.pin_lease_seconds)
        self._closed = False
        if self._recovered & {"catalog", "journal"}:  # rows the damaged file held, read off the blobs
            from kvmem.ops.maintenance import register_orphans  # late: it holds Memory's maintenance mixin

            self._catalog_write(lambda: register_orphans(self._tiers, self._catalog))
        self._exporter: Exporter | None = None
        if self.config.metrics_port is not None:
            try:
                self._exporter = Exporter(self.metrics.registry, self.config.metrics_host, self.config.metrics_port)
            except ConfigError:
                self.close()
                raise

    @property
    def metrics_url(self) -> str | None:
        """Where this process serves this memory's ``/metrics`` (``metrics_port`` set), else ``None``."""
        return None if self._exporter is None else self._exporter.url

    # -- ports of the feature layers (kvmem.ports) --------------------------------------
    @property
    def database(self) -> Database:
        """The catalog's database, for tables kept beside the entry rows (agent steps, LangGraph items)."""
        return self._catalog

    def chunk_store(self) -> ChunkStore:
        """This memory's tiers as the KV loader reads them: by storage key, through the tiers' failure handling."""
        return ChunkStore(self._tiers)

    def record_hits(self, skeys: Sequence[str], tier: str, kind: str = "tree") -> None:
        """Count a hit on each of ``skeys`` (storage keys) served by tier ``tier`` outside :meth:`~kvmem.Memory.load`:
        in ``kvmem_hits_total{tier, kind}`` and the entries' catalog hit counts (buffered); a predictive
        prefetch guess among them counts as used."""
        for skey in skeys:
            self.metrics.hit(tier, kind)
            self._catalog.record_hit(skey)
        self._tiers.note_hits(skeys, tier)

    # -- keys -----------------------------------------------------------------
    def storage_key(self, key: str | bytes, namespace: str | None = None) -> str:
        """The storage key ``key`` maps to in ``namespace`` (under this config's tenant salt)."""
        return storage_key(key, namespace, self.config.tenant_salt)

    # -- host pages, pins, presence ------------------------------------------------
    def lease_host(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of the CPU tier's pool as one uint8 tensor (pinned when CUDA is present), for host
        memory that should share the tier's budget (``OffloadingCache(memory=...)``'s pages).

        The pages count in the CPU tier's usage until the tensor and its views are gone.

        Returns:
            The tensor, or ``None``: no CPU tier, or no free run of pages that long.
        """
        cpu = next((t for t in self._tiers.tiers if isinstance(t, CpuTier)), None)
        return None if cpu is None else cpu.lease(nbytes)

    def pin(self, key: str | bytes, *, namespace: str | None = None, lease: float | None = None) -> Pin | None:
        """Pin the current version of ``key``: ``pin.load()`` returns it until ``pin.release()``.

        Writers go on storing new versions meanwhile (plain :meth:`~kvmem.Memory.load` returns the newest);
        the pinned one is kept in the catalog database, so every node sharing the catalog keeps
        it, until no live pin holds it (released, or the lease of a process that died expired).

        Args:
            key: the key given to :meth:`~kvmem.Memory.store`.
            namespace: the namespace given to :meth:`~kvmem.Memory.store`.
            lease: seconds the pin survives its holder without renewal (default ``config.pin_lease_seconds``;
                renewed every third of it while this memory is open).

        Returns:
            A :class:`~kvmem.catalog.versions.Pin` (a context manager), or ``None`` when ``key`` is not stored.

        Raises:
            TierUnavailable: the catalog cannot be reached (pins live there).
        """
        return self._versions.pin(self.storage_key(key, namespace), lease)

    def contains_many(self, keys: Sequence[str | bytes], *, namespace: str | None = None) -> list[bool]:
        """:meth:`contains` for several keys, with one batched call per tier."""
        return self._tiers.contains_many([self.storage_key(k, namespace) for k in keys])

    def locate_many(self, keys: Sequence[str | bytes], *, namespace: str | None = None) -> list[str | None]:
        """The fastest tier holding each of ``keys`` (``"gpu"``, ``"cpu"``, ``"disk"``, ``"redis"``), or ``None``
        where none does: one batched call per tier (the CRC is checked only when loaded)."""
        return self._tiers.locate_many([self.storage_key(k, namespace) for k in keys])

    def contains(self, key: str | bytes, *, namespace: str | None = None) -> bool:
        """Whether ``key`` is stored in some tier (its CRC is checked only when loaded)."""
        return self._tiers.contains(self.storage_key(key, namespace))

    def delete(self, key: str | bytes, *, namespace: str | None = None) -> bool:
        """Remove ``key`` from every tier and the catalog; whether it was there (a store of it queued before,
        by a cache over this memory, is done first: a deleted key does not come back)."""
        skey = self.storage_key(key, namespace)
        self._flush_writers()
        found = self._tiers.delete(skey)
        removed = self._catalog_write(lambda: self._catalog.delete(skey))
        for index in self._semantic_indexes():
            index.remove(skey)
        if not self._semantics:
            from kvmem.semantic.layer import forget

            self._catalog_write(lambda: forget(self._catalog, skey))
        return found or removed is True

    # -- compress ---------------------------------------------------------------
    def compress(self, value: object, codec: str | None = None) -> bytes:
        """Encode ``value`` as a self-describing blob (``codec`` default: ``config.compression``)."""
        encoded, _ = encode_value(value, parse_codec(codec or self.config.compression))
        return b"".join(p.tobytes() for p in encoded.parts)

    @staticmethod
    def decompress(data: bytes | bytearray | memoryview) -> Any:
        """Decode a blob made by :meth:`compress` (CRC-checked).

        Raises:
            IntegrityError: ``data`` is not an intact kvmem blob.
        """
        buf = blobfmt.empty_buffer(len(data))
        buf.numpy()[:] = memoryview(data).cast("B")
        value, _ = decode_value(buf, head=blobfmt.verify(buf))
        return value

    # -- lifecycle -------------------------------------------------------------------
    def add_writer(self, writer: Flushable) -> None:
        """Flush ``writer`` (a cache's queue of background stores into this memory) in :meth:`flush` and before
        :meth:`close`, so a store queued before either is never lost. Held weakly."""
        self._writers.add(writer)

    def flush(self) -> None:
        """Finish queued background stores and write-backs, fsync pending files, write buffered catalog updates."""
        self._flush_writers()
        self._tiers.flush()
        self._catalog_write(self._catalog.flush)
        for index in self._semantic_indexes():
            self._catalog_write(index.flush)

    def close(self) -> None:
        """Flush and release everything. Idempotent."""
        if self._closed:
            return
        self._flush_writers()
        self._closed = True
        if self._exporter is not None:
            self._exporter.close()
        self._versions.close()
        self._tiers.close()
        for index in self._semantic_indexes():
            self._catalog_write(index.flush)
        self._catalog_write(self._catalog.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------
    @property
    def _sees_every_entry(self) -> bool:
        """Whether this memory's tiers hold every entry its catalog lists: a catalog of its own, or a
        shared catalog with a shared remote tier. Otherwise a row whose entry no tier here holds may be
        another node's, and is never reaped from here (gc, verify --fix, evictions, semantic reopen)."""
        return self.config.catalog_url is None or self.config.remote_url is not None

    def _file_recovered(self, file: str) -> None:
        """A damaged metadata file was set aside (see :mod:`kvmem.recovery`): count it, rebuild what it held."""
        self._recovered.add(file)
        self.metrics.recovered(file)

    def _removed(self, skey: str) -> None:
        """An entry left its last tier (evicted): forget its catalog row (when ours alone) and its vector."""
        if self._sees_every_entry:
            self._catalog.record_removed(skey)
        for index in self._semantic_indexes():
            index.discard(skey)

    def _flush_writers(self) -> None:
        for writer in list(self._writers):
            writer.flush()

    def _semantic_indexes(self) -> list[SemanticIndex]:
        # NOTE: no _semantic_lock: evictions call this holding tier locks, which an index being
        # built under that lock may wait for (live=contains_many); list() of a dict is atomic
        return list(self._semantics.values())

    def _catalog_write(self, fn: Callable[[], V]) -> V | None:
        """Run a catalog operation; a database failure is counted and logged, never raised."""
        try:
            return fn()
        except SQLAlchemyError as exc:
            self._catalog_failed(exc)
            return None

    def _catalog_failed(self, exc: SQLAlchemyError) -> None:
        """Count and log a database failure (also one of the catalog's background flushes)."""
        self.metrics.tier_errors.labels(tier="catalog").inc()
        log.warning("kvmem: catalog operation failed (%s); the data path goes on without it", exc)
