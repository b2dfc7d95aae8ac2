"""examples/langgraph_agent.py end to end: the agent's process is SIGKILLed mid-run and a new process resumes
its thread from the last checkpoint (KVMemSaver), its tool reading a KVMemStore, its prompts' KV in kvmem."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.examples_loader import load_example

PACKAGE = Path(__file__).resolve().parents[1]
LOOKUPS = 6


def test_the_killed_agent_resumes_from_its_last_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PACKAGE), os.environ.get("PYTHONPATH", "")]))
    example = load_example("langgraph_agent.py")
    report = example.main(["--path", str(tmp_path / "kvmem"), "--lookups", str(LOOKUPS), "--kill-after", "3"])
    assert report.killed_after == 3 and report.killed_pid not in (os.getpid(), report.resumed["pid"])
    # the killed process left a thread mid-run: some model replies checkpointed, not all
    assert 1 <= report.answered_at_kill <= 3 and report.checkpoints_at_kill >= 3
    # the new process made only the calls the checkpoint lacked (a restart would make all LOOKUPS + 1)
    assert report.resumed["calls"] == LOOKUPS + 1 - report.answered_at_kill
    # one history: the resumed checkpoints carry on the killed process's steps, each the child of the one before
    assert report.steps == list(range(-1, len(report.steps) - 1)) and report.parents_chain
    assert report.steps[report.checkpoints_at_kill - 1] == report.resumed_from_step
    # what it ends with is what a run never killed ends with
    assert report.resumed["messages"] == report.reference["messages"]
    assert [m[0] for m in report.resumed["messages"]] == ["human"] + ["ai", "tool"] * LOOKUPS + ["ai"]
    assert report.resumed["messages"][-1][1].endswith(f"answer: {LOOKUPS} orders checked")
    # and its first prompt was read from the chunks the killed process stored, not computed
    first = report.resumed_usage[0]
    assert first["cache_read"] > 0 and first["computed"] < first["cache_read"]
