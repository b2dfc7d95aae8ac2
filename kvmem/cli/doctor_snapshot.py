"""What ``kvmem doctor`` looks at: a frozen snapshot of a data directory and, in-process, its metrics.

The snapshot is plain data so that the rules in :mod:`kvmem.cli.doctor` are pure
functions, tested on hand-built snapshots. :func:`take_snapshot` fills one from
a live :class:`~kvmem.Memory`:

- what persists (catalog rows aggregated per namespace, tier usage and
  capacity, files in quarantine, damaged metadata files set aside, the
  config): all a command line can see;
- the Prometheus counters of this process (``live``), only when asked, since a
  freshly opened ``Memory`` has counted nothing yet.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prometheus_client.samples import Sample
from sqlalchemy import case, func, select
from sqlalchemy.exc import SQLAlchemyError

from kvmem.api import Memory
from kvmem.catalog.schema import entries
from kvmem.config import Config
from kvmem.errors import TierUnavailable
from kvmem.metrics import Metrics
from kvmem.recovery import set_aside_files
from kvmem.rows import STREAMABLE, STREAMING
from kvmem.stores import DiskTier
from kvmem.stores.areas import AreaState

__all__ = ["HistogramSummary", "KVChunkGroup", "LiveMetrics", "Snapshot", "TierState", "take_snapshot", "kv_block_size"]


@dataclass(frozen=True)
class HistogramSummary:
    """Count, sum and 90th percentile (bucket upper bound) of a Prometheus histogram."""

    count: int = 0
    total: float = 0.0
    p90: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass(frozen=True)
class LiveMetrics:
    """This process's counters (per tier where the metric has a ``tier`` label)."""

    ttft: HistogramSummary = HistogramSummary()
    prefetch: HistogramSummary = HistogramSummary()
    store: HistogramSummary = HistogramSummary()
    load: HistogramSummary = HistogramSummary()
    kv_tokens: dict[str, int] = field(default_factory=dict)  # requested | reused | computed
    chunk_hits: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    demotions: dict[str, int] = field(default_factory=dict)
    promotions: dict[str, int] = field(default_factory=dict)
    crc_failures: dict[str, int] = field(default_factory=dict)
    tier_errors: dict[str, int] = field(default_factory=dict)
    predictive: dict[str, int] = field(default_factory=dict)  # predictive prefetch decisions, by outcome
    predictive_bytes: dict[str, int] = field(default_factory=dict)  # warmed | used | wasted
    predictive_cpu_seconds: float = 0.0  # the prefetcher's model and copies


@dataclass(frozen=True)
class TierState:
    """One tier's occupancy and kind."""

    name: str
    usage: int
    capacity: int
    entries: int
    healthy: bool = True
    persistent: bool = False  # disk, remote: slower than the memory tiers above them


@dataclass(frozen=True)
class KVChunkGroup:
    """Catalog rows of KV prefix chunks stored with one ``block_size`` (all models and tenants)."""

    block_size: int
    chunks: int
    stored_bytes: int
    reused: int = 0  # chunks loaded at least once
    reused_bytes: int = 0
    hits: int = 0
    re_stored: int = 0  # version > 1: computed and stored again while stored


Copies = Literal["streaming", "not built", "no streaming stores"]
"""Large host copies: with streaming stores; through torch because ``kvmem._stream`` was not built; through torch
because the machine has no streaming stores kvmem uses (not x86-64)."""


@dataclass(frozen=True)
class Snapshot:
    """Everything the doctor's rules read."""

    config: Config
    tiers: tuple[TierState, ...] = ()
    entries: int = 0
    stored_bytes: int = 0
    hot_entries: int = 0  # entries loaded at least once
    hot_bytes: int = 0
    quarantined_rows: int = 0
    quarantine_files: int = 0
    quarantine_bytes: int = 0
    kv: tuple[KVChunkGroup, ...] = ()
    live: LiveMetrics | None = None
    disk_areas: AreaState | None = None  # the disk tier's areas (a blob-format migration under way?)
    set_aside: tuple[str, ...] = ()  # damaged metadata files moved aside and rebuilt (see kvmem.recovery)
    copies: Copies = "streaming"  # how this installation copies large host buffers (see kvmem.rows.stream_copy)

    def tier(self, name: str) -> TierState | None:
        return next((t for t in self.tiers if t.name == name), None)


def kv_block_size(namespace: str) -> int | None:
    """The block size in a PrefixCache namespace ``kv/<model>/<dtype>/<codec>/<block>/<tenant>``, else ``None``."""
    parts = namespace.split("/")
    if len(parts) < 6 or parts[0] != "kv" or not parts[4].isdigit():
        return None
    return int(parts[4])


