"""A served engine (``vllm serve`` through ``python -m kvmem_vllm.cli``) shows the connector's numbers on /metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import ENGINE_TIMEOUT_S

from benchmarks.servers import free_port


def _get(url: str, data: dict | None = None) -> bytes:
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def _metric(text: str, name: str) -> float:
    """The sum of a metric's samples over its label sets."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def test_metrics_of_a_served_engine_show_the_connector_s_counters(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    transfer = {
        "kv_connector": "KVMemConnector",
        "kv_connector_module_path": "kvmem_vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": str(tmp_path / "kv"), "compression": "none", "block_size": 256},
    }
    argv = [sys.executable, "-m", "kvmem_vllm.cli", "serve", str(tiny_llama), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]
    argv += ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(transfer)]
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"vllm serve not ready in {ENGINE_TIMEOUT_S} s"
            try:
                _get(f"{base}/health")
                break
            except OSError:
                time.sleep(1)
        prompt = " ".join(f"w{(7 * i) % 500}" for i in range(600))  # two chunks of 256 tokens and a tail
        for _ in range(2):  # NOTE: vLLM's prefix cache is off: the second request loads what the first saved
            _get(f"{base}/v1/completions", {"model": str(tiny_llama), "prompt": prompt, "max_tokens": 4})
        text = ""
        for _ in range(30):  # NOTE: stats reach the metrics with the engine's next steps and log interval
            text = _get(f"{base}/metrics").decode()
            if _metric(text, "vllm:kvmem_loaded_blocks_total") > 0:
                break
            time.sleep(1)
        assert _metric(text, "vllm:kvmem_saved_blocks_total") == 4  # the prompt's two chunks of 2 blocks
        assert _metric(text, "vllm:kvmem_loaded_blocks_total") == 4  # loaded back for the second request
        assert _metric(text, "vllm:kvmem_failed_blocks_total") == 0
        assert _metric(text, "vllm:kvmem_loaded_chunks_cpu_total") == 2  # from the worker's CPU tier
        assert _metric(text, "vllm:kvmem_saved_bytes_total") > 0 and _metric(text, "vllm:kvmem_save_seconds_total") > 0
        assert "vllm:kvmem_saves_pending" in text
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
