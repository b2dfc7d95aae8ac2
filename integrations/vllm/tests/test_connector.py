"""KVMemConnector on vLLM-CPU: real engines on a random-weight tiny Llama, each in a process of its own.

Five engine starts cover everything (each start costs ~30-70 s on two cores):

1. ``base``: vLLM alone (no connector), the reference tokens and top logprobs;
2. ``store``: a producer (``kv_producer``: saves, never loads) over an empty local store and a throwaway
   Redis: everything computed, saved;
3. ``shared``: a consumer (``kv_consumer``: loads, never saves), a second instance with empty local tiers
   and the same Redis: it decodes with the first one's KV (the prefill/decode hand-off);
4. ``restart``: ``kv_both`` on the first store reopened without Redis (an engine restart, from disk), with
   one stored block of prompt C flipped on disk first: C's block fails its CRC, is recomputed and stored again;
5. ``preempt``: ``kv_both`` on a fresh store, the prompts run together in a KV space of 17 blocks (and the
   null block): A and B are admitted, B is preempted when decoding needs a block, its saves in flight are
   finished before its blocks are written again, and it comes back loading its saved chunks.

vLLM's own prefix cache is off in every run, so ``num_cached_tokens`` counts the tokens the connector loaded.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import engine_run

import kvmem
from kvmem.keys import chunk_hashes
from tests.servers import RedisServer

CHUNK_TOKENS = 256  # kvmem's block_size: two vLLM CPU blocks of 128
MAX_TOKENS = 128  # decoding crosses a block boundary (the preemption run needs it)
LOCAL = {"compression": "none", "cpu_bytes": "256MiB", "disk_bytes": "1GiB", "block_size": CHUNK_TOKENS}

_rng = random.Random(0)
A = [_rng.randrange(512) for _ in range(1025)]  # 1024 tokens in full chunks: all but the last token loadable
B = A[:512] + [_rng.randrange(512) for _ in range(388)]  # shares A's first two chunks
C = [_rng.randrange(512) for _ in range(700)]
PROMPTS = {"A": A, "B": B, "C": C}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("KVMEM_TEST_REDIS_URL"):
        yield os.environ["KVMEM_TEST_REDIS_URL"]
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"))  # NOTE: fails under CI when redis-server is missing
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def runs(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("engines")
    first, second = str(work / "kv-first"), str(work / "kv-second")
    model = str(tiny_llama)
    out: dict[str, Any] = {"work": work, "first": first, "redis_url": redis_url}
    names = list(PROMPTS)

    def run(name: str, extra: dict[str, Any] | None, which: list[str], role: str = "kv_both", **job: Any) -> None:
        prompts = [PROMPTS[n] for n in which]
        result = engine_run(
            work, name, model=model, prompts=prompts, extra_config=extra, role=role, max_tokens=MAX_TOKENS, **job
        )
        out[name] = {"start_s": result["start_s"], "preemptions": result["preemptions"]}
        out[name] |= dict(zip(which, result["prompts"]))

    run("base", None, names)
    run("store", {"path": first, "remote_url": redis_url, **LOCAL}, names, role="kv_producer")
    run("shared", {"path": second, "remote_url": redis_url, **LOCAL}, names, role="kv_consumer")
    out["corrupted"] = _flip_stored_block(first, C, chunk=1, block=0)
    run("restart", {"path": first, **LOCAL}, ["A", "C"])
    # NOTE: A takes 9 blocks, B 8 (C waits): B's 9th block, at its 125th token, is not there
    run("preempt", {"path": str(work / "kv-third"), **LOCAL}, names, batch=True, num_gpu_blocks_override=18)
    return out


def _namespace(path: str) -> str:
    """The connector's namespace, read off the store (every entry of this test's store has it)."""
    with kvmem.Memory(path, cpu_bytes=0) as mem:
        spaces = {e.namespace for e in mem.entries()}
    assert len(spaces) == 1 and next(iter(spaces)).startswith("vllm/"), spaces
    return next(iter(spaces))


def _flip_stored_block(path: str, tokens: list[int], *, chunk: int, block: int) -> dict[str, str]:
    """Flip one byte of a stored block's file (bit rot on disk, made for real); the block's key and namespace."""
    ns = _namespace(path)
    key = f"{chunk_hashes(tokens, CHUNK_TOKENS, ns)[chunk]}/{block}"
    with kvmem.Memory(path, cpu_bytes=0) as mem:
        skey = mem.storage_key(key, ns)
    (file,) = [p for p in Path(path).rglob(f"*{skey}*") if p.is_file()]
    data = bytearray(file.read_bytes())
    data[len(data) - 100] ^= 0xFF
    file.write_bytes(bytes(data))
    return {"key": key, "namespace": ns}


def assert_same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Greedy tokens equal and top logprobs equal (to float32 rounding of a differently batched prefill)."""
    assert got["tokens"] == want["tokens"]
    assert len(got["logprobs"]) == len(want["logprobs"])
    for step_got, step_want in zip(got["logprobs"], want["logprobs"]):
        assert step_got.keys() == step_want.keys()
        for token, logprob in step_want.items():
            assert step_got[token] == pytest.approx(logprob, abs=1e-4)


