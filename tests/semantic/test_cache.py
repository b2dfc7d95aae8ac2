"""SemanticCache with the real offline embedder: exact partitions, strict similar hits, chat prompts, TTL."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvmem import Memory, UnsupportedValueError
from kvmem.semantic import CachedEmbedder, SemanticCache

MODEL_X = {"llm": "model-x", "system": "You are a helpful assistant."}


class Clock:
    """A settable clock for TTL tests."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingEmbedder(CachedEmbedder):
    """Counts the texts it is asked to embed."""

    def __init__(self, inner: CachedEmbedder) -> None:
        super().__init__(inner)
        self.calls = 0

    def embed(self, texts):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().embed(texts)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache(mem, clock) -> SemanticCache:
    return SemanticCache(mem, clock=clock)


def test_exact_hit_without_embedding(tmp_path, embedder):
    counting = CountingEmbedder(embedder)
    with Memory(str(tmp_path), embedder=counting) as m:
        sc = SemanticCache(m)
        sc.put("How do I reset my password?", {"answer": "Use the link."}, MODEL_X)
        calls = counting.calls
        assert sc.get("How do I reset my password?", MODEL_X) == {"answer": "Use the link."}
        assert counting.calls == calls  # NOTE: the exact hit never ran the embedder


def test_paraphrase_hit(cache):
    cache.put("How do I reset my password?", "Use the reset link.", MODEL_X)
    assert cache.get("I forgot my password, how to reset it?", MODEL_X) == "Use the reset link."


@pytest.mark.parametrize(
    ("stored", "query"),
    [
        ("What is the capital of France?", "What is the capital of Germany?"),
        ("Is the store open on Sunday?", "Is the store closed on Sunday?"),
    ],
)
def test_near_miss_misses(cache, stored, query):
    cache.put(stored, "cached", MODEL_X)
    assert cache.get(query, MODEL_X) is None
    assert cache.get(stored, MODEL_X) == "cached"


@pytest.mark.parametrize(
    "other",
    [
        {"llm": "model-y", "system": MODEL_X["system"]},
        {"llm": "model-x", "system": "You are a pirate."},
        {"llm": "model-x"},
        None,
    ],
)
def test_other_partition_never_hits(cache, other):
    prompt = "How do I reset my password?"
    cache.put(prompt, "model-x answer", MODEL_X)
    assert cache.get(prompt, other) is None
    assert cache.get("I forgot my password, how to reset it?", other) is None
    assert cache.get(prompt, dict(reversed(list(MODEL_X.items())))) == "model-x answer"  # key order is canonical


def test_user_namespace_isolates(mem):
    a, b = SemanticCache(mem, namespace="tenant-a"), SemanticCache(mem, namespace="tenant-b")
    a.put("How do I reset my password?", "tenant-a answer", MODEL_X)
    assert b.get("How do I reset my password?", MODEL_X) is None
    assert a.get("How do I reset my password?", MODEL_X) == "tenant-a answer"


def _chat(history: list[tuple[str, str]], last: str) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in history] + [{"role": "user", "content": last}]


HISTORY = [
    ("system", "You are a travel agent."),
    ("user", "I want to visit Italy."),
    ("assistant", "Great choice! Which city?"),
]


def test_chat_history_is_exact(cache):
    cache.put(_chat(HISTORY, "How do I reset my password?"), "answer", MODEL_X)
    other = [HISTORY[0], ("user", "I want to visit Spain."), HISTORY[2]]
    assert cache.get(_chat(other, "How do I reset my password?"), MODEL_X) is None
    assert cache.get(_chat(HISTORY[:1], "How do I reset my password?"), MODEL_X) is None
    assert cache.get("How do I reset my password?", MODEL_X) is None
    assert cache.get(_chat(HISTORY, "I forgot my password, how to reset it?"), MODEL_X) == "answer"


def test_chat_turns_are_embedded(mem):
    sc = SemanticCache(mem, turns=2)
    ns, text = sc.split(_chat(HISTORY, "How do I reset my password?"), MODEL_X)
    assert text == "I want to visit Italy.\nGreat choice! Which city?\nHow do I reset my password?"
    ns2, _ = sc.split(_chat([HISTORY[0], ("user", "x"), ("assistant", "y")], "q"), MODEL_X)
    ns3, _ = sc.split(_chat([("system", "other"), ("user", "x"), ("assistant", "y")], "q"), MODEL_X)
    assert ns == ns2 != ns3  # NOTE: only the system message is left outside the embedded turns
    with pytest.raises(UnsupportedValueError, match="user message"):
        sc.split([{"role": "system", "content": "hi"}])


def test_ttl_expiry(cache, clock, mem):
    cache.put("How do I reset my password?", "short-lived", MODEL_X, ttl=10)
    cache.put("What is the capital of France?", "Paris", MODEL_X)
    clock.now += 9.9
    assert cache.get("How do I reset my password?", MODEL_X) == "short-lived"
    assert cache.get("I forgot my password, how to reset it?", MODEL_X) == "short-lived"
    clock.now += 0.2
    assert cache.get("I forgot my password, how to reset it?", MODEL_X) is None
    assert cache.get("How do I reset my password?", MODEL_X) is None
    ns, text = cache.split("How do I reset my password?", MODEL_X)
    assert not mem.contains(text, namespace=ns)  # NOTE: the expired entry was deleted
    assert mem.lookup_similar(text, namespace=ns) == []
    assert cache.get("What is the capital of France?", MODEL_X) == "Paris"  # no TTL: never expires


def test_ttl_real_clock(mem):
    sc = SemanticCache(mem)
    sc.put("How do I reset my password?", "short-lived", MODEL_X, ttl=0.0)
    assert sc.get("How do I reset my password?", MODEL_X) is None


def test_invalidate_removes_bad_hit(cache):
    cache.put("How do I reset my password?", "wrong answer", MODEL_X)
    query = "I forgot my password, how to reset it?"
    assert cache.get(query, MODEL_X) == "wrong answer"
    assert cache.invalidate(query, MODEL_X) is True
    assert cache.get(query, MODEL_X) is None
    assert cache.get("How do I reset my password?", MODEL_X) is None
    assert cache.invalidate(query, MODEL_X) is False
