"""AgentSession: a persistent, verified hash chain of ReAct steps; forks, conflicts, retention, KV reuse."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zlib
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import lz4.frame
import pytest
import torch
from sqlalchemy import func, select, update
from transformers import LlamaConfig, LlamaForCausalLM

from kvmem import Memory
from kvmem.agent import AgentSession, SessionConflict, SessionNotFound
from kvmem.agent.chain import steps as step_rows
from kvmem.errors import ConfigError, IntegrityError, InvalidKeyError
from tests.workers import append_steps

SYSTEM = "You are a support agent. Use the tools."
REPO = Path(__file__).resolve().parents[2]


def fill(s: AgentSession, n: int, tag: str = "") -> None:
    for i in range(n):
        s.append_step(thought=f"{tag}think {i}", action=f"lookup({i})", observation=f"result {i}")


def step_count(mem: Memory) -> int:
    with mem.database.connection() as conn:
        return conn.execute(select(func.count()).select_from(step_rows)).scalar_one()


def test_append_and_read_back(memory: Memory) -> None:
    s = AgentSession("support-1", memory=memory, system_prompt=SYSTEM)
    step = s.append_step(thought="I should look up the order", action='lookup("A17")', observation="shipped 2 May")
    assert (step.index, step.parent_key, len(step.key)) == (0, None, 64)
    fill(s, 2)
    assert [x.index for x in s.steps] == [0, 1, 2] and s.steps[2].parent_key == s.steps[1].key == s.steps[2 - 1].key
    assert s.head == s.steps[-1].key
    assert s.context() == (
        f'{SYSTEM}\n\nThought: I should look up the order\nAction: lookup("A17")\n'
        "Observation: shipped 2 May\nThought: think 0\nAction: lookup(0)\nObservation: result 0\n"
        "Thought: think 1\nAction: lookup(1)\nObservation: result 1\n"
    )
    again = AgentSession("support-1", memory=memory)  # opening an existing session
    assert again.steps == s.steps and again.context() == s.context() and again.system_prompt == SYSTEM
    with pytest.raises(ConfigError, match="another system prompt"):
        AgentSession("support-1", memory=memory, system_prompt="something else")


def test_resume_in_another_process_after_close(tmp_path: Path) -> None:
    with Memory(tmp_path / "kvmem") as mem:
        s = AgentSession("support-2", memory=mem, system_prompt=SYSTEM)
        fill(s, 4)
        want = {"head": s.head, "context": s.context()}
    code = (
        "import json, sys; from kvmem import Memory; from kvmem.agent import AgentSession\n"
        "mem = Memory(sys.argv[1]); s = AgentSession.resume('support-2', memory=mem)\n"
        "s.append_step('from the child', 'none()', 'ok')\n"
        "print(json.dumps({'head': s.steps[-2].key, 'context': s.context(), 'n': len(s)})); mem.close()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "kvmem")], capture_output=True, text=True, check=True, cwd=REPO
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["head"] == want["head"] and got["n"] == 5
    assert got["context"] == want["context"] + "Thought: from the child\nAction: none()\nObservation: ok\n"
    with Memory(tmp_path / "kvmem") as mem:
        assert AgentSession.resume("support-2", memory=mem).context() == got["context"]
        with pytest.raises(SessionNotFound, match="no agent session 'nobody'"):
            AgentSession.resume("nobody", memory=mem)


def test_fork_shares_steps_and_deletes_only_its_own(memory: Memory) -> None:
    main = AgentSession("main", memory=memory, system_prompt=SYSTEM)
    fill(main, 4)
    branch = main.fork("alt", at=1)
    assert [x.key for x in branch.steps] == [x.key for x in main.steps[:2]] and step_count(memory) == 4
    fill(branch, 2, tag="alt ")
    main.append_step("main goes on", "x()", "y")
    assert step_count(memory) == 4 + 2 + 1  # the first two are stored once
    assert len(main) == 5 and len(branch) == 4 and "alt think" not in main.context()
    assert branch.delete() == 2  # only the branch's own steps
    assert step_count(memory) == 5 and AgentSession.resume("main", memory=memory).steps == main.steps
    empty = main.fork("empty", at=-1)
    assert len(empty) == 0 and empty.context() == f"{SYSTEM}\n\n"
    with pytest.raises(ConfigError, match="a session of that name exists"):
        main.fork("main")
    with pytest.raises(ConfigError, match="at=9"):
        main.fork("alt2", at=9)
    assert main.delete() == 5 and step_count(memory) == 0


def _body(mem: Memory, key: str) -> dict:
    with mem.database.connection() as conn:
        raw = conn.execute(select(step_rows.c.body).where(step_rows.c.key == key)).scalar_one()
    return json.loads(lz4.frame.decompress(raw))


def _set_body(mem: Memory, key: str, body: bytes) -> None:
    with mem.database.transaction() as conn:
        conn.execute(update(step_rows).where(step_rows.c.key == key).values(body=body))


def test_tampered_corrupt_or_missing_steps_are_named(memory: Memory) -> None:
    s = AgentSession("audit", memory=memory, system_prompt=SYSTEM)
    fill(s, 5)
    key = s.steps[2].key
    original = _body(memory, key)
    altered = {**original, "observation": "refunded"}
    _set_body(memory, key, lz4.frame.compress(json.dumps(altered, sort_keys=True, separators=(",", ":")).encode()))
    with pytest.raises(IntegrityError, match=r"session 'audit': step 2 .* was altered"):
        AgentSession.resume("audit", memory=memory)
    _set_body(memory, key, b"\x04\x22\x4d\x18garbage")
    with pytest.raises(IntegrityError, match=r"step 2 .* is corrupt"):
        AgentSession.resume("audit", memory=memory)
    with memory.database.transaction() as conn:
        conn.execute(step_rows.delete().where(step_rows.c.key == key))
    with pytest.raises(IntegrityError, match=r"step 2 .* is missing"):
        AgentSession.resume("audit", memory=memory)


def test_a_stale_writer_gets_a_conflict_never_an_interleaved_chain(memory: Memory) -> None:
    a = AgentSession("shared", memory=memory, system_prompt=SYSTEM)
    b = AgentSession.resume("shared", memory=memory)
    fill(a, 1)
    with pytest.raises(SessionConflict, match="moved on"):
        b.append_step("b's step", "", "")
    assert step_count(memory) == 1  # the loser left nothing behind
    b = AgentSession.resume("shared", memory=memory)
    b.append_step("b's step", "", "")
    assert [x.thought for x in AgentSession.resume("shared", memory=memory).steps] == ["think 0", "b's step"]


def test_concurrent_processes_append_without_losing_or_interleaving(tmp_path: Path) -> None:
    path = str(tmp_path / "kvmem")
    with Memory(path) as mem:
        AgentSession("race", memory=mem, system_prompt=SYSTEM)
    with ProcessPoolExecutor(3, mp_context=get_context("spawn")) as pool:
        list(pool.map(append_steps, [path] * 3, range(3), [8] * 3))
    with Memory(path) as mem:
        chain = AgentSession.resume("race", memory=mem).steps  # verified link by link
    assert len(chain) == 24
    for w in range(3):  # every worker's steps, each exactly once and in its own order
        assert [x.thought for x in chain if x.thought.startswith(f"w{w} ")] == [f"w{w} step {i}" for i in range(8)]


def test_window_folds_old_steps_into_a_summary(memory: Memory) -> None:
    seen: list[list[str]] = []

    def summarize(old: list) -> str:
        seen.append([x.thought for x in old])
        return f"{len(old)} earlier steps"

    s = AgentSession("window", memory=memory, system_prompt=SYSTEM, max_steps=4, summarize=summarize)
    fill(s, 4)
    assert len(s) == 4 and seen == []
    fill(s, 1, tag="new ")
    assert seen == [["think 0", "think 1", "think 2"]]  # down to max_steps // 2 = 2 kept, plus the summary
    assert [x.kind for x in s.steps] == ["summary", "step", "step"]
    assert s.context().startswith(f"{SYSTEM}\n\nSummary of earlier steps: 3 earlier steps\nThought: think 3\n")
    assert AgentSession.resume("window", memory=memory).context() == s.context()
    assert step_count(memory) == 3  # the folded steps are gone


def test_ttl_drops_expired_steps(memory: Memory) -> None:
    now = [1000.0]
    s = AgentSession("ttl", memory=memory, system_prompt=SYSTEM, ttl=60, clock=lambda: now[0])
    fill(s, 2)
    now[0] += 61
    s.append_step("fresh", "", "")
    assert [x.thought for x in s.steps] == ["fresh"] and s.steps[0].parent_key is None


def test_bad_arguments_name_the_value(memory: Memory) -> None:
    with pytest.raises(InvalidKeyError, match="session name ''"):
        AgentSession("", memory=memory)
    with pytest.raises(ConfigError, match="max_steps=1"):
        AgentSession("x", memory=memory, max_steps=1)
    with pytest.raises(ConfigError, match="ttl=0"):
        AgentSession("x", memory=memory, ttl=0)
    s = AgentSession("x", memory=memory)
    with pytest.raises(InvalidKeyError, match="observation of type int"):
        s.append_step("t", "a", 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="attach"):
        s.prefill()


class WordTokenizer:
    """Words and newlines to ids by a hash: a random model has no vocabulary."""

    bos_token_id = 1

    def encode(self, text: str) -> list[int]:
        return [2 + zlib.crc32(w.encode()) % 250 for w in re.findall(r"\S+|\n", text)]


def test_each_step_reuses_the_previous_prompts_full_chunks(memory: Memory) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config).eval()
    s = AgentSession("kv", memory=memory, system_prompt=SYSTEM + " Be brief. " * 6)
    s.attach(model, WordTokenizer(), block_size=16)
    previous = 0
    for i in range(5):
        ids = s.prompt_ids("Thought:")
        result = s.prefill("Thought:")
        s.flush()  # NOTE: the chunks are stored in the background
        assert result.reused_tokens == (previous // 16) * 16  # every full chunk of the last prompt
        with torch.no_grad():
            full = model(ids[None, :]).logits[0, -1]
        torch.testing.assert_close(result.logits[0, -1], full, rtol=1e-4, atol=1e-4)
        previous = len(s.prompt_ids())  # the suffix is not part of the next prompt
        s.append_step(f"step {i} needs a lookup of order {i}", f'lookup("A{i}")', f"order {i} shipped on day {i}")
    assert previous > 100 and result.reused_tokens >= 64
    resumed = AgentSession.resume("kv", memory=memory)
    resumed.attach(model, WordTokenizer(), block_size=16)
    assert torch.equal(resumed.prompt_ids(), s.prompt_ids()) and resumed.context() == s.context()
    assert resumed.prefill().reused_tokens == (previous // 16) * 16 - (16 if previous % 16 == 0 else 0)
