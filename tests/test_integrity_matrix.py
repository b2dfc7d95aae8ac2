"""The integrity fault matrix: every read path x every tier x every fault (see ``tests/integrity.py``).

One rule (``DESIGN.md``, "Integrity: one rule for every read"): a value damaged where it
rests, or whose read fails midway, never comes back from any read path, and no tier
keeps it. Each cell stores a value so that exactly one tier holds it (the CPU tier
above disk and Redis is emptied, so that a promotion would show), damages it there,
reads it through one path, and asserts:

- the read returns exactly the stored value, or is a miss (``None``, the default, or
  :class:`IntegrityError` in strict mode); a damaged copy is always a miss, quarantined
  and counted (``kvmem_crc_failures_total``);
- no tier took the damaged bytes in: the CPU tier holds no copy, or an intact one; a
  plain load afterwards gives the value or a miss, never anything else.

The tiers: the CPU tier with ``cpu_verify`` (its pages are the process's own memory,
trusted by default: ``test_corruption.py`` shows what ``cpu_verify`` changes), the
disk tier, Redis. Read faults (deleted or cut off mid-read) apply to disk and Redis,
whose reads leave the process. The KV loaders are in ``tests/kv/test_kv_integrity_matrix.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvmem
from kvmem.errors import IntegrityError
from kvmem.ops.migrate import migrate_disk
from kvmem.stores.cpu import CpuTier
from kvmem.stores.disk import DiskTier
from tests.conftest import MemoryFactory
from tests.integrity import FAULTS, READ_FAULTS, Rest, tier_of
from tests.servers import RedisServer
from tests.stores.redis_helpers import unique_prefix, with_options

SHAPE = (64, 1024)  # 256 KiB of float32: one tensor, stored as it is


def _value(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


MISS = object()


def _plain(mem: kvmem.Memory, key: str) -> Any:
    return mem.load(key)


def _out(mem: kvmem.Memory, key: str) -> Any:
    return mem.load(key, out=torch.full(SHAPE, float("nan")))


def _out_holding_it(mem: kvmem.Memory, key: str) -> Any:
    """Into a tensor that already holds the stored value (a KV slot loaded before): a read that stops short
    would leave it looking right."""
    return mem.load(key, out=_value(1))


def _many(mem: kvmem.Memory, key: str) -> Any:
    return mem.load_many([key, "absent"])[0]


def _many_out(mem: kvmem.Memory, key: str) -> Any:
    return mem.load_many([key], out=[torch.full(SHAPE, float("nan"))])[0]


def _strided_out(mem: kvmem.Memory, key: str) -> Any:
    cache = torch.full((SHAPE[1], 2, SHAPE[0]), float("nan"))  # a KV-cache-like layout: the value is a strided slice
    return mem.load(key, out=cache[:, 0, :].T)


BLOCKS = torch.randperm(80, generator=torch.Generator().manual_seed(0))[: SHAPE[0]].tolist()  # row i -> block


def _stacked(got: Any, rows: list[torch.Tensor | None], skipped: torch.Tensor) -> Any:
    """A rows load's result as one tensor (its ``None`` rows taken from ``skipped``), or ``None`` on a miss."""
    if got is None:
        return None
    assert got == rows
    return torch.stack([skipped[i] if row is None else row for i, row in enumerate(rows)])


def _rows_out(mem: kvmem.Memory, key: str) -> Any:
    """Into the rows of a bigger tensor, strided, in no order (blocks of a paged KV cache)."""
    cache = torch.full((SHAPE[1], 80), float("nan"))
    rows: list[torch.Tensor | None] = [cache[:, b] for b in BLOCKS]
    return _stacked(mem.load(key, out=rows), rows, cache.T)


def _rows_holding_it_one_none(mem: kvmem.Memory, key: str) -> Any:
    """Into rows that already hold the stored value (a read that stops short would leave them looking right),
    one of them skipped: it must stay as it was."""
    held = _value(1)
    rows: list[torch.Tensor | None] = list(held.clone())
    rows[7] = None
    return _stacked(mem.load(key, out=rows), rows, held)


def _many_rows(mem: kvmem.Memory, key: str) -> Any:
    cache = torch.full((80, SHAPE[1]), float("nan"))
    rows: list[torch.Tensor | None] = [cache[b] for b in BLOCKS]
    return _stacked(mem.load_many([key], out=[rows])[0], rows, cache)


def _fetch(mem: kvmem.Memory, key: str) -> Any:
    got = mem.fetch(key)
    return None if got is None else got.value


def _strict(mem: kvmem.Memory, key: str) -> Any:
    try:
        return mem.load(key, strict=True)
    except IntegrityError:
        return None


def _warmed(mem: kvmem.Memory, key: str) -> Any:
    """Warmed into the top tier from where it rests (a prefetch, the vLLM connector's evicted chunks), then
    loaded: a damaged copy is never warmed."""
    return mem.load(key) if mem.chunk_store().warm(mem.storage_key(key)) else None


