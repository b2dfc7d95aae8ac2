"""Prefill/decode split: a kv_producer server computes prompts, a kv_consumer server decodes them with the
prompt's KV loaded through kvmem (the same path), behind ``kvmem_vllm.proxy``: tokens equal to one server."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from conftest import Served, metric, post

from kvmem_vllm.proxy import ProxyServer


def transfer(role: str, path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "KVMemConnector",
        "kv_connector_module_path": "kvmem_vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": str(path), "compression": "none", "block_size": 256},
    }


def test_a_decode_server_decodes_with_the_prefill_server_s_kv_behind_the_proxy(
    tiny_llama: Path, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    with (
        Served(tmp_path, "prefill", tiny_llama, transfer("kv_producer", kv)) as prefill,
        Served(tmp_path, "decode", tiny_llama, transfer("kv_consumer", kv)) as decode,
    ):
        proxy = ProxyServer(("127.0.0.1", 0), prefill.url, decode.url)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{proxy.server_address[1]}/v1/completions"
            for doc in range(2):
                prompt = " ".join(f"w{(7 * i + doc) % 500}" for i in range(700))  # 2 chunks of 256 and a tail
                body = {"model": str(tiny_llama), "prompt": prompt, "max_tokens": 24, "temperature": 0.0}
                split = post(url, {**body, "return_token_ids": True})
                # NOTE: one server does it all (the producer computes and never loads)
                alone = prefill.post("/v1/completions", {**body, "return_token_ids": True})
                assert split["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
                assert split["choices"][0]["text"] == alone["choices"][0]["text"]
            text = ""
            for _ in range(30):  # NOTE: stats reach the metrics with the engine's next steps
                text = decode.metrics()
                if metric(text, "vllm:kvmem_loaded_blocks_total") >= 8:
                    break
                time.sleep(1)
        finally:
            proxy.shutdown()
            proxy.server_close()
    # NOTE: both prompts' 2 chunks (4 blocks each) came from the prefill server through kvmem
    assert metric(text, "vllm:kvmem_loaded_blocks_total") == 8
    assert metric(text, "vllm:kvmem_failed_blocks_total") == 0
    assert metric(text, "vllm:kvmem_saved_blocks_total") == 0  # a consumer never saves
