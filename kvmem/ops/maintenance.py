"""Integrity scrub (``verify``) and garbage collection (``gc``) over tiers and catalog, and
:class:`Maintenance`: the memory's operations built on them (``Memory.verify``, ``gc``, ``migrate``,
``stats``, ``info``, ``entries``), mixed into :class:`~kvmem.api.Memory`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvmem import blob as blobfmt
from kvmem.catalog.catalog import Catalog, StoreRow
from kvmem.catalog.records import EntryInfo, Stats, TierStats, entry_info
from kvmem.codecs.serialization import check_owner
from kvmem.core import MemoryCore
from kvmem.errors import ConfigError, IntegrityError, TierUnavailable
from kvmem.metrics import Metrics
from kvmem.ops.migrate import MigrationReport, migrate_disk
from kvmem.stores.base import StorageTier
from kvmem.stores.disk import DiskTier
from kvmem.stores.tiered import TieredStore

__all__ = ["VerifyReport", "GcReport", "Maintenance", "verify_entries", "collect_garbage", "register_orphans"]

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    """What ``verify`` found.

    Attributes:
        checked: tier copies read and checked.
        corrupt: ``(tier, key, reason)`` of copies that failed (quarantined when fixed).
        orphans: keys held by a tier but missing from the catalog (re-registered when fixed).
        missing: catalog keys no tier holds (rows dropped when fixed).
        fixed: whether problems were repaired.
    """

    checked: int = 0
    corrupt: list[tuple[str, str, str]] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    fixed: bool = False

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.orphans or self.missing)


@dataclass
class GcReport:
    """What ``gc`` reclaimed."""

    rows_removed: int = 0
    quarantine_bytes_freed: int = 0
    versions_reclaimed: int = 0  # kept copies of pinned versions no live pin holds (Memory.gc)


def _check(buf: object, checks_crc: bool, key: str) -> blobfmt.Header:
    assert hasattr(buf, "numel")
    if checks_crc:
        blobfmt.verify(buf)  # type: ignore[arg-type]
    header, _ = blobfmt.parse(buf)  # type: ignore[arg-type]
    check_owner(header, key)
    return header


def verify_entries(
    store: TieredStore,
    catalog: Catalog,
    metrics: Metrics,
    *,
    fix: bool = False,
    progress: bool = True,
    reap: bool = True,
) -> VerifyReport:
    """Read every copy in every tier, check CRC and framing, and compare with the catalog.

    ``reap=False``: catalog rows no tier here backs are neither reported nor dropped (a shared catalog
    whose other nodes hold them).
    """
    report = VerifyReport(fixed=fix)
    known = set(catalog.keys())
    held: set[str] = set()
    work = [(tier, key) for tier in store.tiers for key in tier.keys()]
    for tier, key in tqdm(work, desc="kvmem verify", unit="entry", disable=not progress):
        buf = tier.get(key)
        if buf is None:
            continue  # removed while we ran
        report.checked += 1
        try:
            # a scrub checks the CPU tier's pages too, which its loads trust (see kvmem.stores.cpu)
            header = _check(buf.cpu() if buf.device.type != "cpu" else buf, not store.capabilities(tier).trusted, key)
        except IntegrityError as exc:
            report.corrupt.append((tier.name, key, str(exc)))
            metrics.crc_failures.labels(tier=tier.name).inc()
            if fix:
                store.quarantine_copy(tier, key)
            continue
        held.add(key)
        if key not in known and key not in report.orphans:
            report.orphans.append(key)
            if fix:
                _register(catalog.upsert, key, header, buf.numel(), blobfmt.stored_crc(buf.cpu()), tier.name)
    for key in sorted(known - held) if reap else []:
        if not store.contains(key):
            report.missing.append(key)
            if fix:
                catalog.delete(key)
    return report


def register_orphans(store: TieredStore, catalog: Catalog) -> int:
    """Give every entry the tiers hold and the catalog lacks its row, read off its blob's header alone.

    What rebuilds a catalog set aside as damaged, or the rows of a damaged journal's lines
    (see :mod:`kvmem.recovery`): one header read per entry, no payload read; a blob whose
    header is not intact is left to its first load, which quarantines it.

    Returns:
        The rows registered.

    Raises:
        SQLAlchemyError: the catalog failed.
    """
    catalog.flush()  # NOTE: rows replayed from journals are written first: their entries are no orphans
    known = set(catalog.keys())
    registered = 0
    for tier in store.tiers:
        for key in [k for k in _keys(tier) if k not in known]:
            try:
                reader = store.open_blob(key, tier)
            except (IntegrityError, OSError) as exc:  # a damaged or unreadable blob: not this scan's to fix
                log.warning("kvmem: entry %s in tier %s not registered (%s)", key, tier.name, exc)
                continue
            if reader is None:
                continue  # removed while we ran
            with reader:
                head = torch.from_numpy(reader.head_bytes())
                size = reader.start + int(reader.header["payload_nbytes"])
                _register(catalog.upsert_later, key, reader.header, size, blobfmt.stored_crc(head), tier.name)
            known.add(key)
            registered += 1
    catalog.flush()
    log.warning("kvmem: %d catalog rows rebuilt from blob headers", registered)
    return registered


def _keys(tier: StorageTier) -> list[str]:
    """``tier``'s keys; none from a tier that fails (it is skipped, as the data path skips it)."""
    try:
        return list(tier.keys())
    except (OSError, TierUnavailable) as exc:
        log.warning("kvmem: tier %s cannot list its entries (%s); its rows are not rebuilt", tier.name, exc)
        return []


