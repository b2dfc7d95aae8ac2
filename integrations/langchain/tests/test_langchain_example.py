"""examples/langchain_agent_memory.py end to end: a second process recalls by meaning, the cache hits and misses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.examples_loader import load_example

PACKAGE = Path(__file__).resolve().parents[1]


def test_the_example_remembers_across_processes_and_caches_strictly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PACKAGE), os.environ.get("PYTHONPATH", "")]))
    example = load_example("langchain_agent_memory.py")
    report = example.main(["--path", str(tmp_path / "kvmem")])
    assert report.saved == 3 and report.run1[-1] == "ai: Noted, I will remember that."
    assert report.run2["pid"] != os.getpid()
    assert "tool: I am allergic to peanuts." in report.run2["transcript"]  # the nearest of three facts
    assert report.cache == [
        ("What is the capital of France?", "Paris.", False),
        ("What is the capital of France?", "Paris.", True),
        ("What's the capital city of France?", "Paris.", True),
        ("What is the capital of Germany?", "Berlin.", False),
    ]
