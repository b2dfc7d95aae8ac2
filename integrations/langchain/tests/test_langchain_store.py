"""KVMemStore: InMemoryStore's behaviours against a real kvmem on disk, TTL, async, and two processes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from langchain_core.embeddings import Embeddings
from langgraph.store.base import GetOp, InvalidNamespaceError, ListNamespacesOp, PutOp, SearchOp
from sqlalchemy import func, select

import kvmem
from kvmem.errors import TierUnavailable
from langchain_kvmem import store as store_module
from langchain_kvmem.store import KVMemEmbeddings, KVMemStore
from tests.catalog.damage import FAULTS, damage_sqlite

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PACKAGE = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


class WordEmbeddings(Embeddings):
    """Bag of words hashed into ``dims`` slots (blake2b: the same in every process): cosine = word overlap."""

    def __init__(self, dims: int = 64) -> None:
        self.dims = dims

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._embed(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._embed(text)

    def _embed(self, text: str) -> list[float]:
        vec = [0.0] * self.dims
        for word in re.findall(r"[a-z0-9]+", text.lower()):
            vec[int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "big") % self.dims] += 1.0
        return vec


@pytest.fixture
def mem(tmp_path: Path) -> Iterator[kvmem.Memory]:
    with kvmem.Memory(str(tmp_path / "kvmem")) as m:
        yield m


@pytest.fixture
def store(mem: kvmem.Memory) -> KVMemStore:
    return KVMemStore(mem)


@pytest.fixture
def indexed(mem: kvmem.Memory) -> KVMemStore:
    return KVMemStore(mem, index={"dims": 64, "embed": WordEmbeddings(), "fields": ["text"]})


def keys(results: list) -> list[str]:
    return [r.key for r in results]


def test_put_get_update_delete(store: KVMemStore) -> None:
    store.put(("users", "1"), "prefs", {"theme": "dark", "n": [1, 2], "deep": {"a": None}})
    item = store.get(("users", "1"), "prefs")
    assert item is not None and item.value == {"theme": "dark", "n": [1, 2], "deep": {"a": None}}
    assert item.namespace == ("users", "1") and item.key == "prefs"
    assert item.created_at == item.updated_at and item.created_at.tzinfo is not None
    time.sleep(0.01)
    store.put(("users", "1"), "prefs", {"theme": "light"})
    again = store.get(("users", "1"), "prefs")
    assert again is not None and again.value == {"theme": "light"}
    assert again.created_at == item.created_at and again.updated_at > item.updated_at  # created is kept
    store.delete(("users", "1"), "prefs")
    assert store.get(("users", "1"), "prefs") is None
    store.delete(("users", "1"), "prefs")  # deleting nothing is fine
    assert store.get(("nobody",), "nothing") is None


def test_batch_reads_see_the_state_before_its_puts_and_the_last_put_wins(store: KVMemStore) -> None:
    ns = ("docs",)
    store.put(ns, "k", {"v": 1})
    results = store.batch(
        [
            PutOp(ns, "k", {"v": 2}),
            GetOp(ns, "k"),
            SearchOp(ns),
            ListNamespacesOp(),
            PutOp(ns, "k", {"v": 3}),
            PutOp(ns, "new", {"v": 4}),
        ]
    )
    assert results[0] is None and results[4] is None and results[5] is None
    assert results[1].value == {"v": 1} and [r.value for r in results[2]] == [{"v": 1}]
    assert results[3] == [ns]
    assert store.get(ns, "k").value == {"v": 3} and store.get(ns, "new").value == {"v": 4}
    with pytest.raises(TypeError):
        store.batch([object()])  # type: ignore[list-item]


def test_namespace_isolation_and_label_rules(store: KVMemStore) -> None:
    for ns in [("users", "1"), ("users", "10"), ("users", "1", "notes"), ("Users", "1"), ("a_",), ("ab",), ("a%",)]:
        store.put(ns, "k", {"ns": list(ns)})
    assert store.get(("users", "1"), "k").value == {"ns": ["users", "1"]}
    assert store.get(("users", "10"), "k").value == {"ns": ["users", "10"]}
    assert [r.namespace for r in store.search(("users", "1"))] == [("users", "1"), ("users", "1", "notes")]
    assert [r.namespace for r in store.search(("Users",))] == [("Users", "1")]  # case matters
    assert [r.namespace for r in store.search(("a_",))] == [("a_",)]  # "_" and "%" are no wildcards
    assert [r.namespace for r in store.search(("a%",))] == [("a%",)]
    assert len(store.search((), limit=100)) == 7
    store.delete(("users", "1"), "k")
    assert store.get(("users", "10"), "k") is not None and store.get(("users", "1", "notes"), "k") is not None
    for bad in [(), ("a.b",), ("a", ""), ("langgraph", "x")]:
        with pytest.raises(InvalidNamespaceError):
            store.put(bad, "k", {"v": 1})
    with pytest.raises(InvalidNamespaceError):
        store.batch([PutOp(("a.b",), "k", {"v": 1})])  # also past the public API: "." joins labels
    with pytest.raises(InvalidNamespaceError):
        store.batch([GetOp(("a", "b\x00"), "k")])
    store.batch([PutOp(("langgraph", "x"), "k", {"v": 1})])  # as InMemoryStore: only put() guards the root
    assert store.get(("langgraph", "x"), "k").value == {"v": 1}


DOCS = [
    ("doc1", {"text": "red apple", "color": "red", "score": 4.5, "tags": ["fruit"], "meta": {"lang": "en"}}),
    ("doc2", {"text": "red car", "color": "red", "score": 3.0, "tags": ["vehicle"], "meta": {"lang": "de"}}),
    ("doc3", {"text": "green apple", "color": "green", "score": 4.0, "tags": ["fruit"], "meta": {"lang": "en"}}),
    ("doc4", {"text": "blue car", "color": "blue", "score": 3.5, "tags": ["vehicle", "fast"]}),
    ("doc5", {"text": "no score", "color": "blue", "name": "zed"}),
]


def test_search_filters_and_operators(store: KVMemStore) -> None:
    for key, value in DOCS:
        store.put(("test",), key, value)

    def found(flt: dict) -> list[str]:
        return keys(store.search(("test",), filter=flt))

    assert found({"color": "red"}) == ["doc1", "doc2"]
    assert found({"color": {"$eq": "blue"}}) == ["doc4", "doc5"]
    assert found({"color": {"$ne": "red"}}) == ["doc3", "doc4", "doc5"]
    assert found({"score": {"$gt": 3.5}}) == ["doc1", "doc3"]
    assert found({"score": {"$gte": 3.5}}) == ["doc1", "doc3", "doc4"]
    assert found({"score": {"$lt": 4}}) == ["doc2", "doc4"]  # doc5 has no score: excluded, no error
    assert found({"score": {"$lte": 4.0, "$gt": 3.0}}) == ["doc3", "doc4"]
    assert found({"score": {"$gte": 3.0}, "color": "red"}) == ["doc1", "doc2"]
    assert found({"tags": ["fruit"]}) == ["doc1", "doc3"]  # lists compare whole
    assert found({"meta": {"lang": "en"}}) == ["doc1", "doc3"]  # dicts compare field by field
    assert found({"meta.lang": "de"}) == ["doc2"]  # dotted keys reach nested fields
    assert found({"name": {"$gt": "a"}}) == ["doc5"]  # strings order as strings
    assert found({"missing": None}) == ["doc1", "doc2", "doc3", "doc4", "doc5"]
    assert found({"color": "purple"}) == []
    with pytest.raises(ValueError, match="Unsupported operator"):
        found({"score": {"$regex": "x"}})


def test_search_order_and_pagination(store: KVMemStore) -> None:
    for i in range(6):
        store.put(("p", "a" if i % 2 else "b"), f"k{i}", {"i": i, "even": i % 2 == 0})
    # grouped by namespace (oldest first), creation order inside
    assert keys(store.search(("p",))) == ["k0", "k2", "k4", "k1", "k3", "k5"]
    store.put(("p", "b"), "k0", {"i": 0, "even": True, "updated": True})  # an update keeps its place
    assert keys(store.search(("p", "b"))) == ["k0", "k2", "k4"]
    store.delete(("p", "b"), "k0")
    store.put(("p", "b"), "k0", {"i": 0, "even": True})  # delete + put: last
    assert keys(store.search(("p", "b"))) == ["k2", "k4", "k0"]
    # ("p", "b") lost its oldest item: ("p", "a") (oldest k1) comes first now
    assert keys(store.search(("p",))) == ["k1", "k3", "k5", "k2", "k4", "k0"]
    assert keys(store.search(("p",), limit=2)) == ["k1", "k3"]
    assert keys(store.search(("p",), limit=2, offset=2)) == ["k5", "k2"]
    assert keys(store.search(("p",), limit=10, offset=5)) == ["k0"]
    assert keys(store.search(("p",), filter={"even": True}, limit=2, offset=1)) == ["k4", "k0"]
    assert keys(store.search(("p",), offset=10)) == []
    assert all(r.score is None for r in store.search(("p",)))


def test_list_namespaces(store: KVMemStore) -> None:
    namespaces = [
        ("a", "b", "c"),
        ("a", "b", "d", "e"),
        ("a", "b", "d", "i"),
        ("a", "b", "f"),
        ("a", "c", "f"),
        ("b", "a", "f"),
        ("users", "123"),
        ("users", "456", "settings"),
        ("admin", "users", "789"),
    ]
    assert store.list_namespaces() == []
    store.batch([PutOp(ns, f"id_{i}", {"i": i}) for i, ns in enumerate(namespaces)])
    assert store.list_namespaces(prefix=("a", "b")) == [
        ("a", "b", "c"),
        ("a", "b", "d", "e"),
        ("a", "b", "d", "i"),
        ("a", "b", "f"),
    ]
    assert store.list_namespaces(suffix=("f",)) == [("a", "b", "f"), ("a", "c", "f"), ("b", "a", "f")]
    assert store.list_namespaces(prefix=("a",), suffix=("f",)) == [("a", "b", "f"), ("a", "c", "f")]
    assert store.list_namespaces(prefix=("a", "b"), max_depth=3) == [("a", "b", "c"), ("a", "b", "d"), ("a", "b", "f")]
    assert store.list_namespaces(max_depth=1) == [("a",), ("admin",), ("b",), ("users",)]
    assert store.list_namespaces(prefix=("a", "b"), limit=2) == [("a", "b", "c"), ("a", "b", "d", "e")]
    assert store.list_namespaces(prefix=("a", "b"), offset=2) == [("a", "b", "d", "i"), ("a", "b", "f")]
    assert store.list_namespaces(prefix=("a", "*", "f")) == [("a", "b", "f"), ("a", "c", "f")]
    assert store.list_namespaces(suffix=("*", "f")) == [("a", "b", "f"), ("a", "c", "f"), ("b", "a", "f")]
    assert store.list_namespaces(prefix=("*", "users")) == [("admin", "users", "789")]
    assert store.list_namespaces(prefix=("users", "*"), suffix=("*", "settings")) == [("users", "456", "settings")]
    assert store.list_namespaces(prefix=("nonexistent",)) == []
    assert store.list_namespaces(prefix=("users", "123")) == [("users", "123")]
    store.delete(("users", "123"), "id_6")  # a namespace lives while it holds an item
    assert store.list_namespaces(prefix=("users",)) == [("users", "456", "settings")]
    with pytest.raises(InvalidNamespaceError):
        store.list_namespaces(prefix=("a.b",))


def test_list_namespaces_pagination(store: KVMemStore) -> None:
    store.batch([PutOp(("namespace", f"sub_{i:02d}"), "k", {"i": i}) for i in reversed(range(20))])
    assert store.list_namespaces(prefix=("namespace",), limit=5) == [("namespace", f"sub_{i:02d}") for i in range(5)]
    assert store.list_namespaces(prefix=("namespace",), limit=5, offset=15) == [
        ("namespace", f"sub_{i:02d}") for i in range(15, 20)
    ]


def test_semantic_search_scores_filters_and_pages(indexed: KVMemStore) -> None:
    for key, value in DOCS[:4]:
        indexed.put(("test",), key, value)
    results = indexed.search(("test",), query="apple")
    assert keys(results)[:2] in (["doc1", "doc3"], ["doc3", "doc1"])
    assert all(isinstance(r.score, float) and -1.0 <= r.score <= 1.0 for r in results)
    assert [r.score for r in results] == sorted((r.score for r in results), reverse=True)
    assert keys(indexed.search(("test",), query="apple", filter={"color": "red"})) == ["doc1", "doc2"]
    assert keys(indexed.search(("test",), query="car", filter={"color": "red"})) == ["doc2", "doc1"]
    assert keys(indexed.search(("test",), query="blue", filter={"score": {"$gt": 3.2}}))[0] == "doc4"
    page1 = indexed.search(("test",), query="red car", limit=2)
    page2 = indexed.search(("test",), query="red car", limit=2, offset=2)
    assert keys(page1) == ["doc2", "doc1"] and keys(page2) == ["doc4", "doc3"]  # equal scores: store order
    # without a query (or an empty one) a search is filter-only, unscored
    assert all(r.score is None for r in indexed.search(("test",), query=""))


def test_semantic_updates_index_overrides_and_max_pooling(indexed: KVMemStore) -> None:
    ns = ("mem",)
    indexed.put(ns, "doc1", {"text": "zany zebra xerxes"})
    indexed.put(ns, "doc2", {"text": "something about dogs"})
    first = indexed.search(ns, query="zany xerxes")[0]
    assert first.key == "doc1"
    indexed.put(ns, "doc1", {"text": "new text about dogs"})  # the update re-embeds
    after = {r.key: r.score for r in indexed.search(ns, query="zany xerxes")}
    assert after["doc1"] < first.score
    indexed.put(ns, "doc3", {"text": "zany zebra xerxes"}, index=False)  # stored, never embedded
    ranked = indexed.search(ns, query="zany zebra xerxes")
    assert ranked[-1].key == "doc3" and ranked[-1].score is None
    indexed.put(ns, "doc1", {"text": "zany zebra xerxes"}, index=False)  # a put replaces the vectors
    assert {r.key: r.score for r in indexed.search(ns, query="zany")}["doc1"] is None
    indexed.put(ns, "doc4", {"text": "unrelated", "title": "zany zebra"}, index=["title"])
    assert indexed.search(ns, query="zany zebra")[0].key == "doc4"
    indexed.put(ns, "doc5", {"text": "ignored", "notes": ["cats purr", "zany xerxes zebra"]}, index=["notes[*]"])
    assert indexed.search(ns, query="zany xerxes zebra")[0].key == "doc5"  # the best of its vectors counts
    assert indexed.search(ns, query="zany xerxes zebra")[0].score == pytest.approx(1.0)


def test_query_without_index_is_ignored_and_bad_dims_raise(store: KVMemStore, mem: kvmem.Memory) -> None:
    store.put(("x",), "k", {"text": "hello"})
    assert [(r.key, r.score) for r in store.search(("x",), query="hello")] == [("k", None)]
    wrong = KVMemStore(mem, index={"dims": 8, "embed": WordEmbeddings(64)})
    with pytest.raises(ValueError, match="dims is 8"):
        wrong.put(("x",), "k2", {"text": "hello"})
    assert wrong.get(("x",), "k2") is None  # nothing written
    with pytest.raises(kvmem.ConfigError):
        KVMemStore(mem, index={"embed": WordEmbeddings()})


@pytest.mark.slow  # loads all-MiniLM-L6-v2 (some 5 s)
def test_semantic_search_with_kvmems_own_embedder(mem: kvmem.Memory) -> None:
    store = KVMemStore(mem, index={"fields": ["memory"]})  # embed, dims: the memory's offline embedder
    assert isinstance(store.embeddings, KVMemEmbeddings) and store.dims == 384
    memories = {
        "pet": "The user has a golden retriever called Biscuit.",
        "food": "The user is vegetarian and dislikes mushrooms.",
        "work": "The user works as a nurse on night shifts.",
    }
    for key, text in memories.items():
        store.put(("memories", "u1"), key, {"memory": text})
    store.put(("memories", "u2"), "pet", {"memory": "The user owns two cats."})
    assert store.search(("memories", "u1"), query="What kind of dog does the user own?")[0].key == "pet"
    assert store.search(("memories", "u1"), query="dietary restrictions for dinner")[0].key == "food"
    top = store.search(("memories",), query="Which pets does the user have?", limit=2)
    assert {r.namespace for r in top} == {("memories", "u1"), ("memories", "u2")} and top[0].score > 0.3


class Clock:
    """A settable clock for the store's TTL arithmetic (the module's ``time``; nothing else is touched)."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=clock.time))
    return clock


