"""The connector's numbers: a worker's totals, what it reports each step, how vLLM sums them, /metrics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from test_layout import BLOCKS, cpu_caches, probe_request
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvmem
from kvmem.keys import chunk_hashes
from kvmem_vllm.groups import GroupLayout
from kvmem_vllm.identity import rank_key
from kvmem_vllm.metadata import ChunkTransfer, KVMemMetadata
from kvmem_vllm.scheduler import SchedulerSide
from kvmem_vllm.stats import COUNTERS, KVMemPromMetrics, KVMemStats, since
from kvmem_vllm.worker import WorkerSide


def test_a_worker_counts_its_loads_saves_and_failures_and_reports_each_once(tmp_path: Path) -> None:
    _, caches = cpu_caches()
    with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB") as mem:
        worker = WorkerSide(mem, "vllm/test", BLOCKS, "none")
        worker.register(caches)
        block_bytes = worker.views(0).numel() * 4  # type: ignore[misc]
        worker.save(KVMemMetadata(saves=[ChunkTransfer("r1", ["c0"], [[1, 2]])]))
        worker.saver.wait_for({"r1"})
        first = worker.totals()
        assert first["saved_blocks"] == 2 and first["saved_bytes"] == 2 * block_bytes and first["save_seconds"] > 0
        assert first["saves_pending"] == 0
        worker.load(KVMemMetadata(loads=[ChunkTransfer("r2", ["c0", "gone"], [[3, 4], [5, 6]])]))
        now = worker.totals()
        step = since(now, first)
        assert step is not None
        assert {k: v for k, v in step.data.items() if k != "load_seconds"} == {
            "loaded_blocks": 2,
            "failed_blocks": 2,
            "loaded_bytes": 2 * block_bytes,
            "loaded_chunks_cpu": 1,  # one entry for the chunk's two blocks
        }
        assert since(now, now) is None  # nothing moved: nothing to report
        worker.close()


def test_vllm_sums_workers_and_steps_and_keeps_the_largest_queue_of_saves() -> None:
    rank0 = KVMemStats(data={"loaded_blocks": 8, "load_seconds": 0.5, "saves_pending": 4})
    rank1 = KVMemStats(data={"loaded_blocks": 8, "load_seconds": 0.25, "saves_pending": 2})
    both = rank0.aggregate(rank1)
    assert both.data == {"loaded_blocks": 16, "load_seconds": 0.75, "saves_pending": 4}
    assert both.reduce() == {"load_seconds": 0.75, "loaded_blocks": 16, "saves_pending": 4}
    assert KVMemStats().is_empty() and not both.is_empty()


def test_the_prometheus_metrics_count_what_the_workers_reported() -> None:
    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:
        return lambda **kw: cls(registry=registry, **kw)

    types: Any = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = KVMemPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]})  # type: ignore[arg-type]
    prom.observe({"loaded_blocks": 16, "failed_blocks": 2, "saves_pending": 3}, 0)
    prom.observe({"loaded_blocks": 4, "saves_pending": 1}, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvmem_loaded_blocks_total{engine="0",model_name="tiny"} 20.0' in text
    assert 'vllm:kvmem_failed_blocks_total{engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:kvmem_saves_pending{engine="0",model_name="tiny"} 1.0' in text
    assert all(f"vllm:kvmem_{name}_total" in text for name in COUNTERS)


def test_hit_sources_name_the_tier_the_probe_found_each_chunk_in(tmp_path: Path, redis_url: str) -> None:
    ns, block = f"vllm/test-{tmp_path.name}", 4
    tokens = list(range(2 * 2 * block + 1))
    keys = [rank_key(h, 0) for h in chunk_hashes(tokens, 2 * block, ns)]
    with kvmem.Memory(str(tmp_path / "b"), cpu_bytes=0, disk_bytes="64MiB", remote_url=redis_url) as other:
        other.store(keys[1], torch.zeros(2, 8), namespace=ns)  # chunk 1: in Redis (and another machine's disk)
    with kvmem.Memory(str(tmp_path / "a"), cpu_bytes=0, disk_bytes="64MiB", remote_url=redis_url) as mem:
        mem.store(keys[0], torch.zeros(2, 8), namespace=ns)  # chunk 0: this machine's disk
        sched = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=True)
        request = probe_request(tokens)
        assert sched.matched_tokens(request, block) == (3 * block, True)  # vLLM holds block 0
        assert sched.hit_sources(request, 3 * block) == {
            CacheHitSource.DISK: block,
            CacheHitSource.EXTERNAL_UNSPECIFIED: 2 * block,
        }