def test_a_producer_saves_and_gives_vllm_alone_s_tokens(runs: dict[str, Any]) -> None:
    for name in PROMPTS:
        assert_same_output(runs["store"][name], runs["base"][name])
        assert runs["store"][name]["cached"] == 0  # a producer never loads, not even B's chunks shared with A
    assert "0 block(s) loaded, 0 failed and recomputed, 14 saved" in (runs["work"] / "store.log").read_text()


def test_a_consumer_instance_decodes_with_the_producer_s_kv_through_redis(runs: dict[str, Any]) -> None:
    shared = runs["shared"]
    for name in PROMPTS:
        assert_same_output(shared[name], runs["base"][name])
    assert shared["A"]["cached"] >= 0.9 * len(A)
    assert shared["A"]["cached"] == 1024  # every full chunk; the last prompt token is always computed
    assert shared["B"]["cached"] == 768 and shared["C"]["cached"] == 512  # whole chunks only
    assert "18 block(s) loaded, 0 failed and recomputed, 0 saved" in (runs["work"] / "shared.log").read_text()


def test_an_engine_restart_reuses_from_disk(runs: dict[str, Any]) -> None:
    assert_same_output(runs["restart"]["A"], runs["base"]["A"])
    assert runs["restart"]["A"]["cached"] == 1024


def test_a_corrupted_block_is_recomputed_not_used(runs: dict[str, Any]) -> None:
    assert_same_output(runs["restart"]["C"], runs["base"]["C"])
    log = (runs["work"] / "restart.log").read_text()
    assert "1 block(s) failed to load" in log  # counted and reported to vLLM, which recomputed it
    key, ns = runs["corrupted"]["key"], runs["corrupted"]["namespace"]
    with (
        kvmem.Memory(runs["first"], cpu_bytes=0) as restored,
        kvmem.Memory(str(runs["work"] / "kv-check"), cpu_bytes=0, disk_bytes=0, remote_url=runs["redis_url"]) as intact,
    ):
        again = restored.load(key, namespace=ns)  # the recomputed block, saved again with a good CRC
        original = intact.load(key, namespace=ns)
    assert isinstance(again, torch.Tensor) and isinstance(original, torch.Tensor)
    assert torch.equal(again, original)


def test_a_preempted_request_s_saves_finish_before_its_blocks_are_reused(runs: dict[str, Any]) -> None:
    preempt = runs["preempt"]
    assert preempt["preemptions"] >= 1
    for name in PROMPTS:  # NOTE: a save reading blocks already written by another request would show here
        assert_same_output(preempt[name], runs["base"][name])
    (loaded, failed) = re.findall(
        r"kvmem: (\d+) block\(s\) loaded, (\d+) failed", (runs["work"] / "preempt.log").read_text()
    )[-1]
    assert int(loaded) > 0 and int(failed) == 0  # back from preemption, B loads the chunks saved before
