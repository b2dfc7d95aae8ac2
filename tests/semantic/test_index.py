"""Vector indexes: HnswIndex and AutoIndex checked against ExactIndex (the reference), persistence, staleness."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.semantic import AutoIndex, ExactIndex, HnswIndex, VectorIndex
from kvmem.semantic.hnsw import content_digest

DIM = 8


def unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def perturbed(rng: np.random.Generator, x: np.ndarray, cos: float = 0.9) -> np.ndarray:
    """Unit vectors at cosine ``cos`` to the rows of ``x`` (a paraphrase's distance from its source)."""
    noise = rng.standard_normal(x.shape).astype(np.float32)
    noise -= np.sum(noise * x, axis=1, keepdims=True) * x
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    return (cos * x + np.sqrt(1 - cos**2) * noise).astype(np.float32)


def ids_of(results: list[tuple[str, float]]) -> list[str]:
    return [id_ for id_, _ in results]


def check_result(results: list[tuple[str, float]], k: int, live: set[str], allowed: set[str] | None) -> None:
    """What every search must satisfy: at most k, live, allowed, best first, ties by id."""
    eligible = live if allowed is None else live & allowed
    assert len(results) == min(k, len(eligible))
    assert set(ids_of(results)) <= eligible
    keys = [(-score, id_) for id_, score in results]
    assert keys == sorted(keys)


# -- one model of the operations, replayed on every index -------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove"]),
        st.lists(st.integers(0, 40), min_size=1, max_size=6),
        st.integers(0, 2**32 - 1),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=OPS,
    query_seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 6),
    allowed_ids=st.none() | st.sets(st.integers(0, 40), max_size=20),
)
def test_hnsw_and_auto_agree_with_exact(
    ops: list[tuple[str, list[int], int]], query_seed: int, k: int, allowed_ids: set[int] | None
) -> None:
    exact = ExactIndex(DIM)
    others: list[VectorIndex] = [HnswIndex(DIM, m=4, ef_search=64), AutoIndex(DIM, hnsw_from=6, m=4, background=False)]
    live: set[str] = set()
    for op, nums, seed in ops:
        ids = [f"id{n}" for n in nums]
        for index in [exact, *others]:
            if op == "add":
                index.add(ids, unit(np.random.default_rng(seed), len(ids)))
            else:
                assert index.remove(ids) == len(live & set(ids))
        live = live | set(ids) if op == "add" else live - set(ids)
        assert all(len(index) == len(live) for index in [exact, *others])
    allowed = None if allowed_ids is None else {f"id{n}" for n in allowed_ids}
    for query in unit(np.random.default_rng(query_seed), 3):
        want = exact.search(query, k, allowed)
        check_result(want, k, live, allowed)
        for index in others:
            got = index.search(query, k, allowed)
            check_result(got, k, live, allowed)
            # NOTE: a graph of at most 41 nodes searched with ef 64 sees every node: exact here
            assert ids_of(got) == ids_of(want)
            np.testing.assert_allclose([s for _, s in got], [s for _, s in want], atol=1e-5)


def test_ties_break_by_id_whatever_the_insertion_order() -> None:
    vec = unit(np.random.default_rng(0), 1)
    other = unit(np.random.default_rng(1), 1)
    names = ["d", "b", "e", "a", "c"]
    for index_type in (ExactIndex, HnswIndex):
        results = []
        for order in (names, names[::-1], sorted(names)):
            index = index_type(DIM)
            index.add(["far"], other)
            index.add(order, np.repeat(vec, len(order), axis=0))
            results.append(ids_of(index.search(vec[0], 3)))
        assert results == [["a", "b", "c"]] * 3


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], np.ndarray, np.ndarray]:
    """2,000 random 384-d unit vectors and 200 queries at cosine 0.9 to some of them."""
    rng = np.random.default_rng(7)
    vectors = unit(rng, 2000, 384)
    queries = perturbed(rng, vectors[rng.choice(2000, 200, replace=False)])
    return [f"v{i}" for i in range(2000)], vectors, queries


def test_hnsw_recall_at_1_on_2000_vectors(corpus: tuple[list[str], np.ndarray, np.ndarray]) -> None:
    ids, vectors, queries = corpus
    exact, hnsw = ExactIndex(384), HnswIndex(384)
    exact.add(ids, vectors)
    hnsw.add(ids, vectors)
    hits = sum(hnsw.search(q, 1)[0][0] == exact.search(q, 1)[0][0] for q in queries)
    assert hits / len(queries) >= 0.99
    # a large `allowed` goes through the graph with a selector, a small one is scored exactly
    for allowed in (set(ids[::2]), set(ids[:100])):
        for q in queries[:50]:
            got = hnsw.search(q, 5, allowed)
            check_result(got, 5, set(ids), allowed)
        hits = sum(hnsw.search(q, 1, allowed)[0][0] == exact.search(q, 1, allowed)[0][0] for q in queries)
        assert hits / len(queries) >= 0.99


