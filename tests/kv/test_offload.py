"""Dynamic offload of a live cache: greedy generation is unchanged while the device holds a bounded window."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

import kvmem
from kvmem.errors import ConfigError, UnsupportedModelError
from kvmem.kv.layout import cache_argument
from kvmem.kv.offload import OffloadingCache
from kvmem.stores import CpuTier
from tests.kv.workers import BLOCK, PROMPT_B, build_model

NEW = 48


@pytest.fixture(scope="module")
def llama() -> Iterator[PreTrainedModel]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: tiny model: threads only spin-wait on shared cores
    yield build_model("llama")
    torch.set_num_threads(before)


def generate(model: PreTrainedModel, cache: DynamicCache) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(PROMPT_B, max_new_tokens=NEW, do_sample=False, **{cache_argument(model): cache})


def cache_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@pytest.mark.parametrize("resident, lag, transfer", [(1, 0, 1), (2, 2, 1), (2, 1, 16384)])
def test_generation_is_identical_and_resident_bytes_stay_bounded(
    llama: PreTrainedModel, resident: int, lag: int, transfer: int
) -> None:
    plain = DynamicCache(config=llama.config)
    expected = generate(llama, plain)
    cache = OffloadingCache(
        llama.config,
        max_tokens=256,
        block_size=BLOCK,
        resident_blocks=resident,
        max_lag_blocks=lag,
        min_transfer_bytes=transfer,
    )
    try:
        got = generate(llama, cache)
        assert torch.equal(got, expected)
        total = PROMPT_B.shape[1] + NEW - 1  # the last token is never fed back
        p = cache.pointers
        assert 0 < p.start <= p.current <= p.end <= total
        assert cache.get_seq_length() == total
        per_token = cache_bytes(plain) // total
        chunks = -(-transfer // (per_token // len(plain.layers) * BLOCK))  # chunks per copy
        window = (resident + lag + 2 * chunks + 1) * BLOCK  # NOTE: a window never exceeds this many tokens
        assert cache.resident_bytes() <= window * per_token
        assert cache.resident_bytes() < cache_bytes(plain) / 2
        # the offloaded prefix came back bit-exact: every layer's host pages equal the plain cache's tokens
        for i, layer in enumerate(plain.layers):
            host = cache._host.read(cache._tables[i].blocks[: p.start // BLOCK])  # type: ignore[union-attr]
            kv = host.view(2, layer.keys.shape[1], p.start, -1)
            assert torch.equal(kv[0], layer.keys[0, :, : p.start]) and torch.equal(kv[1], layer.values[0, :, : p.start])
    finally:
        cache.close()


def test_host_pages_come_from_the_cpu_tiers_pool_and_count_in_its_usage(llama: PreTrainedModel, tmp_path: Path) -> None:
    plain = DynamicCache(config=llama.config)
    expected = generate(llama, plain)
    with kvmem.Memory(tmp_path / "kvmem", cpu_bytes="8MiB", disk_bytes=0) as mem:
        cpu = mem._tiers.tiers[0]
        assert isinstance(cpu, CpuTier) and cpu.usage() == 0
        cache = OffloadingCache(llama.config, max_tokens=256, block_size=BLOCK, resident_blocks=1, memory=mem)
        try:
            assert torch.equal(generate(llama, cache), expected)
            pages = cache._host.pages  # type: ignore[union-attr]
            base = cpu.pool.buffer.data_ptr()
            assert base <= pages.data_ptr() < base + cpu.pool.nbytes, "the host pages are pool pages"
            assert cpu.usage() >= pages.numel() * pages.element_size() > 0
        finally:
            cache.close()
        del cache, pages
        gc.collect()
        assert cpu.usage() == 0, "the lent pages went back when the cache went"


def test_producer_waits_only_when_offload_falls_behind(llama: PreTrainedModel) -> None:
    cache = OffloadingCache(
        llama.config, max_tokens=256, block_size=BLOCK, resident_blocks=1, max_lag_blocks=0, min_transfer_bytes=1
    )
    try:
        generate(llama, cache)
        p = cache.pointers
        # NOTE: lag 0: any planned chunk not yet copied at a step's end made the producer wait for it
        assert p.end - p.current <= BLOCK
    finally:
        cache.close()


def test_bad_settings_and_models_are_refused(llama: PreTrainedModel) -> None:
    with pytest.raises(ConfigError, match="resident_blocks=0"):
        OffloadingCache(llama.config, max_tokens=64, block_size=BLOCK, resident_blocks=0)
    with pytest.raises(UnsupportedModelError, match="DynamicSlidingWindowLayer"):
        OffloadingCache(build_model("mistral").config, max_tokens=64, block_size=BLOCK)
