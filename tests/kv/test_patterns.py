"""RequestPatterns: the online model of which heads follow which (pure: no I/O, no clock)."""

from __future__ import annotations

import random
import re

import pytest

from kvmem.errors import ConfigError
from kvmem.kv import RequestPatterns


def keys(head: str, n: int = 3) -> list[str]:
    return [head] + [f"{head}-{i}" for i in range(1, n)]


def test_learns_a_transition_and_predicts_it_with_its_keys() -> None:
    model = RequestPatterns()
    for _ in range(10):
        model.observe("ns", keys("a"), "s")
        model.observe("ns", keys("b", 4), "s")
    model.observe("ns", keys("a"), "s")
    top = model.predict("ns", "s")[0]
    assert top.head == "b" and top.keys == tuple(keys("b", 4))
    assert top.probability > 0.8


def test_what_one_stream_teaches_predicts_for_another_but_not_across_namespaces() -> None:
    model = RequestPatterns(popular=0)
    for _ in range(10):
        model.observe("ns", keys("a"), "alice")
        model.observe("ns", keys("b"), "alice")
    model.observe("ns", keys("a"), "bob")
    model.observe("other", keys("a"), "bob")
    assert [p.head for p in model.predict("ns", "bob")] == ["b"]
    assert model.predict("other", "bob") == []
    assert model.predict("unknown", "bob") == []


def test_interleaved_streams_keep_their_own_last_head() -> None:
    model = RequestPatterns(popular=0)
    for _ in range(10):  # two sessions interleaved: a->b for one, c->d for the other
        model.observe("ns", keys("a"), "s1")
        model.observe("ns", keys("c"), "s2")
        model.observe("ns", keys("b"), "s1")
        model.observe("ns", keys("d"), "s2")
    model.observe("ns", keys("a"), "s1")
    model.observe("ns", keys("c"), "s2")
    assert model.predict("ns", "s1")[0].head == "b"
    assert model.predict("ns", "s2")[0].head == "d"


def test_decay_forgets_an_old_transition() -> None:
    model = RequestPatterns(successor_half_life=4.0)
    for _ in range(20):
        model.observe("ns", keys("a"), "s")
        model.observe("ns", keys("b"), "s")
    for _ in range(20):
        model.observe("ns", keys("a"), "s")
        model.observe("ns", keys("c"), "s")
    model.observe("ns", keys("a"), "s")
    predicted = [p.head for p in model.predict("ns", "s")]
    assert predicted[0] == "c" and "b" not in predicted  # b fell below min_probability


def test_without_decay_the_old_transition_still_counts() -> None:
    model = RequestPatterns(successor_half_life=1e9)
    for successor in ("b", "c"):
        for _ in range(20):
            model.observe("ns", keys("a"), "s")
            model.observe("ns", keys(successor), "s")
    model.observe("ns", keys("a"), "s")
    assert {p.head for p in model.predict("ns", "s")} == {"b", "c"}


def test_a_rarely_requested_head_keeps_what_follows_it_through_other_traffic() -> None:
    model = RequestPatterns(half_life=8.0, popular=0)
    rng = random.Random(0)
    for _ in range(3):  # rare -> next, each time after ~100 unrelated requests (12 popularity half-lives)
        model.observe("ns", keys("rare"), "s")
        model.observe("ns", keys("next"), "s")
        for _ in range(100):
            model.observe("ns", keys(f"doc{rng.randrange(500)}"), "other")
    model.observe("ns", keys("rare"), "s")
    assert [p.head for p in model.predict("ns", "s")] == ["next"]


def test_the_same_head_again_is_no_transition() -> None:
    model = RequestPatterns(popular=0)
    for _ in range(10):  # a session of three turns on a, then b
        for head in ("a", "a", "a", "b"):
            model.observe("ns", keys(head), "s")
    model.observe("ns", keys("a"), "s")
    [top] = model.predict("ns", "s")
    assert top.head == "b" and top.probability > 0.5  # a -> a is not counted: it would dilute a -> b to 1/3


