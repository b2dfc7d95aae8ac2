"""Tier faults in the KV path: a chunk the disk cannot read (EIO) or Redis cannot serve (server gone).

Each is handled as ``Memory.load`` handles it: no exception reaches the caller, the
fault is counted in ``kvmem_tier_errors_total{tier}``, the tier is skipped for
``tier_retry_seconds``, reuse stops before the failed chunk, and the logits equal
those of a full forward pass. A fault is injected on the first, a middle or the last
chunk, when it is opened or at its last layer (in the layer-wise mode, after the
forward pass has taken layer 0 with the whole prefix), layer-wise and load-all.

A torn (truncated) chunk file is the data's fault, not the tier's: it is quarantined
and counted in ``kvmem_crc_failures_total``, and the disk stays in use.

NOTE: a real EIO cannot be made here: ``os.preadv`` raises it for the faulty chunk's
file only. Redis faults are real: the server is stopped as the chunk is read.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvmem
from kvmem.kv import PrefixCache
from kvmem.stores.base import StorageTier
from kvmem.stores.redis import RedisTier
from tests.kv.conftest import MemoryFactory, ModelFactory, assert_prefill_exact, store_prompt
from tests.kv.workers import BLOCK, prompt
from tests.servers import RedisServer

PrefixCacheFactory = Callable[..., PrefixCache]
CHUNKS = 5
IDS = prompt(40, CHUNKS * BLOCK + 3)
POSITIONS = {"first": 0, "middle": 2, "last": CHUNKS - 1}
MODES = {"layerwise": True, "load-all": False}


def _tier(memory: kvmem.Memory, name: str) -> StorageTier:
    return next(t for t in memory._tiers.tiers if t.name == name)


def _skeys(memory: kvmem.Memory, pc: PrefixCache) -> list[str]:
    return [memory.storage_key(k, pc.namespace) for k in pc.chunk_keys(IDS)]


def _tier_errors(memory: kvmem.Memory, tier: str) -> int:
    return int(memory.metrics.value("kvmem_tier_errors_total", tier=tier))


def _eio_on(monkeypatch: pytest.MonkeyPatch, skey: str, from_byte: Callable[[int], int]) -> None:
    """Make reads of ``skey``'s chunk file at or past ``from_byte(file size)`` fail with ``EIO``."""
    real = os.preadv

    def preadv(fd: int, buffers: list[memoryview | np.ndarray], offset: int, *flags: int) -> int:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(name).startswith(skey) and offset >= from_byte(os.fstat(fd).st_size):
            raise OSError(errno.EIO, os.strerror(errno.EIO), name)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)


