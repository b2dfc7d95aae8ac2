"""``PrefixCache`` on tiny real transformers models (random weights, fixed seeds) and a real ``Memory``.

Reuse must be exact: the logits of a prefill that loads its prefix equal those of a
full forward pass (fp32, lossless chunks), and greedy ``generate`` gives the same
tokens, whether the prefix comes from the CPU tier or, in a fresh process, from disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

import kvmem
from kvmem.errors import ConfigError, InvalidKeyError
from kvmem.kv import PrefillResult, PrefixCache, model_fingerprint
from kvmem.kv import prefix as prefix_module
from kvmem.kv.background import WriteBehind
from kvmem.kv.layout import cache_argument
from tests.kv.conftest import MemoryFactory, ModelFactory, Reference
from tests.kv.workers import ARCHS, BLOCK, NEW_TOKENS, PROMPT_A, PROMPT_B, SHARED, VOCAB, build_model, prompt

PrefixCacheFactory = Callable[..., PrefixCache]
WORKERS = str(Path(__file__).with_name("workers.py"))
EXACT = 1e-5


def _max_diff(result: PrefillResult, full_logits: torch.Tensor) -> float:
    """Largest logit difference between a prefill and a full forward pass, over the computed positions."""
    assert result.logits.shape == (1, result.computed_tokens, VOCAB)
    return (result.logits - full_logits[:, result.reused_tokens :]).abs().max().item()


def _full_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _tokens(memory: kvmem.Memory, kind: str) -> int:
    return int(memory.metrics.value("kvmem_kv_tokens_total", kind=kind))


def _chunk_hits(memory: kvmem.Memory, tier: str) -> int:
    return int(memory.metrics.value("kvmem_kv_chunk_hits_total", tier=tier))


# -- exact reuse, per architecture ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_reuse_from_cpu_tier_is_exact(
    arch: str,
    tiny_model: ModelFactory,
    reference: Callable[[str], Reference],
    make_memory: MemoryFactory,
    prefix_cache: PrefixCacheFactory,
) -> None:
    model, ref = tiny_model(arch), reference(arch)
    memory = make_memory()
    pc = prefix_cache(model, memory)

    first = pc.prefill(PROMPT_A)
    assert (first.reused_tokens, first.computed_tokens) == (0, PROMPT_A.shape[1])
    pc.flush()

    result = pc.prefill(PROMPT_B)
    assert (result.reused_tokens, result.computed_tokens) == (SHARED, PROMPT_B.shape[1] - SHARED)
    assert _chunk_hits(memory, "cpu") == SHARED // BLOCK
    assert _max_diff(result, ref.logits) <= EXACT

    # the returned cache decodes on exactly like a full pass (sliding layers trimmed to their window)
    nxt = ref.generated[:, PROMPT_B.shape[1] : PROMPT_B.shape[1] + 1]
    with torch.no_grad():
        step = model(nxt, use_cache=True, **{cache_argument(model): result.cache}).logits[:, -1]
    full_step = _full_logits(model, torch.cat([PROMPT_B, nxt], dim=1))[:, -1]
    assert (step - full_step).abs().max().item() <= EXACT

    reused_before = _tokens(memory, "reused")
    out = pc.generate(PROMPT_B, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert _tokens(memory, "reused") - reused_before == SHARED
    assert torch.equal(out, ref.generated)


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_chunks_are_reused(
    arch: str,
    tiny_model: ModelFactory,
    reference: Callable[[str], Reference],
    make_memory: MemoryFactory,
    prefix_cache: PrefixCacheFactory,
) -> None:
    """int8 KV is lossy: its accuracy is reported, not asserted (a trained model is what measures it)."""
    model, ref = tiny_model(arch), reference(arch)
    memory = make_memory()
    pc = prefix_cache(model, memory, compression="int8")
    pc.prefill(PROMPT_A)
    pc.flush()
    key = pc.chunk_keys(PROMPT_A)[0]
    info = memory.info(key, namespace=pc.namespace)
    assert info is not None and info.codec == "int8"
    assert info.stored_size < info.size  # a lossless blob is larger than its raw tensors (header, CRC)

    result = pc.prefill(PROMPT_B)
    assert result.reused_tokens == SHARED
    assert torch.isfinite(result.logits).all()
    full = ref.logits[:, SHARED:]
    agree = (result.logits.argmax(-1) == full.argmax(-1)).float().mean().item()
    last = bool(result.logits[0, -1].argmax() == full[0, -1].argmax())
    print(
        f"\n{arch} int8 KV: top-1 agreement {agree:.0%} over {result.computed_tokens} computed positions, "
        f"last position {'agrees' if last else 'differs'}, max |dlogit| {_max_diff(result, ref.logits):.2e}"
    )


# -- chunk boundaries -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (BLOCK - 5, 0),  # shorter than one chunk: nothing to share
        (3 * BLOCK, 3 * BLOCK - 1),  # exactly 3 chunks: the last token is always computed
        (3 * BLOCK + 1, 3 * BLOCK),  # 3 chunks + 1 token
    ],
)
def test_repeat_prompt_reuse_at_chunk_boundaries(
    length: int, expected: int, tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model, memory = tiny_model("llama"), make_memory()
    pc = prefix_cache(model, memory)
    ids = prompt(7, length)
    assert pc.prefill(ids).reused_tokens == 0
    pc.flush()
    assert pc.lookup(ids) == length // BLOCK * BLOCK

    again = pc.prefill(ids)
    assert (again.reused_tokens, again.computed_tokens) == (expected, length - expected)
    assert _max_diff(again, _full_logits(model, ids)) <= EXACT
    pc.flush()  # a repeat stores nothing again, not even the chunk its last token was computed in
    assert [memory.info(k, namespace=pc.namespace).version for k in pc.chunk_keys(ids)] == [1] * (length // BLOCK)


def test_divergence_inside_chunk_2_reuses_the_chunks_before_it(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    pc = prefix_cache(model, make_memory())
    ids = prompt(8, 4 * BLOCK + 3)
    pc.prefill(ids)
    pc.flush()

    changed = ids.clone()
    changed[0, 2 * BLOCK + 5] = (changed[0, 2 * BLOCK + 5] + 1) % VOCAB  # one token inside chunk 2 (0-based)
    assert pc.lookup(changed) == 2 * BLOCK
    result = pc.prefill(changed)
    assert result.reused_tokens == 2 * BLOCK
    assert _max_diff(result, _full_logits(model, changed)) <= EXACT


def test_two_prompts_sharing_3_chunks(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    pc = prefix_cache(model, make_memory())
    shared = prompt(9, 3 * BLOCK)
    first = torch.cat([shared, prompt(10, 2 * BLOCK + 4)], dim=1)
    second = torch.cat([shared, prompt(11, 2 * BLOCK + 4)], dim=1)
    pc.prefill(first)
    pc.flush()

    assert pc.lookup(first) == 5 * BLOCK
    assert pc.lookup(second) == 3 * BLOCK
    result = pc.prefill(second)
    assert result.reused_tokens == 3 * BLOCK
    assert _max_diff(result, _full_logits(model, second)) <= EXACT
    pc.flush()
    assert pc.lookup(second) == 5 * BLOCK  # its own chunks were stored after the divergence


# -- model fingerprint ------------------------------------------------------------------------------------------


def test_same_config_different_weights_never_share_chunks(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    base, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert base.config.to_dict() == other.config.to_dict()
    assert model_fingerprint(base) != model_fingerprint(other)
    assert model_fingerprint(base) == model_fingerprint(build_model("llama", seed=0))

    memory = make_memory()
    pc_base, pc_other = prefix_cache(base, memory), prefix_cache(other, memory)
    ids = prompt(12, 3 * BLOCK + 2)
    pc_base.prefill(ids)
    pc_base.flush()
    assert pc_base.lookup(ids) == 3 * BLOCK

    assert pc_other.lookup(ids) == 0
    result = pc_other.prefill(ids)
    assert result.reused_tokens == 0
    assert _max_diff(result, _full_logits(other, ids)) <= EXACT


def _store_and_close(
    model: torch.nn.Module, ids: torch.Tensor, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    """Prefill ``ids`` through one Memory and close it: its chunks are on disk, its CPU tier gone."""
    writer = make_memory()
    pc = prefix_cache(model, writer)
    pc.prefill(ids)
    pc.close()
    writer.close()


# -- corruption -------------------------------------------------------------------------------------------------


def test_corrupt_middle_chunk_on_disk_stops_reuse_before_it(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    ids = prompt(13, 5 * BLOCK + 3)
    _store_and_close(model, ids, make_memory, prefix_cache)

    reader = make_memory(cpu_bytes=0)  # every load reads the disk tier
    pc = prefix_cache(model, reader)
    middle = pc.chunk_keys(ids)[2]
    blob = Path(reader.config.path) / "disk" / "blobs"
    skey = reader.storage_key(middle, pc.namespace)
    path = blob / skey[:2] / f"{skey}.kvb"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    result = pc.prefill(ids)
    assert (result.reused_tokens, result.computed_tokens) == (2 * BLOCK, ids.shape[1] - 2 * BLOCK)
    assert _max_diff(result, _full_logits(model, ids)) <= EXACT
    assert reader.metrics.value("kvmem_crc_failures_total", tier="disk") == 1
    assert _chunk_hits(reader, "disk") == 2

    pc.flush()  # the recomputed chunks were stored again: the whole prefix is reusable once more
    assert pc.lookup(ids) == 5 * BLOCK
    assert pc.prefill(ids).reused_tokens == 5 * BLOCK


# -- metrics ----------------------------------------------------------------------------------------------------


def test_metrics_count_tokens_chunk_hits_and_ttft(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    memory = make_memory()
    pc = prefix_cache(tiny_model("llama"), memory)
    ids = prompt(14, 3 * BLOCK + 5)
    pc.prefill(ids)
    pc.flush()
    pc.prefill(ids)

    assert _tokens(memory, "requested") == 2 * ids.shape[1]
    assert _tokens(memory, "reused") == 3 * BLOCK
    assert _tokens(memory, "computed") == 2 * ids.shape[1] - 3 * BLOCK
    assert _chunk_hits(memory, "cpu") == 3
    assert _chunk_hits(memory, "disk") == 0
    assert memory.metrics.value("kvmem_ttft_seconds_count") == 2


def test_cold_then_warm_prompt_reads_hit_rate_one_half(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    memory = make_memory()
    pc = prefix_cache(tiny_model("llama"), memory)
    ids = prompt(19, 3 * BLOCK + 5)
    pc.prefill(ids)  # cold: its 3 chunks are computed, each a miss
    pc.flush()
    assert pc.prefill(ids).reused_tokens == 3 * BLOCK  # warm: each a hit

    assert memory.metrics.value("kvmem_misses_total", kind="tree") == 3
    assert memory.metrics.value("kvmem_hits_total", tier="cpu", kind="tree") == 3
    assert memory.metrics.value("kvmem_hit_rate") == pytest.approx(0.5)
    assert memory.stats().hit_rate == pytest.approx(0.5)


def test_chunks_after_a_missing_one_are_misses(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    memory = make_memory()
    pc = prefix_cache(tiny_model("llama"), memory)
    ids = prompt(20, 4 * BLOCK)
    pc.prefill(ids)
    pc.flush()
    memory.delete(pc.chunk_keys(ids)[1], namespace=pc.namespace)
    assert pc.prefill(ids).reused_tokens == BLOCK  # chunk 0 loaded; 1 gone; 2 and 3 stored but computed

    assert memory.metrics.value("kvmem_misses_total", kind="tree") == 4 + 3
    assert memory.metrics.value("kvmem_hits_total", tier="cpu", kind="tree") == 1


# -- explicit store and prefetch --------------------------------------------------------------------------------


def test_store_of_a_plain_forward_cache_is_reused(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    pc = prefix_cache(model, make_memory())
    ids = prompt(15, 3 * BLOCK + 7)
    arg = cache_argument(model)
    with torch.no_grad():
        cache = model(ids, use_cache=True)[arg]  # the output field has the argument's name
    assert pc.store(ids, cache) == 3

    longer = torch.cat([ids, prompt(16, 5)], dim=1)
    result = pc.prefill(longer)
    assert result.reused_tokens == 3 * BLOCK
    assert _max_diff(result, _full_logits(model, longer)) <= EXACT


def test_store_from_start_queues_only_the_chunks_decoded_after_a_prefill(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    memory = make_memory()
    pc = prefix_cache(model, memory)
    ids = prompt(18, 2 * BLOCK + 3)
    result = pc.prefill(ids)
    pc.flush()
    versions = [_version(memory, pc, k) for k in pc.chunk_keys(ids)]
    fed = torch.cat([ids, prompt(19, BLOCK)], dim=1)  # decoded on the prefill's cache
    with torch.no_grad():
        model(fed[:, ids.shape[1] :], use_cache=True, **{cache_argument(model): result.cache})
    assert pc.store(fed, result.cache, start=2) == 1  # chunk 2 only: 0 and 1 were the prefill's
    pc.flush()
    assert [_version(memory, pc, k) for k in pc.chunk_keys(ids)] == versions == [1, 1]  # not rewritten
    longer = torch.cat([fed, prompt(20, 4)], dim=1)
    assert pc.prefill(longer).reused_tokens == 3 * BLOCK
    with pytest.raises(ConfigError, match=r"start=-1"):
        pc.store(fed, result.cache, start=-1)


def test_new_chunks_are_stored_after_the_request_and_none_is_lost_on_close(
    tiny_model: ModelFactory,
    make_memory: MemoryFactory,
    prefix_cache: PrefixCacheFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NOTE: a store never runs for want of time (max_wait): only the request's end (or a flush) lets it
    monkeypatch.setattr(prefix_module, "WriteBehind", partial(WriteBehind, max_wait=60))
    model = tiny_model("llama")
    memory = make_memory()
    pc = prefix_cache(model, memory)
    ids, other = prompt(21, 2 * BLOCK + 3), prompt(22, 3 * BLOCK + 1)
    with memory.activity:  # NOTE: e.g. an image encoded, then its prompt prefilled: one request
        pc.prefill(ids)
        time.sleep(0.2)
        assert pc.lookup(ids) == 0  # not stored beside the request
    pc.flush()
    assert pc.lookup(ids) == 2 * BLOCK
    with memory.activity:
        pc.prefill(other)
        memory.close()  # NOTE: in the request: the queued chunks are stored first
    again = prefix_cache(model, make_memory())
    result = again.prefill(torch.cat([other, prompt(23, 2)], dim=1))
    assert result.reused_tokens == 3 * BLOCK


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_stored_after_the_cache_decoded_on_hold_the_prefill_s_kv(
    arch: str,
    tiny_model: ModelFactory,
    reference: Callable[[str], Reference],
    make_memory: MemoryFactory,
    prefix_cache: PrefixCacheFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NOTE: chunks are sliced on the writer's thread; here only after the caller decoded on the returned cache
    # (its layers grown, sliding ones cut to their window): what is stored must still be the prompt's KV
    monkeypatch.setattr(prefix_module, "WriteBehind", partial(WriteBehind, max_wait=60))
    model, ref = tiny_model(arch), reference(arch)
    memory = make_memory()
    pc = prefix_cache(model, memory)
    with memory.activity, torch.no_grad():
        result = pc.prefill(PROMPT_A)
        for _ in range(3):
            step = torch.randint(0, VOCAB, (1, 1))
            model(step, use_cache=True, **{cache_argument(model): result.cache})
        assert pc.lookup(PROMPT_A) == 0  # NOTE: nothing sliced or stored yet
    pc.flush()
    again = pc.prefill(PROMPT_B)
    assert again.reused_tokens == SHARED
    assert _max_diff(again, ref.logits) <= EXACT


def _version(memory: kvmem.Memory, pc: PrefixCache, key: str) -> int:
    info = memory.info(key, namespace=pc.namespace)
    assert info is not None
    return info.version


def test_prefetch_warms_chunks_from_disk_into_the_cpu_tier(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    ids = prompt(17, 4 * BLOCK + 2)
    _store_and_close(model, ids, make_memory, prefix_cache)

    memory = make_memory()  # reopened: the CPU tier starts empty, the disk tier holds the chunks
    cpu = next(t for t in memory._tiers.tiers if t.name == "cpu")
    pc = prefix_cache(model, memory)
    skeys = [memory.storage_key(k, pc.namespace) for k in pc.chunk_keys(ids)]
    assert not any(cpu.contains(k) for k in skeys)

    assert pc.prefetch(prompt(18, 2 * BLOCK)).result(timeout=30) == 0  # nothing stored for this one
    assert pc.prefetch(ids).result(timeout=30) == 4
    assert all(cpu.contains(k) for k in skeys)
    assert memory.metrics.value("kvmem_prefetch_latency_seconds_count") == 2

    assert pc.prefill(ids).reused_tokens == 4 * BLOCK
    assert (_chunk_hits(memory, "cpu"), _chunk_hits(memory, "disk")) == (4, 0)


# -- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(torch.randint(0, VOCAB, (2, 20)), id="batch-2"),
        pytest.param(torch.empty(1, 0, dtype=torch.long), id="empty"),
        pytest.param([], id="empty-list"),
        pytest.param(torch.rand(1, 20), id="float"),
    ],
)
@pytest.mark.parametrize("method", ["prefill", "lookup", "generate", "prefetch", "chunk_keys"])
def test_bad_input_ids_raise_invalid_key_error(
    bad: object, method: str, tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    pc = prefix_cache(tiny_model("llama"), make_memory())
    with pytest.raises(InvalidKeyError, match="input_ids"):
        getattr(pc, method)(bad)


# -- exact reuse from disk, in a fresh process (last, so the worker's imports overlap the tests above) -------------


class FreshProcess:
    """``tests/kv/workers.py disk-reuse`` running in the background over a Memory this process filled.

    Its output goes to files under ``logs`` (a pipe nobody reads yet could fill up and stall it).
    """

    def __init__(self, path: str, fingerprints: dict[str, str], logs: Path) -> None:
        self.fingerprints = fingerprints
        self._out, self._err = logs / "stdout", logs / "stderr"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
        with self._out.open("w") as out, self._err.open("w") as err:
            self._proc = subprocess.Popen(
                [sys.executable, WORKERS, "disk-reuse", path, *ARCHS], stdout=out, stderr=err, env=env
            )

    def reports(self) -> dict[str, dict[str, object]]:
        """The worker's report by arch (waits for it)."""
        rc = self._proc.wait(timeout=180)
        out = self._out.read_text()
        assert rc == 0, f"worker failed:\n{out}\n{self._err.read_text()}"
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


