"""Old import path of :mod:`kvmem.cli.doctor_snapshot`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.doctor_snapshot`` instead.
"""

from kvmem.cli.doctor_snapshot import (
    HistogramSummary,
    KVChunkGroup,
    LiveMetrics,
    Snapshot,
    TierState,
    kv_block_size,
    take_snapshot,
)

__all__ = ["HistogramSummary", "KVChunkGroup", "LiveMetrics", "Snapshot", "TierState", "kv_block_size", "take_snapshot"]