def rows(store: KVMemStore) -> int:
    """Item rows in the database, expired or not."""
    with store.memory.database.connection() as conn:
        return conn.execute(select(func.count()).select_from(store_module.items)).scalar_one()


def test_ttl_expiry_refresh_and_sweep(mem: kvmem.Memory, clock: Clock) -> None:
    store = KVMemStore(mem, ttl={"default_ttl": 1.0, "refresh_on_read": True})
    assert store.supports_ttl
    ns = ("ttl",)
    store.put(ns, "default", {"v": 1})  # 1 minute
    store.put(ns, "forever", {"v": 2}, ttl=None)
    store.put(ns, "short", {"v": 3}, ttl=0.5)
    store.put(("ttl", "gone"), "x", {"v": 4}, ttl=0.5)
    clock.now += 20
    assert store.get(ns, "default") is not None  # refreshed: expires 80 s from the start
    clock.now += 20
    assert keys(store.search(ns, refresh_ttl=False)) == ["default", "forever"]  # "short" expired, unswept
    assert store.get(ns, "short") is None
    assert store.list_namespaces(prefix=("ttl",)) == [("ttl",)]  # only expired items: not listed
    assert rows(store) == 4
    clock.now += 30  # 70 s: "default" lives on thanks to the refresh
    assert store.get(ns, "default", refresh_ttl=False) is not None
    clock.now += 15  # 85 s
    assert store.get(ns, "default") is None
    assert store.sweep_ttl() == 3 and store.sweep_ttl() == 0 and rows(store) == 1
    store.put(ns, "search", {"v": 5}, ttl=1.0)
    clock.now += 50
    assert keys(store.search(ns)) == ["forever", "search"]  # a search refreshes what it returns
    clock.now += 50
    assert keys(store.search(ns)) == ["forever", "search"]
    clock.now += 61
    assert keys(store.search(ns)) == ["forever"]


