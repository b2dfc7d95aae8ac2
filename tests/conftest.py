"""Shared fixtures: a real Memory on a temporary directory with a real SQLite catalog."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvmem

# Tests never read the developer's own settings or cache directory.
for _name in [n for n in os.environ if n.startswith("KVMEM_") and not n.startswith("KVMEM_TEST_")]:
    del os.environ[_name]


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[kvmem.Memory]:
    """A Memory with small CPU and disk tiers under ``tmp_path``."""
    mem = kvmem.Memory(tmp_path / "kvmem", cpu_bytes="64MiB", disk_bytes="512MiB", fsync="never")
    yield mem
    mem.close()


@pytest.fixture
def kv_value() -> dict[str, torch.Tensor]:
    """A small KV-shaped value: one chunk of 2 layers, GQA layout [batch, kv_heads, tokens, head_dim]."""
    g = torch.Generator().manual_seed(0)
    return {"k": torch.randn(2, 1, 4, 32, 16, generator=g), "v": torch.randn(2, 1, 4, 32, 16, generator=g)}


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
        if "cuda" in item.keywords:
            item.add_marker(skip)
