"""Layer-wise loading: chunks stream in layer by layer, every segment checked before use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

import kvmem
from kvmem.errors import UnsupportedModelError
from kvmem.kv.layout import cache_argument, chunk_value, install_prefix, new_cache
from kvmem.kv.stream import ChunkLoadError, ChunkSource, LayerwiseLoader, StreamingCache
from tests.kv.workers import BLOCK, PROMPT_B, WINDOW, stored_sources

EXACT = 1e-5


def _chunk_file(memory: kvmem.Memory, source: ChunkSource) -> Path:
    return Path(memory.config.path) / "disk" / "blobs" / source.key[:2] / f"{source.key}.kvb"


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_loader_fills_each_layer_with_the_stored_prefix(
    tiny_model: Callable, make_memory: Callable, prefix_cache: Callable, arch: str, tier: str
) -> None:
    model = tiny_model(arch)
    memory = make_memory(cpu_bytes="64MiB" if tier == "cpu" else 0)
    sources = stored_sources(memory, prefix_cache(model, memory))
    assert {s.tier for s in sources} == {tier}
    full = new_cache(model)  # records every token, sliding layers included
    with torch.no_grad():
        # NOTE: the model's own cache argument: past_key_values= in transformers 5.19, cache= in 5.24
        model(PROMPT_B[:, : 4 * BLOCK], use_cache=True, **{cache_argument(model): full})
    tokens = 4 * BLOCK - 3  # a prefix that ends inside the last chunk
    cache = new_cache(model, StreamingCache)
    loader = LayerwiseLoader(memory.chunk_store(), sources[:4], cache, BLOCK, tokens, torch.device("cpu"))
    assert cache.get_seq_length() == tokens  # known before a single byte has arrived
    loader.wait_all()
    for layer, want in zip(cache.layers, full.layers):
        if arch == "mistral":  # a sliding layer receives just the prefix's last window - 1 tokens
            assert layer.keys.shape[-2] == WINDOW - 1 and layer.cumulative_length == tokens
            assert torch.equal(layer.keys, want.keys[:, :, tokens - (WINDOW - 1) : tokens])
            assert torch.equal(layer.values, want.values[:, :, tokens - (WINDOW - 1) : tokens])
        else:
            assert torch.equal(layer.keys, want.keys[:, :, :tokens])
            assert torch.equal(layer.values, want.values[:, :, :tokens])


def test_a_corrupt_layer_segment_is_reported_with_its_chunk(
    tiny_model: Callable, make_memory: Callable, prefix_cache: Callable
) -> None:
    model = tiny_model("llama")
    memory = make_memory(cpu_bytes=0)
    sources = stored_sources(memory, prefix_cache(model, memory))
    path = _chunk_file(memory, sources[2])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last layer's V segment
    path.write_bytes(bytes(data))
    cache = new_cache(model, StreamingCache)
    cache.loader = LayerwiseLoader(memory.chunk_store(), sources[:4], cache, BLOCK, 4 * BLOCK, torch.device("cpu"))
    cache.loader.wait(0)  # layer 0 of every chunk is intact and arrives
    with pytest.raises(ChunkLoadError) as info:
        cache.loader.wait(len(cache.layers) - 1)
    assert (info.value.index, info.value.corrupt, info.value.tier) == (2, True, "disk")
    assert info.value.key == sources[2].key and "CRC32C" in str(info.value)


def test_a_chunk_gone_before_the_read_is_not_called_corrupt(
    tiny_model: Callable, make_memory: Callable, prefix_cache: Callable
) -> None:
    model = tiny_model("llama")
    memory = make_memory(cpu_bytes=0)
    sources = stored_sources(memory, prefix_cache(model, memory))
    _chunk_file(memory, sources[1]).unlink()
    cache = new_cache(model, StreamingCache)
    loader = LayerwiseLoader(memory.chunk_store(), sources[:4], cache, BLOCK, 4 * BLOCK, torch.device("cpu"))
    with pytest.raises(ChunkLoadError) as info:
        loader.wait_all()
    assert (info.value.index, info.value.corrupt) == (1, False)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_layerwise_and_load_all_give_the_same_exact_logits(
    tiny_model: Callable, reference: Callable, make_memory: Callable, prefix_cache: Callable, arch: str
) -> None:
    model = tiny_model(arch)
    memory = make_memory(cpu_bytes=0)  # every chunk read from disk, in ranged reads
    writer = prefix_cache(model, memory)
    writer.prefill(PROMPT_B)
    writer.flush()
    for layerwise in (True, False):
        pc = prefix_cache(model, memory, layerwise=layerwise)
        result = pc.prefill(PROMPT_B)
        assert result.reused_tokens == 4 * BLOCK
        want = reference(arch).logits[:, result.reused_tokens :]
        assert (result.logits - want).abs().max().item() <= EXACT


def test_corrupt_header_of_the_first_chunk_falls_back_to_a_full_prefill(
    tiny_model: Callable, reference: Callable, make_memory: Callable, prefix_cache: Callable
) -> None:
    model = tiny_model("qwen2")
    memory = make_memory(cpu_bytes=0)
    pc = prefix_cache(model, memory)
    sources = stored_sources(memory, pc)
    path = _chunk_file(memory, sources[0])
    data = bytearray(path.read_bytes())
    data[30] ^= 0x01  # the JSON header
    path.write_bytes(bytes(data))
    result = pc.prefill(PROMPT_B)
    assert result.reused_tokens == 0
    assert (result.logits - reference("qwen2").logits).abs().max().item() <= EXACT
    assert memory.metrics.value("kvmem_crc_failures_total", tier="disk") == 1
    pc.flush()
    assert pc.lookup(PROMPT_B) == 4 * BLOCK  # stored again from the recomputed cache


def test_a_cache_layer_without_keys_and_values_is_refused_by_name() -> None:
    """A linear-attention layer holds states, not K/V: installing or taking a chunk names it."""
    cache = DynamicCache()
    cache.layers.append(LinearAttentionLayer())
    kv = torch.zeros(1, 2, BLOCK, 8)
    with pytest.raises(UnsupportedModelError, match="LinearAttentionLayer"):
        install_prefix(cache, 0, kv, kv)
    with pytest.raises(UnsupportedModelError, match="LinearAttentionLayer"):
        chunk_value(cache, 0, BLOCK)
