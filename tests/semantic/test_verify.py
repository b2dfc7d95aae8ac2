"""The strict verifier on its own: each rule rejects its near misses and lets paraphrases through.

No embedder here: these are the second stage's verdicts on pairs that (with
all-MiniLM-L6-v2) score above the threshold. The cases are written for this
file, not taken from the benchmark's evaluation sets.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmem.semantic import RuleVerifier
from kvmem.semantic.verify import differs, reason

REJECTED = [  # (query, candidate, rule that must fire)
    ("What is the population of Norway?", "What is the population of Sweden?", "protected"),
    ("When did Dr. Okafor join the clinic?", "When did Dr. Haddad join the clinic?", "protected"),
    ("Is a 3-year-old allowed on the ride?", "Is a seven-year-old allowed on the ride?", "protected"),
    ("Can I return it within 30 days?", "Can I return it within 14 days?", "protected"),
    ("Does the hotel have parking?", "Does the hotel not have parking?", "protected"),
    ("Which plans don't include support?", "Which plans include support?", "protected"),
    ("How many ounces in a pound?", "How many grams in a pound?", "unit"),
    ("Is the pharmacy open late on Fridays?", "Is the pharmacy closed late on Fridays?", "opposite"),
    ("How do I log in to the portal?", "How do I log out of the portal?", "opposite"),
    ("Which is the cheapest flight to Oslo?", "Which is the priciest flight to Oslo?", "opposite"),
    ("How do I unmute my microphone?", "How do I mute my microphone?", "opposite"),
    ("Is it legal to park here overnight?", "Is it illegal to park here overnight?", "opposite"),
    ("Does Lyon have a bigger stadium than Nice?", "Does Nice have a bigger stadium than Lyon?", "order"),
    ("Does the teacher owe the landlord money?", "Does the landlord owe the teacher money?", "order"),
    ("How do I convert a PNG to a JPEG?", "How do I convert a JPEG to a PNG?", "order"),
    ("Trains from Leeds to York tonight?", "Are there trains to Leeds from York tonight?", "direction"),
]
ACCEPTED = [  # paraphrases the rules must not touch
    ("What is the population of Norway?", "How many people live in Norway?"),
    ("In Rust, how do I read a file?", "How do I read a file in Rust?"),
    ("Who designed the roof of the Sydney Opera House?", "Who designed the Sydney Opera House roof?"),
    ("What's the best way to store fresh basil so it lasts?", "How should I keep basil fresh for longer?"),
    ("How do I remove a user from the group?", "Steps for taking someone out of a group?"),
    ("HOW DO I RESET MY ROUTER", "How do I reset my router?"),
    ("How Do I Reset My Router?", "how do i reset my router"),
    ("How much protein should I eat daily?", "How much protein should I eat per day?"),
    ("How many calories are in one apple?", "How many calories are in an apple?"),
    ("Is the Wi-Fi free in the lobby?", "Is the wifi free in the lobby?"),
    ("In what year did the Berlin Wall fall?", "When did the Berlin Wall fall?"),
    ("Who wrote the Shakespearean sonnets?", "Who wrote Shakespeare's sonnets?"),
]


@pytest.mark.parametrize("query,candidate,rule", REJECTED)
def test_near_miss_rejected_by_its_rule(query, candidate, rule):
    why = reason(query, candidate)
    assert why is not None and why.split(":")[0] == rule, why
    assert not RuleVerifier().accepts(query, candidate)


@pytest.mark.parametrize("query,candidate", ACCEPTED)
def test_paraphrase_accepted(query, candidate):
    assert reason(query, candidate) is None
    assert RuleVerifier().accepts(query, candidate)


def test_one_sided_polar_word_is_not_an_opposite():
    assert reason("What is the fastest way to learn Go?", "How do I learn Go quickly?") is None
    assert (
        reason("What is the fastest way to learn Go?", "What is the slowest way to learn Go?")
        == "opposite: fastest/slowest"
    )


def test_one_word_swapped_is_another_question():
    """Two texts equal but for one block of one or two words: the block is the question (errs strict)."""
    assert reason("Can rabbits eat grapes?", "Can hamsters eat grapes?") == "substitution: rabbit/hamster"
    assert reason("Can guinea pigs eat grapes?", "Can rabbits eat grapes?") == "substitution: guinea pig/rabbit"
    # a synonym swap is a miss too: the rules cannot tell synonyms from co-hyponyms
    assert reason("How do I remove a user from the group?", "How can I delete a user from the group?") is not None
    # the same word in another form is not a swap
    assert reason("How do I stream games on Twitch?", "How do I stream gameplay on Twitch?") is None


def test_similar_names_stay_apart():
    assert differs("Flights to Austria?", "Flights to Australia?")
    assert differs("How do I sort a list in Java?", "How do I sort a list in JavaScript?")


_WORDS = st.sampled_from(
    [
        "open",
        "closed",
        "Paris",
        "Rome",
        "from",
        "to",
        "not",
        "10",
        "km",
        "miles",
        "the",
        "store",
        "of",
        "capital",
        "is",
        "unlock",
        "lock",
        "Dr.",
        "five-year-old",
        "a",
        "?",
    ]
)
_TEXTS = st.lists(_WORDS, min_size=1, max_size=10).map(" ".join)


@given(_TEXTS)
def test_a_text_always_matches_itself(text):
    assert reason(text, text) is None


@given(_TEXTS, _TEXTS)
def test_verdict_is_symmetric(a, b):
    assert differs(a, b) == differs(b, a)
