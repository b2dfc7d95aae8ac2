"""The connector's numbers in vLLM's metrics: each worker's counts since its last report
(:class:`KVMemStats`, vLLM's ``get_kv_connector_stats``), summed over workers and steps, logged by vLLM
and exported on the server's ``/metrics`` (:class:`KVMemPromMetrics`) as ``vllm:kvmem_*``.

Every number is a counter, summed when vLLM aggregates workers and steps (a block is loaded and saved by
every tensor-parallel rank, one shard each: the block counters count shards), except ``saves_pending``: the
most blocks one worker had queued for saving, not stored yet, at the end of a step of the interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

__all__ = ["COUNTERS", "TIERS", "KVMemPromMetrics", "KVMemStats", "since"]

TIERS = ("cpu", "disk", "redis")  # where a worker's loads were served from (kvmem's tier names)

# name -> what it counts; exported as vllm:kvmem_<name>_total
COUNTERS = {
    "loaded_blocks": "vLLM blocks loaded from kvmem into the KV cache",
    "loaded_async_blocks": "blocks loaded asynchronously, or tried (their request waited while others ran)",
    "failed_blocks": "blocks whose load failed (CRC, tier, a value that does not fit) and vLLM recomputed",
    "loaded_bytes": "bytes loaded into the KV cache",
    "load_seconds": "seconds spent loading before forward passes (synchronous loads)",
    "async_load_seconds": "seconds the loader threads spent on asynchronous loads",
    "saved_blocks": "vLLM blocks stored into kvmem",
    "saved_bytes": "bytes stored into kvmem",
    "save_seconds": "seconds the saver thread spent storing",
    **{f"loaded_chunks_{tier}": f"kvmem entries (chunks of blocks) loaded from its {tier} tier" for tier in TIERS},
    "warmed_chunks": "chunks vLLM evicted, warmed into kvmem's CPU tier from the tiers below",
}
GAUGE = "saves_pending"  # blocks queued for saving, not stored yet


@dataclass
class KVMemStats(KVConnectorStats):
    """One or more workers' counts over an interval: ``data`` maps a name of :data:`COUNTERS` (or
    ``saves_pending``) to a number."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counts (another worker's, or a later interval's) to these."""
        for name, value in other.data.items():
            mine = self.data.get(name, 0)
            self.data[name] = max(mine, value) if name == GAUGE else mine + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's numbers for vLLM's log line (seconds rounded to the millisecond)."""
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in sorted(self.data.items()) if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVMemPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvmem_<counter>_total`` counters and the ``vllm:kvmem_saves_pending`` gauge, per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvmem_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        gauge = self._gauge_cls(
            name=f"vllm:kvmem_{GAUGE}",
            documentation="kvmem: the most blocks a worker had queued for saving, not stored yet, in the interval",
            labelnames=labelnames,
        )
        self._pending = create_metric_per_engine(gauge, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add an interval's counts to the counters, and set the gauge."""
        for name, value in transfer_stats_data.items():
            if name == GAUGE:
                self._pending[engine_idx].set(value)  # type: ignore[union-attr]
            elif name in self._counters and value:
                self._counters[name][engine_idx].inc(value)


def since(now: dict[str, float], before: dict[str, float]) -> KVMemStats | None:
    """The counts of ``now`` (a worker's totals) beyond ``before`` (its totals at its last report), with the
    gauge as it is now; ``None`` when nothing moved."""
    data = {k: v - before.get(k, 0) if k != GAUGE else v for k, v in now.items()}
    stats = KVMemStats(data={k: v for k, v in data.items() if v})
    return None if stats.is_empty() else stats