def test_graph_filter_with_tombstones_and_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvmem.semantic.hnsw._EXACT_SUBSET", 0)  # every `allowed` through the graph
    rng = np.random.default_rng(11)
    ids, vectors = [f"f{i}" for i in range(300)], unit(rng, 300)
    exact, hnsw = ExactIndex(DIM), HnswIndex(DIM, rebuild_at=0.5)
    for index in (exact, hnsw):
        index.add(ids, vectors)
        index.remove(ids[::5])  # 60 tombstones, under the rebuild fraction
    assert hnsw.tombstones == 60
    live = set(ids) - set(ids[::5])
    for j, q in enumerate(perturbed(rng, vectors[:40])):
        allowed = set(ids[j % 3 :: 3])  # includes removed ids, which must stay out
        for k in (1, 5):
            got = hnsw.search(q, k, allowed)
            check_result(got, k, live, allowed)
            assert got[0][0] == exact.search(q, 1, allowed)[0][0]


def test_replace_moves_the_vector_and_buries_the_old_one() -> None:
    rng = np.random.default_rng(3)
    a, b = unit(rng, 2)
    index = HnswIndex(DIM, rebuild_at=0.5)
    index.add(["x", "y"], np.stack([a, b]))
    index.add(["x"], b[None, :])  # x now where y is
    assert len(index) == 2 and index.tombstones == 1
    assert sorted(ids_of(index.search(b, 2))) == ["x", "y"]
    assert index.search(a, 2)[0][1] < 1.0 - 1e-3  # nothing is at a any more
    index.add(["x"], b[None, :])  # the same vector again: nothing changes
    assert index.tombstones == 1


def test_rebuild_after_heavy_removal() -> None:
    rng = np.random.default_rng(4)
    ids, vectors = [f"r{i}" for i in range(400)], unit(rng, 400)
    exact, hnsw = ExactIndex(DIM), HnswIndex(DIM, rebuild_at=0.25)
    for index in (exact, hnsw):
        index.add(ids, vectors)
    gone = set(ids[:300])
    for i in range(0, 300, 20):  # removal in batches: several compactions
        for index in (exact, hnsw):
            index.remove(ids[i : i + 20])
        assert hnsw.tombstones <= 0.25 * (len(hnsw) + hnsw.tombstones)
    assert hnsw.rebuilds >= 2 and len(hnsw) == 100
    for q in perturbed(rng, vectors[300:]):
        got = hnsw.search(q, 3)
        assert not gone & set(ids_of(got))
        assert ids_of(got)[0] == ids_of(exact.search(q, 3))[0]
    assert hnsw.remove(ids) == 100 and len(hnsw) == 0 and hnsw.search(vectors[0], 3) == []


def test_auto_index_switches_both_ways() -> None:
    rng = np.random.default_rng(5)
    ids, vectors = [f"a{i}" for i in range(60)], unit(rng, 60)
    auto, exact = AutoIndex(DIM, hnsw_from=40, background=False), ExactIndex(DIM)
    kinds = []
    for i in range(0, 60, 10):
        auto.add(ids[i : i + 10], vectors[i : i + 10])
        exact.add(ids[i : i + 10], vectors[i : i + 10])
        kinds.append(auto.kind)
    assert kinds == ["exact"] * 4 + ["hnsw"] * 2  # past 40, not at 40
    for i in range(0, 45, 5):
        auto.remove(ids[i : i + 5])
        exact.remove(ids[i : i + 5])
        kinds.append(auto.kind)
        assert ids_of(auto.search(vectors[50], 3)) == ids_of(exact.search(vectors[50], 3))
    assert kinds[6:] == ["hnsw"] * 8 + ["exact"]  # 20 left is not below 20; 15 is
    auto.add(ids[:30], vectors[:30])
    assert auto.kind == "hnsw" and len(auto) == 45
    graph = auto._index
    assert isinstance(graph, HnswIndex)
    assert auto.remove([*ids[:35], "absent"]) == 30  # one batch down to 15
    assert auto.kind == "exact" and len(auto) == 15
    assert ids_of(auto.search(vectors[50], 1)) == ["a50"]


