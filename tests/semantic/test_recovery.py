"""A damaged saved HNSW graph (or its sidecar) is set aside, counted, and the graph rebuilt from the rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem import Memory
from kvmem.recovery import MARK
from kvmem.semantic import CachedEmbedder

TEXTS = [f"How do I configure feature number {i} of product {chr(65 + i % 26)}?" for i in range(30)]


@pytest.mark.parametrize("damaged", [".hnsw", ".hnsw.json"])
def test_damaged_graph_files_are_set_aside_and_the_graph_rebuilt(
    tmp_path: Path, embedder: CachedEmbedder, damaged: str
) -> None:
    with Memory(str(tmp_path), embedder=embedder, semantic_hnsw_from=20) as mem:
        keys = [mem.store(f"doc/{i}", b"v", text=text, namespace="big") for i, text in enumerate(TEXTS)]
        assert mem.semantic_index().wait(30) and mem.semantic_index().kind("big") == "hnsw"
    [graph] = (tmp_path / "semantic").glob("*.hnsw")
    target = graph.with_name(graph.name + damaged[len(".hnsw") :])
    data = bytearray(target.read_bytes())
    for at in range(40, len(data), max(1, len(data) // 7)):
        data[at] ^= 0xFF
    target.write_bytes(bytes(data))
    with Memory(str(tmp_path), embedder=embedder, semantic_hnsw_from=20) as mem:
        index = mem.semantic_index()
        assert mem.metrics.value("kvmem_recovered_files_total", file="hnsw") == 1
        assert index.wait(30) and index.kind("big") == "hnsw"
        assert [m.storage_key for m in mem.lookup_similar(TEXTS[7], namespace="big")] == [keys[7]]
    aside = sorted(p.name for p in (tmp_path / "semantic").glob(f"*{MARK}*"))
    assert [name.split(MARK)[0] for name in aside] == [graph.name, graph.name + ".json"]
    with Memory(str(tmp_path), embedder=embedder, semantic_hnsw_from=20) as mem:  # saved again, intact
        assert mem.semantic_index().kind("big") == "hnsw"
        assert mem.metrics.total("kvmem_recovered_files_total") == 0