def _register(
    write: Callable[..., object], key: str, header: blobfmt.Header, stored_size: int, crc: int, tier: str
) -> None:
    """Write ``key``'s catalog row from its blob's header with ``write`` (``catalog.upsert`` or ``upsert_later``)."""
    info = header.get("info", {})
    write(
        StoreRow(
            key,
            namespace=info.get("namespace", ""),
            user_key=info.get("key", ""),
            kind=header.get("kind", "tree"),
            size=int(header.get("raw_nbytes", 0)),
            stored_size=stored_size,
            codec=header.get("codec", "none"),
            crc=crc,
            tiers=[tier],
            metadata=header.get("metadata", {}),
        )
    )


def collect_garbage(store: TieredStore, catalog: Catalog, reap: bool = True) -> GcReport:
    """Drop catalog rows no tier backs (with ``reap``), delete quarantined files, bring tiers under their thresholds."""
    report = GcReport()
    for key in list(catalog.keys()) if reap else []:
        if not store.contains(key):
            report.rows_removed += int(catalog.delete(key))
    for tier in store.tiers:
        report.quarantine_bytes_freed += store.purge_quarantine(tier)
        store.enforce_threshold(tier)
    catalog.flush()
    return report


class Maintenance(MemoryCore):
    """Catalog facts, totals, scrub, garbage collection and format migration (a part of
    :class:`~kvmem.api.Memory`)."""

    def info(self, key: str | bytes, *, namespace: str | None = None) -> EntryInfo | None:
        """Catalog facts about ``key`` and the tiers that hold it now, or ``None`` (also when the catalog is down)."""
        skey = self.storage_key(key, namespace)
        self._catalog_write(self._catalog.flush_all)
        row = self._catalog_write(lambda: self._catalog.get(skey))
        if row is None:
            return None
        return entry_info(row, self._tiers.holders(skey))

    def stats(self) -> Stats:
        """Catalog totals, tier occupancy and counters since this instance started."""
        self._catalog_write(self._catalog.flush_all)
        totals = self._catalog_write(self._catalog.totals) or {"entries": 0, "size": 0, "stored_size": 0, "hits": 0}
        m = self.metrics
        hits, misses = int(m.total("kvmem_hits_total")), int(m.total("kvmem_misses_total"))
        tiers = [
            TierStats(t.name, t.usage(), t.capacity, self._tiers.entry_count(t), self._tiers.healthy(t))
            for t in self._tiers.tiers
        ]
        return Stats(
            entries=totals["entries"],
            size=totals["size"],
            stored_size=totals["stored_size"],
            tiers=tiers,
            hits=hits,
            misses=misses,
            hit_rate=hits / (hits + misses) if hits + misses else 0.0,
            crc_failures=int(m.total("kvmem_crc_failures_total")),
            tier_errors=int(m.total("kvmem_tier_errors_total")),
            evictions=int(m.total("kvmem_evictions_total")),
            demotions=int(m.total("kvmem_demotions_total")),
            recorded_hits=totals["hits"],
        )

    def verify(self, fix: bool = False, progress: bool = True) -> VerifyReport:
        """Read every entry in every tier and check it; with ``fix``, quarantine and repair the catalog."""
        self.flush()
        return verify_entries(
            self._tiers, self._catalog, self.metrics, fix=fix, progress=progress, reap=self._sees_every_entry
        )

    def gc(self) -> GcReport:
        """Drop catalog rows of entries no tier holds, empty the quarantine, enforce capacities,
        reclaim pinned versions no live pin holds any more.

        With a catalog shared by nodes that keep their entries in tiers of their own (no shared
        ``remote_url``), rows of entries not held here are left: another node may hold them.
        """
        self.flush()
        report = collect_garbage(self._tiers, self._catalog, reap=self._sees_every_entry)
        report.versions_reclaimed = self._catalog_write(self._versions.collect) or 0
        return report

    def migrate(self, to_format: int, progress: bool = True) -> MigrationReport:
        """Rewrite the disk tier's entries in blob format ``to_format`` while they are served (resumable).

        Entries go hottest first into a second area, which then becomes the active one;
        meanwhile every entry stays readable from this and other processes. See :mod:`kvmem.ops.migrate`.

        Raises:
            ConfigError: no disk tier, an unknown format, or a migration to another format under way.
        """
        disk = next((t for t in self._tiers.tiers if isinstance(t, DiskTier)), None)
        if disk is None:
            raise ConfigError(
                f"migrate: {self.config.path} has no disk tier (disk_bytes=0); only disk blobs "
                "have a format to migrate (the others are read in every format)"
            )
        self.flush()  # buffered hits count in the hottest-first order
        return migrate_disk(disk, self._catalog, to_format, progress)

    def entries(self, namespace: str | None = None, limit: int | None = None) -> Iterator[EntryInfo]:
        """Catalog entries, most recently used first (none while the catalog is down)."""
        self._catalog_write(self._catalog.flush_all)
        for row in self._catalog_write(lambda: self._catalog.rows(namespace, limit)) or []:
            yield entry_info(row, [])
