"""What a key names: a real engine config (vLLM's own, built from the tiny Llama on disk), no engine started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvmem.errors import ConfigError
from kvmem_vllm.identity import attention_backend, namespace

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


@pytest.fixture(scope="module")
def engine_config(tiny_llama: Path) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_llama), skip_tokenizer_init=True, enforce_eager=True, dtype="float32")
    return args.create_engine_config()


def kv_cache_config(groups: int = 1) -> Any:
    """vLLM's KV cache layout for the tiny Llama: full attention, blocks of 128, 2 KV heads of 64."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    layers = [LAYERS[i::groups] for i in range(groups)]
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec) for names in layers]
    )


def test_the_cpu_backend_is_named(engine_config: Any) -> None:
    assert attention_backend(engine_config, kv_cache_config()) == "CPU_ATTN"


def test_a_cpu_and_a_gpu_attention_backend_never_share_a_key(engine_config: Any) -> None:
    kv = kv_cache_config()
    cpu = namespace(engine_config, kv, "none", 256, "CPU_ATTN")
    assert cpu == namespace(engine_config, kv, "none", 256, "CPU_ATTN")  # the scheduler's and the worker's agree
    assert cpu != namespace(engine_config, kv, "none", 256, "FLASH_ATTN")
    assert cpu != namespace(engine_config, kv, "fp16", 256, "CPU_ATTN")
    assert cpu.startswith("vllm/")


def test_more_than_one_kv_cache_group_is_refused(engine_config: Any) -> None:
    with pytest.raises(ConfigError, match="2 KV cache groups"):
        attention_backend(engine_config, kv_cache_config(groups=2))
    with pytest.raises(ConfigError, match="2 KV cache groups"):
        namespace(engine_config, kv_cache_config(groups=2), "none", 256, "CPU_ATTN")


def test_a_refused_layout_leaves_no_memory_open(tiny_llama: Path, tmp_path: Path) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvmem.catalog.catalog import _LIVE
    from kvmem_vllm import KVMemConnector

    transfer = KVTransferConfig(
        kv_connector="KVMemConnector",
        kv_connector_module_path="kvmem_vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"path": str(tmp_path / "kv")},
    )
    args = EngineArgs(
        model=str(tiny_llama),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        kv_transfer_config=transfer,
    )
    config = args.create_engine_config()
    for role in (KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER):
        with pytest.raises(ConfigError, match="2 KV cache groups"):
            KVMemConnector(config, role, kv_cache_config(groups=2))
    assert not [c for c in _LIVE if not c._closed and str(tmp_path) in c.url]  # both Memories were closed
