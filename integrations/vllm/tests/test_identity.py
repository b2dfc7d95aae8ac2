"""What a key names: a real engine config (vLLM's own, built from the tiny Llama on disk), no engine started."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvmem.errors import ConfigError
from kvmem.keys import chunk_hashes
from kvmem_vllm.groups import UnsupportedLayout, group_windows
from kvmem_vllm.identity import attention_backend, keyed_tokens, namespace, request_scope

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


def test_the_kv_cache_groups_name_the_keys_and_a_mamba_group_is_not_stored(engine_config: Any) -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

    one = namespace(engine_config, kv_cache_config(), "none", 256, "CPU_ATTN")
    two = kv_cache_config(groups=2)
    assert group_windows(two) == (None, None)
    assert namespace(engine_config, two, "none", 256, "CPU_ATTN") != one  # a chunk's rows are other blocks
    window = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=200)
    hybrid = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[*two.kv_cache_groups[:1], KVCacheGroupSpec(LAYERS[1::2], window)],
    )
    assert group_windows(hybrid) == (None, 199)
    assert namespace(engine_config, hybrid, "none", 256, "CPU_ATTN") not in (
        one,
        namespace(engine_config, two, "none", 256, "CPU_ATTN"),
    )
    mamba = MambaSpec(block_size=128, shapes=((4, 8),), dtypes=(torch.float32,))
    ssm = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[*two.kv_cache_groups[:1], KVCacheGroupSpec(LAYERS[1::2], mamba)],
    )
    with pytest.raises(UnsupportedLayout, match="a KV cache group of MambaSpec .*full-attention and sliding-window"):
        namespace(engine_config, ssm, "none", 256, "CPU_ATTN")


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
        kv_connector_extra_config={"path": str(tmp_path / "kv"), "block_size": 200},
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
        with pytest.raises(ConfigError, match="block_size=200: kvmem's chunk must be a whole number of vLLM blocks"):
            KVMemConnector(config, role, kv_cache_config())
    assert not [c for c in _LIVE if not c._closed and str(tmp_path) in c.url]  # both Memories were closed


def test_a_request_s_salt_and_adapter_name_its_keys(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    adapters = []
    for i in range(2):
        path = tmp_path / f"adapter-{i}"
        path.mkdir()
        (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
        (path / "adapter_model.safetensors").write_bytes(bytes([i]) * 1000)  # NOTE: only sampled, never parsed
        adapters.append(LoRARequest("sql", 1, str(path)))
    scopes = [
        request_scope(None, None),
        request_scope("tenant-a", None),
        request_scope("tenant-b", None),
        request_scope(None, adapters[0]),
        request_scope(None, adapters[1]),  # the same name and config, other weights
        request_scope("tenant-a", adapters[0]),
    ]
    assert scopes[0] == "" and request_scope("", None) == ""  # no salt, no adapter: the engine's keys
    assert len(set(scopes)) == len(scopes)
    assert request_scope("tenant-a", None) == scopes[1]  # the scheduler keys one tenant alike every time
    assert "tenant-a" not in scopes[1]


def test_quantization_and_kv_cache_scales_name_the_keys(engine_config: Any, tiny_llama: Path, tmp_path: Path) -> None:
    import copy
    import shutil

    from safetensors.torch import save_file

    from kvmem_vllm.identity import _model_fingerprint

    plain = namespace(engine_config, kv_cache_config(), "none", 256, "CPU_ATTN")
    quantized = copy.deepcopy(engine_config)
    quantized.model_config.quantization = "fp8"
    assert namespace(quantized, kv_cache_config(), "none", 256, "CPU_ATTN") != plain
    skipping = copy.deepcopy(engine_config)
    skipping.cache_config.kv_cache_dtype_skip_layers = ["0"]
    assert namespace(skipping, kv_cache_config(), "none", 256, "CPU_ATTN") != plain
    spaces, weights = [], []
    for scale in (0.5, 0.25):  # NOTE: the same checkpoint, but for the KV-cache scales vLLM would load
        model = tmp_path / f"model-{scale}"
        shutil.copytree(tiny_llama, model)
        # NOTE: 4 MiB either side: the weights' sample misses the scale
        tensors = {
            "a": torch.zeros(1 << 20),
            "model.layers.0.self_attn.k_scale": torch.tensor(scale),
            "z": torch.zeros(1 << 20),
        }
        save_file(tensors, str(model / "kv-scales.safetensors"))
        scaled = copy.deepcopy(engine_config)
        scaled.model_config.model = str(model)
        spaces.append(namespace(scaled, kv_cache_config(), "none", 256, "CPU_ATTN"))
        weights.append(_model_fingerprint(str(model), None, {}))
    assert weights[0] == weights[1]  # the sampled weights cannot tell the two apart ...
    assert len({plain, *spaces}) == 3  # ... the scales, hashed whole, can


def image(digest: str, offset: int, length: int) -> Any:
    """A multimodal input as vLLM hands it to a connector (``request.mm_features[i]``)."""
    return SimpleNamespace(
        modality="image", mm_hash=digest, identifier=digest, mm_position=SimpleNamespace(offset=offset, length=length)
    )


def test_an_image_s_content_hash_keys_the_chunks_from_its_placeholders_on() -> None:
    tokens = [7] * 10 + [4] * 64 + [9] * 182  # text, 64 placeholder tokens (the same for every image), text
    cat, dog = "a" * 64, "b" * 64
    with_cat = chunk_hashes(keyed_tokens(tokens, [image(cat, 10, 64)]), 64, "ns")
    with_dog = chunk_hashes(keyed_tokens(tokens, [image(dog, 10, 64)]), 64, "ns")
    again = chunk_hashes(keyed_tokens(tokens, [image(cat, 10, 64)]), 64, "ns")
    text = chunk_hashes(keyed_tokens(tokens, None), 64, "ns")
    assert with_cat == again  # the same image: the same keys
    assert all(c != d for c, d in zip(with_cat, with_dog))  # the chunk holding the image and every later one
    assert text == chunk_hashes(tokens, 64, "ns") and all(c != t for c, t in zip(with_cat, text))
    before = [1] * 128 + [4] * 64  # two text-only chunks, then an image
    assert chunk_hashes(keyed_tokens(before, [image(cat, 128, 64)]), 64, "ns")[:2] == chunk_hashes(before, 64, "ns")[:2]
    keyed = keyed_tokens(tokens, [image(cat, 10, 64)])
    assert all(k < 0 for k in keyed[10:74]) and keyed[:10] == tokens[:10] and keyed[74:] == tokens[74:]