def test_ttl_put_over_an_expired_item_is_a_new_item(mem: kvmem.Memory, clock: Clock) -> None:
    store = KVMemStore(mem, ttl={"refresh_on_read": False})
    store.put(("t",), "k", {"v": 1}, ttl=1.0)
    store.put(("t",), "other", {"v": 0})
    first = store.get(("t",), "k")
    clock.now += 30
    assert store.get(("t",), "k") is not None  # refresh_on_read off: still expires 60 s after the put
    clock.now += 31
    assert store.get(("t",), "k") is None
    store.put(("t",), "k", {"v": 2})
    again = store.get(("t",), "k")
    assert again.value == {"v": 2} and again.created_at > first.created_at
    assert keys(store.search(("t",))) == ["other", "k"]


def test_ttl_on_the_wall_clock_and_the_sweeper(mem: kvmem.Memory) -> None:
    store = KVMemStore(mem, ttl={"default_ttl": 0.5 / 60, "sweep_interval_minutes": 0.05 / 60})
    store.put(("w",), "k", {"v": 1})
    assert store.get(("w",), "k", refresh_ttl=False) is not None
    future = store.start_ttl_sweeper()
    try:
        deadline = time.monotonic() + 10
        while rows(store) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rows(store) == 0 and store.get(("w",), "k") is None
    finally:
        assert store.stop_ttl_sweeper(timeout=5)
    assert future.result(timeout=5) is None