PATHS: dict[str, Callable[[kvmem.Memory, str], Any]] = {
    "load": _plain,
    "load(out=)": _out,
    "load(out=strided slice)": _strided_out,
    "load(out= holding the value)": _out_holding_it,
    "load_many": _many,
    "load_many(out=)": _many_out,
    "load(out=rows)": _rows_out,
    "load(out=rows holding the value, one None)": _rows_holding_it_one_none,
    "load_many(out=[rows])": _many_rows,
    "fetch": _fetch,
    "load(strict=True)": _strict,
    "chunk_store().warm": _warmed,
}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


class Cell:
    """One stored value (and an intact one of the same size) in a Memory where only ``tier`` holds it."""

    def __init__(self, make_memory: MemoryFactory, tier: str, redis_url: str | None) -> None:
        settings: dict[str, Any] = {"tier_retry_seconds": 0}
        if tier == "cpu":
            settings.update(stack="cpu", cpu_verify=True)
        elif tier == "redis":
            settings.update(disk_bytes=0, remote_url=redis_url)
        self.memory = make_memory(**settings)
        self.value, self.tier = _value(1), tier
        self.memory.store("key", self.value)
        self.memory.store("other", _value(2))
        self.memory.flush()
        self.skey = self.memory.storage_key("key")
        if tier != "cpu":
            for key in (self.skey, self.memory.storage_key("other")):
                tier_of(self.memory, "cpu").delete(key)
        self.rest = Rest(self.memory, tier, self.skey)
        self.other = Rest(self.memory, tier, self.memory.storage_key("other"))
        self.intact = self.rest.read()

    def assert_nothing_damaged_kept(self) -> None:
        """No tier took in damaged bytes: the CPU tier holds an intact copy or none; a plain load gives the
        value or a miss."""
        cpu = tier_of(self.memory, "cpu")
        assert isinstance(cpu, CpuTier)
        if self.tier != "cpu" and cpu.lookup(self.skey) is not None:
            assert Rest(self.memory, "cpu", self.skey).read() == self.intact
        again = self.memory.load("key")
        assert again is None or torch.equal(again, self.value)

    def crc_failures(self) -> int:
        return int(self.memory.metrics.value("kvmem_crc_failures_total", tier=self.tier))


def _redis(request: pytest.FixtureRequest, url: str) -> str:
    return with_options(url, prefix=unique_prefix(request))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("tier", ["cpu", "disk", "redis"])
def test_a_value_damaged_where_it_rests_is_a_miss_on_every_path(
    tier: str, fault: str, path: str, make_memory: MemoryFactory, redis_url: str, request: pytest.FixtureRequest
) -> None:
    cell = Cell(make_memory, tier, _redis(request, redis_url))
    FAULTS[fault](cell.rest, cell.other)

    got = PATHS[path](cell.memory, "key")

    assert got is None, f"{path} returned a value read from a damaged copy in tier {tier}"
    assert cell.crc_failures() >= 1
    assert not cell.memory.contains("key")  # quarantined: taken out of service
    cell.assert_nothing_damaged_kept()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fault", READ_FAULTS)
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_read_that_fails_midway_returns_the_value_or_a_miss(
    tier: str,
    fault: str,
    path: str,
    make_memory: MemoryFactory,
    redis_server: RedisServer,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cell = Cell(make_memory, tier, _redis(request, redis_server.url))
    READ_FAULTS[fault](cell.rest, monkeypatch, redis_server)

    got = PATHS[path](cell.memory, "key")

    assert got is None or torch.equal(got, cell.value), f"{path} returned other bytes than stored"
    monkeypatch.undo()
    cell.assert_nothing_damaged_kept()


@pytest.mark.parametrize("fault", FAULTS)
def test_demotion_never_moves_a_damaged_copy_down(
    fault: str, make_memory: MemoryFactory, redis_url: str, request: pytest.FixtureRequest
) -> None:
    """Disk -> Redis: the disk's copy is checked as it is read for the move; a damaged one is quarantined."""
    memory = make_memory(cpu_bytes=0, remote_url=_redis(request, redis_url))
    memory.store("key", _value(1))
    memory.store("other", _value(2))
    memory.flush()
    skey = memory.storage_key("key")
    remote = Rest(memory, "redis", skey)
    remote.delete()  # the disk holds the only copy (as after Redis evicted it)
    FAULTS[fault](Rest(memory, "disk", skey), Rest(memory, "disk", memory.storage_key("other")))

    disk = tier_of(memory, "disk")
    memory._tiers._demote(skey, disk, [tier_of(memory, "redis")])

    redis = tier_of(memory, "redis")
    assert not redis.contains(skey), "a damaged copy was moved down to Redis"
    assert int(memory.metrics.value("kvmem_crc_failures_total", tier="disk")) == 1
    assert memory.load("key") is None


@pytest.mark.parametrize("fault", FAULTS)
def test_migration_never_reseals_a_damaged_copy(fault: str, make_memory: MemoryFactory) -> None:
    """``kvmem migrate`` rewrites blobs with new CRCs: a damaged blob is left behind, never given fresh ones."""
    cell = Cell(make_memory, "disk", None)
    FAULTS[fault](cell.rest, cell.other)
    disk = tier_of(cell.memory, "disk")
    assert isinstance(disk, DiskTier)
    target = 1 if disk.blob_format == 2 else 2

    migrate_disk(disk, cell.memory._catalog, target, progress=False)

    assert cell.memory.load("key") is None
    cell.assert_nothing_damaged_kept()
