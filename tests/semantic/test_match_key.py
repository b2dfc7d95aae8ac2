"""What a semantic match hands back: the caller's key and a one-call load, and nothing printed."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvmem import Memory


def test_lookup_prints_no_progress_bar(
    mem: Memory, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """An application logging at INFO (sentence-transformers' cue for its "Batches" bar) sees no bar."""
    caplog.set_level(logging.INFO)
    mem.store("faq/7", "answer", text="How do I rotate my API token every ninety days?")
    mem.lookup_similar("How can I rotate my API token every ninety days?")
    captured = capfd.readouterr()
    assert "Batches" not in captured.err + captured.out


def test_a_match_names_the_callers_key_and_loads_in_one_call(mem: Memory) -> None:
    answer = {"steps": ["open settings", "choose 'reset password'"]}
    mem.store("faq/42", answer, text="How do I reset my password?", namespace="tenant-a")
    [match] = mem.lookup_similar("I forgot my password, how do I reset it?", namespace="tenant-a")
    assert (match.key, match.namespace) == ("faq/42", "tenant-a")
    assert match.storage_key == mem.storage_key("faq/42", "tenant-a")
    assert mem.load_match(match) == answer
    assert mem.load(match.key, namespace=match.namespace) == answer


# a key far past the catalog's 256-character preview, one with a lone surrogate (no database takes it as
# text), and bytes that are not UTF-8: each must come back exactly, of the type given
KEYS = ["faq/" + "x" * 1000, "faq/\udc80", b"\xff\x00faq"]


@pytest.mark.parametrize("key", KEYS, ids=["long", "surrogate", "bytes"])
def test_the_key_comes_back_whole_after_a_reopen(tmp_path, embedder, key: str | bytes) -> None:
    with Memory(str(tmp_path), embedder=embedder) as mem:
        mem.store(key, "answer", text="What is the capital of France?")
    with Memory(str(tmp_path), embedder=embedder) as mem:  # NOTE: the index is read back from its table
        [match] = mem.lookup_similar("Which city is the capital of France?")
        assert match.key == key and type(match.key) is type(key)
        assert mem.load(match.key) == "answer" == mem.load_match(match)


def test_load_match_of_an_entry_gone_since_returns_the_default(mem: Memory) -> None:
    mem.store("faq/1", "answer", text="How can I cancel my subscription?")
    [match] = mem.lookup_similar("What is the way to cancel my subscription?")
    mem.delete("faq/1")
    assert mem.load_match(match) is None
    assert mem.load_match(match, "gone") == "gone"