def test_async_api_and_an_async_embedding_function(mem: kvmem.Memory) -> None:
    words = WordEmbeddings()

    async def embed(texts: list[str]) -> list[list[float]]:  # async only: the sync batch() cannot use it
        await asyncio.sleep(0)
        return words.embed_documents(texts)

    store = KVMemStore(mem, index={"dims": 64, "embed": embed, "fields": ["text"]})

    async def main() -> None:
        await asyncio.gather(
            *(
                store.aput(("a", str(i % 2)), f"k{i}", {"text": f"item {i} of {'odd' if i % 2 else 'even'}"})
                for i in range(6)
            )
        )
        assert (await store.aget(("a", "1"), "k3")).value == {"text": "item 3 of odd"}
        assert (await store.asearch(("a",), query="odd", limit=3))[0].namespace == ("a", "1")
        assert await store.alist_namespaces(prefix=("a",)) == [("a", "0"), ("a", "1")]
        await store.adelete(("a", "1"), "k3")
        assert await store.aget(("a", "1"), "k3") is None

    asyncio.run(main())
    with pytest.raises(ValueError, match="async function"):
        store.put(("a",), "sync", {"text": "x"})


def test_abatch_leaves_the_event_loop_free_while_the_database_is_locked(store: KVMemStore) -> None:
    """Another process's write lock makes a put wait; the loop goes on meanwhile (it even ends the wait)."""
    db = store.memory._catalog.engine.url.database
    store.put(("warm",), "k", {"v": 0})

    async def main() -> tuple[int, float]:
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # holds the write lock
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        async def release() -> None:
            await asyncio.sleep(0.3)
            other.execute("COMMIT")
            other.close()

        ticker = asyncio.create_task(tick())
        start = time.monotonic()
        await asyncio.gather(store.aput(("locked",), "k", {"v": 1}), release())
        ticker.cancel()
        return ticks, time.monotonic() - start

    ticks, took = asyncio.run(main())
    assert ticks >= 10 and took < 10
    assert store.get(("locked",), "k").value == {"v": 1}


