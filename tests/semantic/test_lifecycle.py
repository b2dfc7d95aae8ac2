"""The semantic index follows the store: evictions, reopen after entries vanished, threads, async callers."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from sqlalchemy import func, select

from kvmem import Memory
from kvmem.semantic import CachedEmbedder, SemanticCache
from kvmem.semantic.layer import semantic_rows

BLOB = b"x" * 60_000
TOPICS = [
    "How do I reset my password?",
    "What is the capital of France?",
    "How do I cancel my subscription?",
    "What are your opening hours?",
    "How can I track my order?",
    "How do I change my email address?",
    "What is the boiling point of water?",
    "Who wrote Pride and Prejudice?",
]


def _row_count(mem: Memory) -> int:
    with mem.database.connection() as conn:
        return conn.execute(select(func.count()).select_from(semantic_rows)).scalar_one()


def _small(path, embedder: CachedEmbedder) -> Memory:
    """Room for about four 60 KB entries in all: storing eight evicts the oldest."""
    return Memory(str(path), embedder=embedder, cpu_bytes=128 * 1024, disk_bytes=256 * 1024)


def test_eviction_removes_the_vector_at_once(tmp_path, embedder):
    with _small(tmp_path, embedder) as mem:
        keys = [mem.store(f"faq/{i}", BLOB, text=text) for i, text in enumerate(TOPICS)]
        gone = [k for k in keys if not mem._tiers.contains(k)]
        assert gone, "the store should have evicted something"
        index = mem.semantic_index()
        for key in keys:
            assert (key in index) == mem._tiers.contains(key)
        mem.flush()
        assert _row_count(mem) == len(keys) - len(gone)
        # the evicted entry's question finds nothing, not a dangling key
        first = TOPICS[keys.index(gone[0])]
        assert [m.storage_key for m in mem.lookup_similar(first, k=8)] == []


def test_reopen_drops_rows_of_entries_evicted_meanwhile(tmp_path, embedder):
    with Memory(str(tmp_path), embedder=embedder) as mem:
        for i, text in enumerate(TOPICS[:3]):
            mem.store(f"faq/{i}", BLOB, text=text)
    # another run evicts faq/0 without ever loading the semantic layer
    with Memory(str(tmp_path)) as mem:
        mem._tiers.delete(mem.storage_key("faq/0"))
    with Memory(str(tmp_path), embedder=embedder) as mem:
        index = mem.semantic_index()
        assert len(index) == 2 and mem.storage_key("faq/0") not in index
        assert _row_count(mem) == 2
        assert mem.lookup_similar(TOPICS[0]) == []
        assert [m.storage_key for m in mem.lookup_similar(TOPICS[1])] == [mem.storage_key("faq/1")]


def test_concurrent_upserts_keep_index_and_table_equal(tmp_path, embedder):
    texts = [f"{t} (variant {v})" for t in TOPICS for v in range(3)]
    embedder.embed(texts)  # NOTE: the race is in the index and the table, not in the model

    def upsert(i: int) -> None:
        mem.store(f"faq/{i % 6}", f"answer {i}", text=texts[i % len(texts)])

    with Memory(str(tmp_path), embedder=embedder) as mem:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(upsert, range(96)))
        index = mem.semantic_index()
        with mem.database.connection() as conn:
            rows = dict(conn.execute(select(semantic_rows.c.key, semantic_rows.c.text)).all())
        assert len(index) == len(rows) == 6
        for key, text in rows.items():
            hits = mem.lookup_similar(text, k=1, threshold=0.999, verify=False)
            assert [(h.storage_key, h.text) for h in hits] == [(key, text)]


class _ThreadRecorder:
    """The real embedder, noting which threads called it."""

    def __init__(self, inner: CachedEmbedder) -> None:
        self.inner, self.threads = inner, set()
        self.name, self.dim, self.threshold = inner.name, inner.dim, inner.threshold

    def embed(self, texts: list[str]) -> np.ndarray:
        self.threads.add(threading.get_ident())
        return self.inner.embed(texts)


def test_async_lookup_and_cache_run_off_the_event_loop(tmp_path, embedder):
    recorder = _ThreadRecorder(embedder)

    async def main() -> tuple[list, object, object]:
        loop_thread = threading.get_ident()
        with Memory(str(tmp_path), embedder=recorder) as mem:
            await asyncio.to_thread(mem.store, "faq", "answer", text=TOPICS[0])
            recorder.threads.clear()
            sc = SemanticCache(memory=mem)
            hits, _ = await asyncio.gather(
                mem.alookup_similar("I forgot my password, how do I reset it?"),
                sc.aput("What are your opening hours?", "9 to 5"),
            )
            got = await sc.aget("What are your opening hours?")
            missed = await sc.aget("What are your closing hours?")
            assert loop_thread not in recorder.threads and recorder.threads
            return hits, got, missed

    hits, got, missed = asyncio.run(main())
    assert [h.text for h in hits] == [TOPICS[0]]
    assert got == "9 to 5" and missed is None


def test_large_namespace_gets_a_graph_that_is_saved_and_reused_on_reopen(tmp_path, embedder, monkeypatch):
    texts = [f"How do I configure feature number {i} of product {chr(65 + i % 26)}?" for i in range(30)]
    with Memory(str(tmp_path), embedder=embedder, semantic_hnsw_from=20) as mem:
        keys = [mem.store(f"doc/{i}", BLOB[:100], text=text, namespace="big") for i, text in enumerate(texts)]
        mem.store("other", BLOB[:100], text=texts[0], namespace="small")
        index = mem.semantic_index()
        assert index.wait(30) and index.kind("big") == "hnsw" and index.kind("small") == "exact"
        assert [m.storage_key for m in mem.lookup_similar(texts[7], namespace="big")] == [keys[7]]
    saved = sorted(p.suffix for p in (tmp_path / "semantic").iterdir())
    assert saved == [".hnsw", ".json"]  # one graph (the small namespace has none), no temporaries

    from kvmem.semantic import HnswIndex

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt although the saved graph matches the rows")

    with monkeypatch.context() as m:
        m.setattr(HnswIndex, "from_exact", no_build)
        with Memory(str(tmp_path), embedder=embedder, semantic_hnsw_from=20) as mem:
            index = mem.semantic_index()
            assert index.kind("big") == "hnsw" and index.wait(0)
            assert [m.storage_key for m in mem.lookup_similar(texts[7], namespace="big")] == [keys[7]]
            assert mem.lookup_similar(texts[7], namespace="small") == []
            assert mem.delete("doc/7", namespace="big")
            assert mem.lookup_similar(texts[7], namespace="big") == []
    builds = []
    real_build = HnswIndex.from_exact

    def counted_build(*args, **kwargs):
        builds.append(1)
        return real_build(*args, **kwargs)

    with Memory(str(tmp_path)) as mem:  # another run, without the semantic layer, deletes an entry
        mem._tiers.delete(mem.storage_key("doc/8", "big"))
    monkeypatch.setattr(HnswIndex, "from_exact", counted_build)
    with Memory(str(tmp_path), embedder=embedder, semantic_hnsw_from=20) as mem:
        index = mem.semantic_index()  # the saved graph holds doc/8: stale, so rebuilt from the rows
        assert index.wait(30) and index.kind("big") == "hnsw" and builds == [1]
        assert len(index) == 29  # 28 in "big", 1 in "small"
        assert mem.lookup_similar(texts[8], namespace="big") == []
        assert [m.storage_key for m in mem.lookup_similar(texts[9], namespace="big")] == [keys[9]]