AT = {"open": lambda size: 0, "last-layer": lambda size: size // 2}  # 2 layers: layer 1 is the file's second half


@pytest.mark.parametrize("at", AT)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("position", POSITIONS)
def test_disk_eio_on_a_chunk_stops_reuse_before_it(
    position: str,
    mode: str,
    at: str,
    tiny_model: ModelFactory,
    make_memory: MemoryFactory,
    prefix_cache: PrefixCacheFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, bad = tiny_model("llama"), POSITIONS[position]
    memory = make_memory(cpu_bytes=0, tier_retry_seconds=0)  # every chunk on disk; retried at once
    store_prompt(prefix_cache(model, memory), IDS)
    pc = prefix_cache(model, memory, layerwise=MODES[mode])
    _eio_on(monkeypatch, _skeys(memory, pc)[bad], AT[at])

    assert_prefill_exact(model, pc, IDS, bad * BLOCK)  # the chunks before it still come from disk
    assert _tier_errors(memory, "disk") == 1

    monkeypatch.undo()  # the disk heals
    pc.flush()
    assert_prefill_exact(model, pc, IDS, CHUNKS * BLOCK)
    assert _tier_errors(memory, "disk") == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_disk_is_skipped_then_retried(
    mode: str,
    tiny_model: ModelFactory,
    make_memory: MemoryFactory,
    prefix_cache: PrefixCacheFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    memory = make_memory(cpu_bytes=0, tier_retry_seconds=2)
    store_prompt(prefix_cache(model, memory), IDS)
    pc = prefix_cache(model, memory, layerwise=MODES[mode])
    _eio_on(monkeypatch, _skeys(memory, pc)[2], AT["last-layer"])

    assert_prefill_exact(model, pc, IDS, 0)  # the disk is skipped from the fault on: its chunks before it too
    disk = _tier(memory, "disk")
    assert _tier_errors(memory, "disk") == 1 and not memory._tiers.healthy(disk)
    assert_prefill_exact(model, pc, IDS, 0)  # still skipped: not read, not counted again
    assert _tier_errors(memory, "disk") == 1

    monkeypatch.undo()
    time.sleep(2)
    assert memory._tiers.healthy(disk)
    assert_prefill_exact(model, pc, IDS, CHUNKS * BLOCK)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("position", POSITIONS)
def test_a_truncated_chunk_file_stops_reuse_before_it(
    position: str, mode: str, tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model, bad = tiny_model("llama"), POSITIONS[position]
    memory = make_memory(cpu_bytes=0)
    store_prompt(prefix_cache(model, memory), IDS)
    pc = prefix_cache(model, memory, layerwise=MODES[mode])
    skey = _skeys(memory, pc)[bad]
    path = Path(memory.config.path) / "disk" / "blobs" / skey[:2] / f"{skey}.kvb"
    os.truncate(path, path.stat().st_size * 3 // 4)  # a torn file: its last layer is cut short

    assert_prefill_exact(model, pc, IDS, bad * BLOCK)
    assert memory.metrics.value("kvmem_crc_failures_total", tier="disk") == 1
    assert _tier_errors(memory, "disk") == 0 and memory._tiers.healthy(_tier(memory, "disk"))  # the data's fault


def _stop_on_read(
    monkeypatch: pytest.MonkeyPatch, tier: StorageTier, server: RedisServer, skey: str, from_byte: int
) -> None:
    """Stop ``server`` as ``skey``'s blob is read from ``from_byte`` on: the read fails for real."""
    assert isinstance(tier, RedisTier)
    real = tier.read_range_into

    def read_range_into(key: str, start: int, arrays: list[np.ndarray]) -> tuple[int, int]:
        if key == skey and start >= from_byte:
            server.stop()
        return real(key, start, arrays)

    monkeypatch.setattr(tier, "read_range_into", read_range_into)  # NOTE: every range read goes through it


@pytest.mark.parametrize("at", ["open", "last-layer"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("position", POSITIONS)
def test_redis_gone_while_a_chunk_is_read_stops_reuse_before_it(
    position: str,
    mode: str,
    at: str,
    tiny_model: ModelFactory,
    make_memory: MemoryFactory,
    prefix_cache: PrefixCacheFactory,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, bad = tiny_model("llama"), POSITIONS[position]
    memory = make_memory(disk_bytes=0, remote_url=redis_server.url, tier_retry_seconds=60)
    store_prompt(prefix_cache(model, memory), IDS)
    pc = prefix_cache(model, memory, layerwise=MODES[mode])
    skeys = _skeys(memory, pc)
    cpu, redis = _tier(memory, "cpu"), _tier(memory, "redis")
    for skey in skeys[bad:]:  # the chunks before the faulty one stay in the CPU tier; it and the rest on Redis
        assert cpu.delete(skey)
    size = redis.read_range(skeys[bad], 0, 1 << 30).numel()
    _stop_on_read(monkeypatch, redis, redis_server, skeys[bad], 0 if at == "open" else size // 2)

    assert_prefill_exact(model, pc, IDS, bad * BLOCK)
    assert _tier_errors(memory, "redis") == 1 and not memory._tiers.healthy(redis)


def test_prefetch_with_redis_gone_finds_nothing_and_counts_it(
    tiny_model: ModelFactory,
    make_memory: MemoryFactory,
    prefix_cache: PrefixCacheFactory,
    redis_server: RedisServer,
) -> None:
    model = tiny_model("llama")
    memory = make_memory(cpu_bytes=0, disk_bytes=0, remote_url=redis_server.url, tier_retry_seconds=60)
    store_prompt(prefix_cache(model, memory), IDS)
    pc = prefix_cache(model, memory)
    redis_server.stop()

    assert pc.prefetch(IDS).result(timeout=30) == 0  # Redis is the top tier: its probe fails, and is handled
    assert _tier_errors(memory, "redis") == 1
    assert_prefill_exact(model, pc, IDS, 0)