def test_a_graph_keeps_memories_in_the_store(store: KVMemStore) -> None:
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph
    from langgraph.runtime import Runtime

    class State(TypedDict):
        user: str
        note: str
        seen: list[str]

    def remember(state: State, runtime: Runtime) -> dict:
        ns = ("memories", state["user"])
        runtime.store.put(ns, str(len(runtime.store.search(ns))), {"text": state["note"]})
        return {"seen": [item.value["text"] for item in runtime.store.search(ns)]}

    async def aremember(state: State, runtime: Runtime) -> dict:
        ns = ("memories", state["user"])
        await runtime.store.aput(ns, str(len(await runtime.store.asearch(ns))), {"text": state["note"]})
        return {"seen": [item.value["text"] for item in await runtime.store.asearch(ns)]}

    def graph(node: object) -> object:
        builder = StateGraph(State)
        builder.add_node("remember", node)
        builder.add_edge(START, "remember")
        builder.add_edge("remember", END)
        return builder.compile(store=store)

    graph(remember).invoke({"user": "u1", "note": "likes tea", "seen": []})
    out = asyncio.run(graph(aremember).ainvoke({"user": "u1", "note": "lives in Oslo", "seen": []}))
    assert out["seen"] == ["likes tea", "lives in Oslo"]
    assert graph(remember).invoke({"user": "u2", "note": "x", "seen": []})["seen"] == ["x"]