def test_auto_index_builds_off_thread_and_replays_changes_made_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(12)
    ids, vectors = [f"b{i}" for i in range(120)], unit(rng, 120)
    started, release = threading.Event(), threading.Event()
    real_build = HnswIndex.from_exact

    def held_build(*args: object, **kwargs: object) -> HnswIndex:
        started.set()
        assert release.wait(10)  # NOTE: holds the build open while the test changes the index
        return real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(HnswIndex, "from_exact", held_build)
    auto, exact = AutoIndex(DIM, hnsw_from=50, rebuild_at=0.25), ExactIndex(DIM)
    for index in (auto, exact):
        index.add(ids[:60], vectors[:60])
    assert started.wait(10) and auto.building and auto.kind == "exact"  # the call did not wait for the graph
    for index in (auto, exact):  # changes while the graph is built from the old rows
        index.add(ids[60:], vectors[60:])
        index.remove(ids[:10])
        index.add(["b20"], vectors[100:101])  # replaced
    assert auto.search(vectors[100], 2) == exact.search(vectors[100], 2)  # served exactly meanwhile
    release.set()
    assert auto.wait(10) and auto.kind == "hnsw" and len(auto) == len(exact) == 110
    graph = auto._index
    assert isinstance(graph, HnswIndex) and graph.tombstones == 11 and set(graph.live.ids) == set(exact.ids)
    for q in perturbed(rng, vectors[10:]):
        assert ids_of(auto.search(q, 1)) == ids_of(exact.search(q, 1))
    for index in (auto, exact):  # 51 tombstones of 121 labels: past a quarter, a fresh graph off-thread
        index.remove(ids[10:50])
    assert auto.wait(10) and auto.kind == "hnsw" and auto._index is not graph
    assert auto._index.tombstones == 0 and len(auto) == 70


def test_save_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    ids, vectors = [f"s{i}" for i in range(300)], unit(rng, 300)
    index = HnswIndex(DIM, m=8, ef_search=40)
    index.add(ids, vectors)
    index.remove(ids[:50])  # tombstones travel too
    path = tmp_path / "ns.hnsw"
    index.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ns.hnsw", "ns.hnsw.json"]  # no temporaries left
    live_ids, live_vectors = ids[50:][::-1], vectors[50:][::-1]  # the caller's row order does not matter
    loaded = HnswIndex.load(path, live_ids, live_vectors)
    assert loaded is not None
    assert (len(loaded), loaded.tombstones, loaded.m, loaded.ef_search) == (250, 50, 8, 40)
    for q in perturbed(rng, vectors[50:]):
        assert loaded.search(q, 4) == index.search(q, 4)
    loaded.add(["new"], vectors[:1])  # labels continue after the loaded ones
    loaded.remove(ids[50:60])
    assert ids_of(loaded.search(vectors[0], 1)) == ["new"] and len(loaded) == 241