@pytest.fixture(scope="module", autouse=True)
def _fresh_process(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model: ModelFactory
) -> Iterator[FreshProcess | None]:
    """Store ``PROMPT_A``'s chunks for every arch, then start the worker that reuses them from disk.

    Autouse, so the worker starts before this module's first test and its slow imports
    overlap the in-process tests; it starts only when a selected test reads its report.
    """
    if not any(
        "fresh_process" in item.fixturenames
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    ):
        yield None
        return
    root = tmp_path_factory.mktemp("kv-disk")
    path = str(root / "kvmem")
    fingerprints = {}
    with kvmem.Memory(path, cpu_bytes="64MiB", disk_bytes="256MiB", fsync="never") as memory:
        for arch in ARCHS:
            pc = PrefixCache(tiny_model(arch), memory, block_size=BLOCK, compression="none")
            pc.prefill(PROMPT_A)
            pc.close()
            fingerprints[arch] = pc.fingerprint
    worker = FreshProcess(path, fingerprints, root)
    yield worker
    worker.stop()


@pytest.fixture
def fresh_process(_fresh_process: FreshProcess | None) -> FreshProcess:
    """The worker :func:`_fresh_process` started."""
    assert _fresh_process is not None
    return _fresh_process


@pytest.mark.parametrize("arch", ARCHS)
def test_reuse_from_disk_tier_in_a_fresh_process_is_exact(
    arch: str, fresh_process: FreshProcess, reference: Callable[[str], Reference]
) -> None:
    report = fresh_process.reports()[arch]
    assert report["fingerprint"] == fresh_process.fingerprints[arch]  # same seed and weights: same fingerprint
    assert report["reused"] == SHARED
    assert report["generate_reused"] == SHARED
    assert report["chunk_hits"] == {"cpu": 0, "disk": 2 * SHARED // BLOCK}  # no CPU tier there: all from disk
    assert report["max_diff"] <= EXACT
    assert report["generated"] == reference(arch).generated[0].tolist()