CHILD = """
import json, sys
import kvmem
from kvmem.errors import TierUnavailable
from langchain_kvmem.store import KVMemEmbeddings, KVMemStore
from test_langchain_store import WordEmbeddings

with kvmem.Memory(sys.argv[1]) as mem:
    store = KVMemStore(mem, index={"dims": 64, "embed": WordEmbeddings(), "fields": ["text"]}, ttl={})
    seen = {"get": store.get(("shared",), "a").value,
            "search": [r.key for r in store.search(("shared",), query="blue sky", filter={"n": {"$gte": 1}})],
            "namespaces": store.list_namespaces()}
    store.put(("shared",), "from-child", {"text": "written by the child", "n": 9})
    store.delete(("shared",), "b")
    print(json.dumps(seen), flush=True)
    for i in range(100):
        store.put(("child",), f"k{i}", {"i": i})
"""


def test_two_processes_share_a_store(tmp_path: Path) -> None:
    path = str(tmp_path / "kvmem")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(PACKAGE), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    with kvmem.Memory(path) as mem:
        store = KVMemStore(mem, index={"dims": 64, "embed": WordEmbeddings(), "fields": ["text"]})
        store.put(("shared",), "a", {"text": "green grass", "n": 0})
        store.put(("shared",), "b", {"text": "blue sky", "n": 1})
        store.put(("shared",), "c", {"text": "blue sea", "n": 2})
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        seen = json.loads(child.stdout.readline() or "null")
        for i in range(100):  # both processes write at once
            store.put(("parent",), f"k{i}", {"i": i})
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert seen == {"get": {"text": "green grass", "n": 0}, "search": ["b", "c"], "namespaces": [["shared"]]}
        # the same store object sees the child's writes: nothing is cached per process
        assert store.get(("shared",), "b") is None
        assert store.search(("shared",), query="the child")[0].key == "from-child"
        assert len(store.search(("child",), limit=1000)) == 100 and len(store.search(("parent",), limit=1000)) == 100
    with kvmem.Memory(path) as mem:  # and a reopened one
        assert KVMemStore(mem).list_namespaces() == [("child",), ("parent",), ("shared",)]


