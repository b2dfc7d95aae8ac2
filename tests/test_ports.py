"""The closed facade: the feature layers reach the core only through Memory's operations and kvmem/ports.py."""

from __future__ import annotations

import ast
import errno
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

import kvmem
from kvmem.catalog.schema import agent_sessions
from kvmem.errors import ConfigError, TierUnavailable

ROOT = Path(__file__).resolve().parents[1]
FEATURE_LAYERS = [
    "kvmem/kv",
    "kvmem/agent",
    "kvmem/multimodal",
    "kvmem/semantic",
    "integrations/langchain/langchain_kvmem",
    "integrations/vllm/kvmem_vllm",
]
CORE_INTERNALS = ("kvmem.stores", "kvmem.catalog")
SHARED_SCHEMA = "kvmem.catalog.schema"  # NOTE: the tables are declared once; the layers keep theirs there


def _reaches_past_the_facade(path: Path) -> list[str]:
    """Where ``path`` imports the core's internals or touches a ``tiers``/``catalog``/``engine`` attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
            for name in names
            if name.startswith(CORE_INTERNALS) and name != SHARED_SCHEMA
        ]
        if isinstance(node, ast.Attribute) and node.attr in ("tiers", "catalog", "engine"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} touches .{node.attr}")
    return found


def test_no_feature_layer_reaches_past_the_facade() -> None:
    files = [f for layer in FEATURE_LAYERS for f in sorted((ROOT / layer).rglob("*.py"))]
    assert len(files) > 20
    assert [where for f in files for where in _reaches_past_the_facade(f)] == []


def test_memory_keeps_its_tiers_and_catalog_private(memory: kvmem.Memory) -> None:
    assert not hasattr(memory, "tiers") and not hasattr(memory, "catalog")


def test_a_database_transaction_commits_or_rolls_back_whole(memory: kvmem.Memory) -> None:
    row = {"name": "s", "head": None, "length": 0, "system": "", "updated": 0.0}
    with memory.database.transaction() as conn:
        conn.execute(agent_sessions.insert(), row)
    with pytest.raises(RuntimeError), memory.database.transaction() as conn:
        conn.execute(agent_sessions.insert(), {**row, "name": "t"})
        raise RuntimeError("the layer failed half-way")
    with memory.database.connection() as conn:
        assert list(conn.execute(select(agent_sessions.c.name)).scalars()) == ["s"]
    assert memory.database.dialect == "sqlite"
    assert memory.database.shown_url.startswith("sqlite:///") and memory.database.shown_url.endswith(".sqlite3")


def test_the_chunk_store_opens_a_blob_where_it_located_it(memory: kvmem.Memory) -> None:
    skey = memory.store("k", torch.arange(16, dtype=torch.float32))
    store = memory.chunk_store()
    assert store.top == "cpu" and store.locate(skey) == "cpu"
    reader = store.open_blob(skey, "disk")
    assert reader is not None and reader.header["info"]["storage_key"] == skey
    reader.close()
    memory.delete("k")
    assert store.locate(skey) is None and store.open_blob(skey, "cpu") is None


def test_the_chunk_store_names_a_tier_it_does_not_have(memory: kvmem.Memory) -> None:
    with pytest.raises(ConfigError, match=r"tier 'gpu': this memory's tiers are cpu, disk"):
        memory.chunk_store().open_blob("0" * 64, "gpu")


def test_a_chunk_read_that_fails_goes_through_the_tiers_failure_handling(
    memory: kvmem.Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    skey = memory.store("k", torch.arange(4096, dtype=torch.float32))
    reader = memory.chunk_store().open_blob(skey, "disk")
    assert reader is not None

    def eio(*_args: object) -> None:
        raise OSError(errno.EIO, "injected: the disk failed")  # NOTE: a failing disk cannot be made for real

    monkeypatch.setattr(reader._inner, "read_bytes", eio)
    with pytest.raises(TierUnavailable):
        reader.read_bytes(reader.start, reader.start + 64)
    reader.close()
    assert memory.metrics.value("kvmem_tier_errors_total", tier="disk") == 1
    assert memory.chunk_store().open_blob(skey, "disk") is None  # the failed tier is skipped for a while


def test_record_hits_counts_in_the_metrics_and_the_catalog(memory: kvmem.Memory) -> None:
    skeys = [memory.store(k, k.encode()) for k in ("a", "b")]
    memory.record_hits(skeys, "disk")
    memory.record_hits(skeys[:1], "disk")
    assert memory.metrics.value("kvmem_hits_total", tier="disk", kind="tree") == 3
    assert [memory.info(k).hits for k in ("a", "b")] == [2, 1]  # type: ignore[union-attr]
