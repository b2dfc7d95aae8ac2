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
