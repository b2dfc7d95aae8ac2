"""The integrity fault matrix for the KV paths: a chunk (or segment) damaged where it rests is computed, never used.

PrefixCache (load-all and layer-wise) and BlendCache read their chunks in parts, straight
into the model's cache. Each cell stores a prompt's KV in one tier, damages the middle
chunk there (see ``tests/integrity.py``), and asserts that the prefill reuses the chunks
before it only, computes the rest, and gives the logits of a run without any cache; the
damaged chunk is quarantined and stored again from the computed KV, so the next prefill
reuses the whole prompt, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import kvmem
from kvmem.kv import BlendCache, PrefixCache, Segment
from tests.integrity import FAULTS, Rest
from tests.kv.conftest import EXACT, MemoryFactory, ModelFactory, assert_prefill_exact, store_prompt
from tests.kv.workers import BLOCK, build_model, prompt
from tests.stores.redis_helpers import unique_prefix, with_options

CHUNKS = 5
BAD = 2  # the damaged chunk: the middle one
IDS = prompt(50, CHUNKS * BLOCK + 3)
MODES = {"layer-wise": True, "load-all": False}
TIERS = ("cpu", "disk", "redis")


def _memory(make_memory: MemoryFactory, tier: str, redis_url: str, request: pytest.FixtureRequest) -> kvmem.Memory:
    """A Memory whose only tier is ``tier`` (the CPU tier checking its pages on every load)."""
    if tier == "cpu":
        return make_memory(stack="cpu", cpu_verify=True)
    if tier == "disk":
        return make_memory(stack="disk")
    url = with_options(redis_url, prefix=unique_prefix(request))
    return make_memory(cpu_bytes=0, disk_bytes=0, remote_url=url)


def _rests(memory: kvmem.Memory, tier: str, keys: list[str], namespace: str) -> list[Rest]:
    return [Rest(memory, tier, memory.storage_key(k, namespace)) for k in keys]


def _crc_failures(memory: kvmem.Memory, tier: str) -> int:
    return int(memory.metrics.value("kvmem_crc_failures_total", tier=tier))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("tier", TIERS)
def test_prefix_cache_computes_a_damaged_chunk_and_everything_after_it(
    tier: str,
    fault: str,
    mode: str,
    tiny_model: ModelFactory,
    make_memory: MemoryFactory,
    prefix_cache: Callable[..., PrefixCache],
    redis_url: str,
    request: pytest.FixtureRequest,
) -> None:
    model = tiny_model("llama")
    memory = _memory(make_memory, tier, redis_url, request)
    writer = prefix_cache(model, memory)
    store_prompt(writer, IDS)
    rests = _rests(memory, tier, writer.chunk_keys(IDS), writer.namespace)
    FAULTS[fault](rests[BAD], rests[BAD + 1])

    pc = prefix_cache(model, memory, layerwise=MODES[mode])
    assert_prefill_exact(model, pc, IDS, BAD * BLOCK)
    assert _crc_failures(memory, tier) == 1
    pc.flush()
    assert_prefill_exact(model, pc, IDS, CHUNKS * BLOCK)  # the damaged chunk was stored again from the computed KV


DOCS = (prompt(211, 40), prompt(212, 40))  # two documents of one size: either blob can stand in for the other


def _segments() -> list[Segment]:
    return [Segment(prompt(210, 12), reusable=False), *(Segment(d) for d in DOCS), Segment(prompt(213, 9), False)]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("tier", TIERS)
def test_blend_cache_computes_a_damaged_segment_alone(
    tier: str, fault: str, make_memory: MemoryFactory, redis_url: str, request: pytest.FixtureRequest
) -> None:
    """A damaged document is computed on its own (as on a miss) and stored again: the blend's logits are those of
    the intact cache, and one document fewer was loaded."""
    model = build_model("qwen2", num_hidden_layers=3)
    memory = _memory(make_memory, tier, redis_url, request)
    bc = BlendCache(model, memory, compression="none")
    try:
        intact = _blend(bc)  # stores both documents, blends them
        rests = _rests(memory, tier, [bc.segment_key(s) for s in _segments()[1:3]], bc.namespace)
        FAULTS[fault](rests[0], rests[1])

        damaged = _blend(bc)

        assert (damaged.loaded_segments, damaged.stored_segments) == (1, 1)
        assert _crc_failures(memory, tier) == 1
        assert (damaged.logits - intact.logits).abs().max().item() <= EXACT
        assert _blend(bc).loaded_segments == 2
    finally:
        bc.close()


def _blend(bc: BlendCache) -> Any:
    result = bc.prefill(_segments(), recompute_ratio=0.15, logits_to_keep=4)
    bc.flush()
    return result
