"""Integrity scrub (``verify``) and garbage collection (``gc``) over tiers and catalog."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tqdm import tqdm

from kvmem import blob as blobfmt
from kvmem.catalog import Catalog
from kvmem.codecs.pipeline import check_owner
from kvmem.errors import IntegrityError
from kvmem.metrics import Metrics
from kvmem.stores.tiered import TieredStore

__all__ = ["VerifyReport", "GcReport", "verify_entries", "collect_garbage"]

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


def verify_entries(store: TieredStore, catalog: Catalog, metrics: Metrics, *, fix: bool = False,
                   progress: bool = True, reap: bool = True) -> VerifyReport:
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
            # NOTE: a scrub checks the CPU tier's pages too, which its loads trust (see kvmem.stores.cpu)
            header = _check(buf.cpu() if buf.device.type != "cpu" else buf, tier.checks_crc or tier.shares_buffers,
                            key)
        except IntegrityError as exc:
            report.corrupt.append((tier.name, key, str(exc)))
            metrics.crc_failures.labels(tier=tier.name).inc()
            if fix:
                tier.quarantine(key)
            continue
        held.add(key)
        if key not in known and key not in report.orphans:
            report.orphans.append(key)
            if fix:
                info = header.get("info", {})
                catalog.upsert(key, namespace=info.get("namespace", ""), user_key=info.get("key", ""),
                               kind=header.get("kind", "tree"), size=int(header.get("raw_nbytes", 0)),
                               stored_size=buf.numel(), codec=header.get("codec", "none"),
                               crc=blobfmt.stored_crc(buf.cpu()), tiers=[tier.name],
                               metadata=header.get("metadata", {}))
    for key in sorted(known - held) if reap else []:
        if not store.contains(key):
            report.missing.append(key)
            if fix:
                catalog.delete(key)
    return report


def collect_garbage(store: TieredStore, catalog: Catalog, reap: bool = True) -> GcReport:
    """Drop catalog rows no tier backs (with ``reap``), delete quarantined files, bring tiers under their thresholds."""
    report = GcReport()
    for key in list(catalog.keys()) if reap else []:
        if not store.contains(key):
            report.rows_removed += int(catalog.delete(key))
    for tier in store.tiers:
        report.quarantine_bytes_freed += tier.purge_quarantine()
        store.enforce_threshold(tier)
    catalog.flush()
    return report
