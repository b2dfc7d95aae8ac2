"""Shared fixtures: a real Memory on a temporary directory with a real SQLite catalog."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import kvmem
from tests.servers import PostgresServer, RedisServer

# Tests never read the developer's own settings or cache directory.
for _name in [n for n in os.environ if n.startswith("KVMEM_") and not n.startswith("KVMEM_TEST_")]:
    del os.environ[_name]


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[kvmem.Memory]:
    """A Memory with small CPU and disk tiers under ``tmp_path``."""
    mem = kvmem.Memory(tmp_path / "kvmem", cpu_bytes="64MiB", disk_bytes="512MiB", fsync="never")
    yield mem
    mem.close()


MemoryFactory = Callable[..., kvmem.Memory]
STACKS = {"cpu": ("disk_bytes",), "disk": ("cpu_bytes",), "cpu+disk": ()}  # stack -> the tier sizes it zeroes


@pytest.fixture
def make_memory(tmp_path: Path) -> Iterator[MemoryFactory]:
    """``make_memory(name="kvmem", *, stack="cpu+disk", **settings)``: a Memory at ``tmp_path / name``.

    Each call opens a fresh instance (the same ``name`` opens the same files). Defaults: a 64 MiB
    CPU tier, a 256 MiB disk tier, no fsync; ``settings`` override them, then ``stack`` (``"cpu"``,
    ``"disk"`` or ``"cpu+disk"``) leaves out the tier it does not name. Every instance is closed at
    teardown, last opened first.
    """
    made: list[kvmem.Memory] = []

    def make(name: str = "kvmem", *, stack: str = "cpu+disk", **settings: object) -> kvmem.Memory:
        options: dict[str, object] = {"cpu_bytes": "64MiB", "disk_bytes": "256MiB", "fsync": "never", **settings}
        options.update(dict.fromkeys(STACKS[stack], 0))
        mem = kvmem.Memory(str(tmp_path / name), **options)  # type: ignore[arg-type]
        made.append(mem)
        return mem

    yield make
    for mem in reversed(made):
        mem.close()


@pytest.fixture
def kv_value() -> dict[str, torch.Tensor]:
    """A small KV-shaped value: one chunk of 2 layers, GQA layout [batch, kv_heads, tokens, head_dim]."""
    g = torch.Generator().manual_seed(0)
    return {"k": torch.randn(2, 1, 4, 32, 16, generator=g), "v": torch.randn(2, 1, 4, 32, 16, generator=g)}


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis URL: ``KVMEM_TEST_REDIS_URL``, or a throwaway server for this session (see tests/servers.py)."""
    if os.environ.get("KVMEM_TEST_REDIS_URL"):
        yield os.environ["KVMEM_TEST_REDIS_URL"]
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A throwaway Redis server of this test's own, to stop and start (faults)."""
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PostgreSQL URL: ``KVMEM_TEST_POSTGRES_URL``, or a throwaway cluster for this session."""
    if os.environ.get("KVMEM_TEST_POSTGRES_URL"):
        yield os.environ["KVMEM_TEST_POSTGRES_URL"]
        return
    server = PostgresServer(tmp_path_factory.mktemp("postgres"))
    yield server.url
    server.remove()


@pytest.fixture
def postgres_server(tmp_path: Path) -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL cluster of this test's own, to stop and start (faults)."""
    server = PostgresServer(tmp_path / "postgres")
    yield server
    server.remove()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test, restored after: small models only spin-wait on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``cuda``-marked tests skip without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # NOTE: not `in item.keywords`: that matches tests/cuda/
            item.add_marker(skip)