def take_snapshot(memory: Memory, *, live: bool = True) -> Snapshot:
    """Read the catalog, tiers and quarantine of ``memory`` (and its metrics when ``live``).

    Raises:
        TierUnavailable: the catalog cannot be read.
    """
    stats = memory.stats()  # flushes buffered catalog hits first
    held = memory._tiers.tiers  # an operator's tool beside the core reads the tiers themselves
    persistent = {t.name: t.persistent for t in held}
    tiers = tuple(
        TierState(t.name, t.usage, t.capacity, t.entries, t.healthy, persistent.get(t.name, False)) for t in stats.tiers
    )
    files = [p for t in held for p in _quarantined(t)]
    totals, kv = _catalog_facts(memory)
    disk = next((t for t in held if isinstance(t, DiskTier)), None)
    root = Path(memory.config.path)
    return Snapshot(
        config=memory.config,
        tiers=tiers,
        quarantine_files=len(files),
        quarantine_bytes=sum(_size(p) for p in files),
        kv=kv,
        live=_live(memory.metrics) if live else None,
        disk_areas=disk.areas if disk is not None else None,
        set_aside=tuple(str(p.relative_to(root)) for p in set_aside_files(root)),
        copies="streaming" if STREAMING else "not built" if STREAMABLE else "no streaming stores",
        **totals,
    )


def _quarantined(tier: object) -> list[Path]:
    """Quarantined copies kept as files (the disk tier's); Redis names its quarantined keys, which have no file."""
    return list(tier.quarantined()) if isinstance(tier, DiskTier) else []


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # purged by another process meanwhile
        return 0


def _catalog_facts(memory: Memory) -> tuple[dict[str, int], tuple[KVChunkGroup, ...]]:
    """Catalog totals and KV chunk groups, from one aggregate query grouped by namespace."""
    hot = entries.c.hits > 0
    stmt = select(
        entries.c.namespace,
        func.count(),
        func.coalesce(func.sum(entries.c.stored_size), 0),
        func.sum(case((hot, 1), else_=0)),
        func.sum(case((hot, entries.c.stored_size), else_=0)),
        func.coalesce(func.sum(entries.c.hits), 0),
        func.sum(case((entries.c.version > 1, 1), else_=0)),
        func.sum(case((entries.c.state == "quarantined", 1), else_=0)),
    ).group_by(entries.c.namespace)
    try:
        with memory.database.connection() as conn:
            rows = [(str(r[0]), [int(v or 0) for v in r[1:]]) for r in conn.execute(stmt)]
    except SQLAlchemyError as exc:
        raise TierUnavailable(f"the catalog cannot be read: {exc.__class__.__name__}: {exc}") from None
    totals = {"entries": 0, "stored_bytes": 0, "hot_entries": 0, "hot_bytes": 0, "quarantined_rows": 0}
    groups: dict[int, list[int]] = {}
    for namespace, (n, stored, reused, reused_bytes, hits, re_stored, quarantined) in rows:
        for name, value in zip(totals, (n, stored, reused, reused_bytes, quarantined)):
            totals[name] += value
        block = kv_block_size(namespace)
        if block is not None:
            acc = groups.setdefault(block, [0] * 6)
            for i, value in enumerate((n, stored, reused, reused_bytes, hits, re_stored)):
                acc[i] += value
    kv = tuple(KVChunkGroup(block, *acc) for block, acc in sorted(groups.items()))
    return totals, kv


def _live(m: Metrics) -> LiveMetrics:
    return LiveMetrics(
        ttft=_histogram(m, "kvmem_ttft_seconds"),
        prefetch=_histogram(m, "kvmem_prefetch_latency_seconds"),
        store=_histogram(m, "kvmem_store_seconds"),
        load=_histogram(m, "kvmem_load_seconds"),
        kv_tokens=_by_label(m, "kvmem_kv_tokens_total", "kind"),
        chunk_hits=_by_label(m, "kvmem_kv_chunk_hits_total", "tier"),
        evictions=_by_label(m, "kvmem_evictions_total", "tier"),
        demotions=_by_label(m, "kvmem_demotions_total", "tier"),
        promotions=_by_label(m, "kvmem_promotions_total", "tier"),
        crc_failures=_by_label(m, "kvmem_crc_failures_total", "tier"),
        tier_errors=_by_label(m, "kvmem_tier_errors_total", "tier"),
        predictive=_by_label(m, "kvmem_predictive_prefetch_total", "outcome"),
        predictive_bytes=_by_label(m, "kvmem_predictive_prefetch_bytes_total", "outcome"),
        predictive_cpu_seconds=sum(s.value for s in _samples(m, "kvmem_predictive_prefetch_cpu_seconds_total")),
    )


def _by_label(m: Metrics, sample: str, label: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in _samples(m, sample):
        out[s.labels[label]] = out.get(s.labels[label], 0) + int(s.value)
    return out


def _samples(m: Metrics, sample: str) -> Iterator[Sample]:
    """The non-zero samples named ``sample``."""
    return (s for family in m.registry.collect() for s in family.samples if s.name == sample and s.value)


def _histogram(m: Metrics, name: str) -> HistogramSummary:
    """Count, sum and the upper bound of the bucket holding the 90th percentile."""
    buckets: list[tuple[float, float]] = []
    for family in m.registry.collect():
        for s in family.samples:
            if s.name == f"{name}_bucket":
                buckets.append((float(s.labels["le"]), s.value))
    count = int(m.value(f"{name}_count"))
    if not count:
        return HistogramSummary()
    buckets.sort()
    p90 = next((le for le, cumulative in buckets if cumulative >= 0.9 * count), math.inf)
    if math.isinf(p90):  # beyond the last finite bucket: report that bound (or the mean, if larger)
        p90 = max(max((le for le, _ in buckets if not math.isinf(le)), default=0.0), m.value(f"{name}_sum") / count)
    return HistogramSummary(count, m.value(f"{name}_sum"), p90)