def test_one_sighting_predicts_only_where_the_namespace_follows_its_paths() -> None:
    model = RequestPatterns(popular=0)
    rng = random.Random(0)
    for i in range(40):  # "paths": a cycle of 10 documents read in order; "flat": documents at random
        model.observe("paths", keys(f"p{i % 10}"), "s")
        model.observe("flat", keys(f"doc{rng.randrange(200)}"), "s")
    for namespace in ("paths", "flat"):
        model.observe(namespace, keys("x"), "t")  # x -> y, seen once
        model.observe(namespace, keys("y"), "t")
        model.observe(namespace, keys("x"), "u")
    [top] = model.predict("paths", "u")
    assert top.head == "y" and top.probability > 0.5
    assert model.predict("flat", "u") == []


def test_popular_heads_are_predicted_for_a_new_stream() -> None:
    model = RequestPatterns()
    for i in range(40):
        model.observe("ns", keys("hot"), f"user{i}")
        model.observe("ns", keys(f"cold{i}"), f"user{i}")
    assert [p.head for p in model.predict("ns", "newcomer")] == ["hot"]


def test_a_structureless_stream_yields_no_prediction() -> None:
    model = RequestPatterns()
    rng = random.Random(0)
    for _ in range(2000):
        model.observe("ns", keys(f"doc{rng.randrange(200)}"), "s")
    assert model.predict("ns", "s") == []


def test_memory_is_bounded() -> None:
    model = RequestPatterns(max_heads=16, max_successors=2, max_streams=4, popular=3)
    rng = random.Random(0)
    for i in range(500):
        model.observe("ns", keys(f"doc{rng.randrange(100)}"), f"s{i % 10}")
    space = model._spaces["ns"]
    assert len(space.heads) == 16 and len(space.last) == 4 and len(space.popular) <= 3
    assert all(len(h.successors) <= 2 for h in space.heads.values())
    assert space.popular <= set(space.heads)


def test_counts_stay_exact_over_many_half_lives() -> None:
    """Counts are weights on a growing scale, brought back to 1 now and then: after 5,000 half-lives
    (20 rescales) the probabilities are still the closed forms of the decayed counts."""
    model = RequestPatterns(half_life=1.0, successor_half_life=1.0, popular=2)
    for _ in range(2500):  # a, b, a, b, ...: every count halves per tick of its clock
        model.observe("ns", keys("a"), "s")
        model.observe("ns", keys("b"), "s")
    # popularity after ..., a, b: b 1 + 1/4 + ... = 4/3 of 1 + 1/2 + ... = 2 requests; a the other third
    predicted = [(p.head, round(p.probability, 9)) for p in model.predict("ns", "new")]
    assert predicted == [("b", 0.666666667), ("a", 0.333333333)]
    # after b, a: 2 transitions out of b (all to a), weight 2 / (2 + prior 4) = 1/3; a is b's likeliest successor
    # and foresight (2 foreseen of 2 tries, + prior 4) 1/3 = a's popularity 1/3: 1/3 * 1 + 2/3 * 1/3 = 5/9
    model.observe("ns", keys("a"), "s")
    model.observe("ns", keys("b"), "s")
    assert round(model.predict("ns", "s")[0].probability, 9) == round(5 / 9, 9)


def test_a_request_shorter_than_a_chunk_teaches_nothing() -> None:
    model = RequestPatterns()
    model.observe("ns", [], "s")
    assert model.predict("ns", "s") == []


@pytest.mark.parametrize(
    ("option", "value", "accepted"),
    [
        ("half_life", 0.5, ">= 1"),
        ("successor_half_life", 0, ">= 1"),
        ("min_probability", 1.5, "(0, 1]"),
        ("prior", -1, "> 0"),
        ("max_heads", 0, ">= 1"),
        ("max_successors", 0, ">= 1"),
        ("popular", -1, ">= 0"),
    ],
)
def test_bad_parameters_are_refused(option: str, value: float, accepted: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{option}={value!r}: accepted") + ".*" + re.escape(accepted)):
        RequestPatterns(**{option: value})  # type: ignore[arg-type]