def test_stale_or_torn_files_are_ignored(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    ids, vectors = [f"t{i}" for i in range(100)], unit(rng, 100)
    path = tmp_path / "ns.hnsw"
    assert HnswIndex.load(path, ids, vectors) is None  # nothing saved
    index = HnswIndex(DIM)
    index.add(ids, vectors)
    index.save(path)
    assert HnswIndex.load(path, ids, vectors) is not None
    changed = vectors.copy()
    changed[3] = unit(rng, 1)[0]
    assert HnswIndex.load(path, ids, changed) is None  # a vector changed since
    assert HnswIndex.load(path, ids[1:], vectors[1:]) is None  # a row deleted since
    assert HnswIndex.load(path, [*ids, "extra"], np.vstack([vectors, unit(rng, 1)])) is None  # a row added
    assert HnswIndex.load(path, ids, unit(rng, 100, DIM * 2)) is None  # another embedder width
    sidecar = path.with_name("ns.hnsw.json")
    good_sidecar, good_graph = sidecar.read_bytes(), path.read_bytes()

    other = HnswIndex(DIM)  # a crash between the two renames: new graph, old sidecar
    other.add(ids[:99], vectors[:99])
    other.save(tmp_path / "other.hnsw")
    meta = json.loads(good_sidecar)
    damage = [(path, (tmp_path / "other.hnsw").read_bytes()), (path, good_graph[:-10])]  # torn; truncated
    bad_sidecars = ({**meta, "format": 99}, {**meta, "labels": meta["labels"][:-1]}, {**meta, "m": "32"}, [1, 2])
    damage += [(sidecar, json.dumps(bad).encode()) for bad in bad_sidecars]
    damage.append((sidecar, b"\xff not json"))
    for target, data in damage:  # NOTE: a damaged pair is also set aside (tests/semantic/test_recovery.py)
        path.write_bytes(good_graph)
        sidecar.write_bytes(good_sidecar)
        target.write_bytes(data)
        assert HnswIndex.load(path, ids, vectors) is None
    path.write_bytes(good_graph)
    sidecar.write_bytes(good_sidecar)
    assert HnswIndex.load(path, ids, vectors) is not None


def test_auto_index_load_uses_a_current_file_and_rebuilds_a_stale_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(9)
    ids, vectors = [f"u{i}" for i in range(80)], unit(rng, 80)
    path = tmp_path / "ns.hnsw"
    auto = AutoIndex(DIM, hnsw_from=50, background=False)
    auto.add(ids[:40], vectors[:40])
    assert auto.save(path) is False and not path.exists()  # exact: nothing worth saving
    auto.add(ids[40:], vectors[40:])
    assert auto.save(path) is True

    def no_build(*args: object, **kwargs: object) -> HnswIndex:
        raise AssertionError("rebuilt although the saved graph is current")

    with monkeypatch.context() as m:
        m.setattr(HnswIndex, "from_exact", no_build)
        loaded = AutoIndex.load(path, ids, vectors, hnsw_from=50)
    assert loaded.kind == "hnsw" and loaded.search(vectors[7], 2) == auto.search(vectors[7], 2)
    stale = AutoIndex.load(path, ids[:70], vectors[:70], hnsw_from=50, background=False)  # rows deleted: rebuilt
    assert stale.kind == "hnsw" and len(stale) == 70
    assert ids_of(stale.search(vectors[7], 1)) == ["u7"]
    small = AutoIndex.load(path, ids[:20], vectors[:20], hnsw_from=50)
    assert small.kind == "exact" and len(small) == 20
    auto.remove(ids[:60])
    assert auto.kind == "exact" and auto.save(path) is False
    assert not path.exists() and not path.with_name("ns.hnsw.json").exists()


def test_content_digest_ignores_row_order_and_sees_every_byte() -> None:
    vectors = unit(np.random.default_rng(10), 3)
    digest = content_digest(["a", "b", "c"], vectors)
    assert digest == content_digest(["c", "a", "b"], vectors[[2, 0, 1]])
    assert digest != content_digest(["a", "c", "b"], vectors)
    bumped = vectors.copy()
    bumped[1, 0] = np.nextafter(bumped[1, 0], np.float32(2))
    assert digest != content_digest(["a", "b", "c"], bumped)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        HnswIndex(DIM).add(["a", "b"], np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="m=1"):
        HnswIndex(DIM, m=1)
    with pytest.raises(ValueError, match="rebuild_at=1.0"):
        HnswIndex(DIM, rebuild_at=1.0)
    with pytest.raises(ValueError, match="hnsw_from=1"):
        AutoIndex(DIM, hnsw_from=1)
    assert HnswIndex(DIM).search(np.zeros(DIM, dtype=np.float32), 3) == []
    assert ExactIndex(DIM).search(np.zeros(DIM, dtype=np.float32), 0) == []


def test_without_faiss_memory_works_and_auto_index_stays_exact(tmp_path: Path) -> None:
    """faiss is the optional extra kvmem[semantic]: without it (an import that fails, as when it is not
    installed) ``Memory.delete`` works, ``AutoIndex`` searches exactly past ``hnsw_from`` and says so once,
    and ``HnswIndex`` refuses with the extra to install."""
    code = """
import logging, sys
sys.modules["faiss"] = None  # `import faiss` now raises ImportError
import numpy as np
import kvmem
from kvmem.errors import ConfigError
from kvmem.semantic import AutoIndex, HnswIndex
m = kvmem.Memory(sys.argv[1]); m.store("k", 1); assert m.delete("k"); m.close()
warned = []
class Told(logging.Handler):
    def emit(self, record):
        warned.append(record.getMessage())
logging.getLogger("kvmem.semantic.auto").addHandler(Told())
x = np.eye(8, dtype=np.float32)
index = AutoIndex(8, hnsw_from=2, background=False)
index.add([f"v{i}" for i in range(8)], x)
index.add(["w"], x[:1])
assert index.kind == "exact" and index.search(x[3], 1)[0][0] == "v3", index.search(x[3], 1)
assert len(warned) == 1 and "kvmem[semantic]" in warned[0], warned
try:
    HnswIndex(8)
except ConfigError as exc:
    assert "pip install 'kvmem[semantic]'" in str(exc)
else:
    raise AssertionError("HnswIndex was made without faiss")
"""
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
