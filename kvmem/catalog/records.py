"""What ``Memory`` reports: loaded values, entry facts, tier occupancy, stats snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmem.catalog.catalog import EntryRow

__all__ = ["Loaded", "EntryInfo", "TierStats", "Stats", "entry_info"]


@dataclass(frozen=True)
class Loaded:
    """A loaded value, the tier that served it, and its metadata (``Memory.fetch``)."""

    value: Any
    tier: str
    metadata: dict[str, Any]


@dataclass(frozen=True)
class EntryInfo:
    """What kvmem knows about one entry (``Memory.info``)."""

    key: str
    namespace: str
    kind: str
    size: int
    stored_size: int
    codec: str
    version: int
    tiers: list[str]
    hits: int
    created: float
    last_access: float
    metadata: dict[str, Any]
    user_key: str = ""  # the key given to store() (first 256 characters; bytes keys as hex)


@dataclass(frozen=True)
class TierStats:
    """One tier's occupancy."""

    name: str
    usage: int
    capacity: int
    entries: int
    healthy: bool


@dataclass(frozen=True)
class Stats:
    """A snapshot of a ``Memory``: catalog totals, tiers, and counters since start."""

    entries: int
    size: int
    stored_size: int
    tiers: list[TierStats]
    hits: int
    misses: int
    hit_rate: float
    crc_failures: int
    tier_errors: int
    evictions: int
    demotions: int
    recorded_hits: int = 0  # hits the catalog recorded over its lifetime, by every process


def entry_info(row: EntryRow, tiers: list[str]) -> EntryInfo:
    """The public view of a catalog row (``tiers``: where it is held now, else where it was written)."""
    return EntryInfo(
        key=row.key,
        namespace=row.namespace,
        kind=row.kind,
        size=row.size,
        stored_size=row.stored_size,
        codec=row.codec,
        version=row.version,
        tiers=tiers or [t for t in row.tiers.split(",") if t],
        hits=row.hits,
        created=row.created,
        last_access=row.last_access,
        metadata=row.metadata,
        user_key=row.user_key,
    )
