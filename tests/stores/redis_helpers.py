"""What the Redis and Redis Cluster tests share: unique key prefixes, URL options, the tier of a Memory,
and the two-node prefix-reuse scenario."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem.stores.redis import RedisTier
from tests.conftest import MemoryFactory


def unique_prefix(request: pytest.FixtureRequest) -> str:
    return f"test:{request.node.name}:{time.monotonic_ns()}:"


def with_options(url: str, **options: object) -> str:
    return url + ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in options.items())


def redis_tier(mem: kvmem.Memory) -> RedisTier:
    found = next(t for t in mem._tiers.tiers if t.name == "redis")
    assert isinstance(found, RedisTier)
    return found


def over_remote(make_memory: MemoryFactory, default_url: str | None = None, **defaults: object) -> MemoryFactory:
    """``open_(name="a", url=None, **settings)``: ``make_memory`` with the remote tier at ``url`` (default
    ``default_url``) and, unless ``defaults`` or ``settings`` say otherwise, a 1 MiB CPU tier and no disk."""

    def open_(name: str = "a", url: str | None = None, **settings: object) -> kvmem.Memory:
        options: dict[str, object] = {"cpu_bytes": "1MiB", "disk_bytes": 0, **defaults, **settings}
        return make_memory(name, remote_url=url or default_url, **options)

    return open_


def second_node_reuses_first_nodes_prefix(
    tmp_path: Path, remote_url: str, catalog_url: str, after_first: Callable[[kvmem.Memory], None] = lambda mem: None
) -> None:
    """Node A prefills a prompt; node B (own empty disk, same remote tier and catalog) reuses A's chunks exactly."""
    from kvmem.kv import PrefixCache
    from tests.kv.workers import BLOCK, PROMPT_A, PROMPT_B, SHARED, build_model

    model = build_model("llama", 0)
    shared = {
        "remote_url": remote_url,
        "catalog_url": catalog_url,
        "cpu_bytes": "64MiB",
        "disk_bytes": "64MiB",
        "fsync": "never",
    }
    with kvmem.Memory(str(tmp_path / "node-a"), **shared) as node_a:
        pc = PrefixCache(model, node_a, block_size=BLOCK, compression="none")
        assert pc.prefill(PROMPT_A).reused_tokens == 0
        pc.flush()
        pc.close()
        after_first(node_a)
    with kvmem.Memory(str(tmp_path / "node-b"), **shared) as node_b:
        pc = PrefixCache(model, node_b, block_size=BLOCK, compression="none")
        result = pc.prefill(PROMPT_B)
        pc.close()
        assert result.reused_tokens == SHARED > 0
        with torch.no_grad():
            full = model(PROMPT_B).logits
        assert (result.logits - full[:, -result.logits.shape[1] :]).abs().max().item() <= 1e-4
        hits = node_b.metrics.registry.get_sample_value("kvmem_kv_chunk_hits_total", {"tier": "redis"})
        assert hits == SHARED // BLOCK  # served by the remote tier: node B's own disk was empty
