"""A served engine (``vllm serve`` through ``python -m kvmem_vllm.cli``) shows the connector's numbers on /metrics."""

from __future__ import annotations

import time
from pathlib import Path

from conftest import Served, metric


def test_metrics_of_a_served_engine_show_the_connector_s_counters(tiny_llama: Path, tmp_path: Path) -> None:
    transfer = {
        "kv_connector": "KVMemConnector",
        "kv_connector_module_path": "kvmem_vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": str(tmp_path / "kv"), "compression": "none", "block_size": 256},
    }
    with Served(tmp_path, "metrics", tiny_llama, transfer) as server:
        prompt = " ".join(f"w{(7 * i) % 500}" for i in range(600))  # two chunks of 256 tokens and a tail
        for _ in range(2):  # NOTE: vLLM's prefix cache is off: the second request loads what the first saved
            server.post("/v1/completions", {"model": str(tiny_llama), "prompt": prompt, "max_tokens": 4})
        text = ""
        for _ in range(30):  # NOTE: stats reach the metrics with the engine's next steps
            text = server.metrics()
            if metric(text, "vllm:kvmem_loaded_blocks_total") > 0:
                break
            time.sleep(1)
    assert metric(text, "vllm:kvmem_saved_blocks_total") == 4  # the prompt's two chunks of 2 blocks
    assert metric(text, "vllm:kvmem_loaded_blocks_total") == 4  # loaded back for the second request
    assert metric(text, "vllm:kvmem_failed_blocks_total") == 0
    # saved around the worker's CPU tier (it holds what vLLM evicts: nothing here), so loaded from disk
    assert metric(text, "vllm:kvmem_loaded_chunks_disk_total") == 2
    assert metric(text, "vllm:kvmem_loaded_chunks_cpu_total") == 0 and "vllm:kvmem_warmed_chunks_total" in text
    assert metric(text, "vllm:kvmem_saved_bytes_total") > 0 and metric(text, "vllm:kvmem_save_seconds_total") > 0
    assert "vllm:kvmem_saves_pending" in text