def test_a_database_outage_is_reported_without_its_password(tmp_path: Path) -> None:
    """PostgreSQL trusts loopback here, so it takes the passwords in the URL and ignores them: a real URL."""
    from tests.servers import PostgresServer

    server = PostgresServer(tmp_path / "pg")
    url = server.url.replace("://postgres@", "://postgres:PW-user@") + "?password=PW-query"
    try:
        with kvmem.Memory(str(tmp_path / "kvmem"), catalog_url=url, fsync="never") as mem:
            store = KVMemStore(mem)
            store.put(("ns",), "k", {"v": 1})
            server.stop()
            with pytest.raises(TierUnavailable, match=r"postgres:\*\*\*@.*\?password=\*\*\*") as gone:
                store.get(("ns",), "k")
            assert "PW-" not in str(gone.value), gone.value
    finally:
        server.remove()


def item_rows(mem: kvmem.Memory) -> list[list[dict]]:
    """Every row of the item and vector tables, in key order."""
    with mem.database.connection() as conn:
        return [
            [dict(r) for r in conn.execute(select(table).order_by(*table.primary_key.columns)).mappings()]
            for table in (store_module.items, store_module.vectors)
        ]


def seen_by_readers(store: KVMemStore) -> list:
    """What readers see (no TTL refreshed): gets, plain, query, filter and paged searches, namespaces."""

    def shown(found: list) -> list:
        return [None if i is None else (i.namespace, i.key, i.value, i.created_at, i.updated_at) for i in found] + [
            getattr(i, "score", None) for i in found
        ]

    gets = [store.get(ns, k, refresh_ttl=False) for ns, k in [(("docs", "a"), "1"), (("docs", "b"), "2")]]
    return [
        shown(gets + [store.get(("docs", "a"), "gone"), store.get(("notes",), "x", refresh_ttl=False)]),
        shown(store.search(("docs",), refresh_ttl=False)),
        shown(store.search((), query="red pears", refresh_ttl=False)),
        shown(store.search((), filter={"n": {"$gt": 1}}, refresh_ttl=False)),
        shown(store.search(("docs",), limit=1, offset=1, refresh_ttl=False)),
        store.list_namespaces(),
        store.list_namespaces(prefix=("docs",), max_depth=1),
    ]


@pytest.mark.parametrize("fault", FAULTS)
def test_items_survive_a_damaged_catalog(tmp_path: Path, clock: Clock, fault: str) -> None:
    path = tmp_path / "kvmem"
    index = {"dims": 64, "embed": WordEmbeddings(), "fields": ["text"]}
    with kvmem.Memory(str(path)) as mem:
        store = KVMemStore(mem, index=index)
        store.put(("docs", "a"), "1", {"text": "red apples and pears", "n": 1})
        clock.now += 1
        store.put(("docs", "b"), "2", {"text": "green pears", "n": 2}, ttl=1.0)
        store.put(("docs", "a"), "3", {"text": "blue sky", "n": 3})
        store.put(("notes",), "x", {"text": "red notes", "n": 4}, index=False)
        store.put(("docs", "a"), "gone", {"text": "deleted"})
        store.put(("docs", "a"), "expired", {"text": "short lived"}, ttl=0.5)
        clock.now += 1
        store.put(("docs", "a"), "1", {"text": "red apples", "n": 10})  # keeps its created_at and its place
        store.delete(("docs", "a"), "gone")
        clock.now += 40
        assert store.get(("docs", "b"), "2") is not None  # its TTL refreshed: expires 100 s from here
        clock.now += 30
        assert store.sweep_ttl() == 1  # "expired"
        seen, rows_before = seen_by_readers(store), item_rows(mem)
    damage_sqlite(path / "catalog.sqlite3", fault)

    with kvmem.Memory(str(path)) as mem:
        store = KVMemStore(mem, index=index)
        assert item_rows(mem) == rows_before  # ids, values, times, TTLs, vectors: byte for byte
        assert seen_by_readers(store) == seen
        clock.now += 20  # past the TTL of "2" before its refresh, within the refreshed one
        assert store.get(("docs", "b"), "2") is not None and store.get(("docs", "a"), "expired") is None
        store.put(("docs", "b"), "new", {"text": "red pears again"})
        assert keys(store.search(("docs",))) == ["1", "3", "2", "new"]
        assert store.search(("docs",), query="red pears again")[0].key == "new"
        assert store.delete(("notes",), "x") is None and len(item_rows(mem)[0]) == 4
    assert len(list((path / "catalog.sqlite3.records" / "langgraph-items").iterdir())) == 4  # one per item
