"""Old import path of :mod:`kvmem.catalog.records`, kept for one release; it goes in the next one.

Import from ``kvmem.catalog.records`` instead.
"""

from kvmem.catalog.records import EntryInfo, Loaded, Stats, TierStats, entry_info

__all__ = ["EntryInfo", "Loaded", "Stats", "TierStats", "entry_info"]
