"""Predictive prefetch on a real Memory on real files: what it warms, what it never evicts, what it counts."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
import torch

import kvmem
from kvmem.errors import ConfigError
from kvmem.kv import PredictivePrefetcher, PrefixCache, RequestPatterns
from tests.conftest import MemoryFactory
from tests.kv.conftest import ModelFactory
from tests.kv.workers import BLOCK

NS = "docs"
CHUNK = 16384  # float32 elements: 64 KiB a chunk


def doc(name: str, chunks: int = 2) -> list[str]:
    return [f"{name}/{i}" for i in range(chunks)]


def chunk(seed: int) -> torch.Tensor:
    return torch.full((CHUNK,), float(seed))


def on_disk_only(make_memory: MemoryFactory, names: list[str], name: str = "kvmem", **settings: object) -> kvmem.Memory:
    """A fresh Memory whose disk tier holds ``names``' chunks and whose CPU tier is empty (as after a restart)."""
    first = make_memory(name, **settings)
    for n, title in enumerate(names):
        for i, key in enumerate(doc(title)):
            first.store(key, chunk(10 * n + i), namespace=NS, compression="none")
    first.close()
    return make_memory(name, **settings)


def cpu_keys(memory: kvmem.Memory, name: str) -> list[bool]:
    store = memory.chunk_store()
    return [store.locate(memory.storage_key(k, NS)) == "cpu" for k in doc(name)]


def count(memory: kvmem.Memory, outcome: str, unit: str = "") -> float:
    return memory.metrics.value(f"kvmem_predictive_prefetch{unit}_total", outcome=outcome)


def train(prefetcher: PredictivePrefetcher, *path: str, times: int = 5) -> None:
    """Teach the model that alice reads ``path`` in a loop (the model only: nothing is warmed)."""
    for _ in range(times):
        for name in path:
            prefetcher.patterns.observe(NS, doc(name), "alice")


def after(prefetcher: PredictivePrefetcher, name: str) -> None:
    """Bob reads ``name``; wait for what the prefetcher warms after it."""
    prefetcher.observe(doc(name), namespace=NS, stream="bob")
    prefetcher.flush()


def test_a_predicted_document_is_warmed_from_disk_and_its_use_counted(make_memory: MemoryFactory) -> None:
    memory = on_disk_only(make_memory, ["a", "b"], cpu_bytes="4MiB")
    prefetcher = PredictivePrefetcher(memory)
    train(prefetcher, "a", "b")
    memory.delete(doc("b")[0], namespace=NS)  # leaves b/1 only: b's chain breaks at its first chunk
    after(prefetcher, "a")  # learnt from alice: bob reads b next
    assert cpu_keys(memory, "b") == [False, False]  # a missing first chunk stops the head: b/1 not warmed
    assert count(memory, "missing") >= 1

    memory.store(doc("b")[0], chunk(10), namespace=NS, compression="none")
    memory.close()
    memory = make_memory(cpu_bytes="4MiB")  # restart: the CPU tier is empty again
    prefetcher = PredictivePrefetcher(memory)
    train(prefetcher, "a", "b")
    after(prefetcher, "a")
    assert cpu_keys(memory, "a") == [False, False]  # warmed only what follows: b, the likely next
    assert cpu_keys(memory, "b") == [True, True]
    warmed = count(memory, "warmed", "_bytes")
    assert count(memory, "warmed") == 2 and warmed > 2 * CHUNK * 4

    loaded = memory.fetch(doc("b")[0], namespace=NS)
    assert loaded is not None and loaded.tier == "cpu" and torch.equal(loaded.value, chunk(10))
    assert memory.load_many(doc("b"), namespace=NS)[1] is not None
    assert count(memory, "used") == 2 and count(memory, "used", "_bytes") == warmed
    assert count(memory, "wasted") == 0
    assert memory.metrics.total("kvmem_predictive_prefetch_cpu_seconds_total") > 0  # what it cost is counted
    prefetcher.close()


def test_a_full_cpu_tier_gets_no_guess_and_keeps_every_entry(make_memory: MemoryFactory) -> None:
    memory = on_disk_only(make_memory, ["a", "b"], cpu_bytes="300KiB", offload_threshold=1.0)
    hot = [f"hot/{i}" for i in range(4)]
    for i, key in enumerate(hot):  # 4 x 64 KiB: the tier has no room for one more chunk
        memory.store(key, chunk(100 + i), namespace=NS, compression="none")
    store = memory.chunk_store()
    assert all(store.locate(memory.storage_key(k, NS)) == "cpu" for k in hot)
    prefetcher = PredictivePrefetcher(memory)
    train(prefetcher, "a", "b")
    after(prefetcher, "a")
    assert count(memory, "no_room") >= 1 and count(memory, "warmed") == 0
    assert all(store.locate(memory.storage_key(k, NS)) == "cpu" for k in hot)
    assert memory.metrics.total("kvmem_evictions_total") == 0
    assert memory.metrics.total("kvmem_demotions_total") == 0
    prefetcher.close()


def test_guesses_sit_outside_the_threshold_and_go_first_when_a_put_needs_room(make_memory: MemoryFactory) -> None:
    def resident_after_a_big_put(name: str, guess: bool) -> tuple[list[bool], float]:
        settings = {"cpu_bytes": "600KiB", "offload_threshold": 0.5}  # real entries: up to 300 KiB (4 chunks)
        memory = on_disk_only(make_memory, ["a", "b"], name=name, **settings)
        for i in range(4):
            memory.store(f"hot/{i}", chunk(100 + i), namespace=NS, compression="none")
        if guess:
            prefetcher = PredictivePrefetcher(memory)
            train(prefetcher, "a", "b")
            after(prefetcher, "a")
            prefetcher.close()
            assert cpu_keys(memory, "b") == [True, True]  # in the room above the threshold, nothing shed for it
            assert memory.metrics.total("kvmem_demotions_total") == 0
        memory.store("big", torch.zeros(4 * CHUNK), namespace=NS, compression="none")  # needs room
        store = memory.chunk_store()
        keys = [*(f"hot/{i}" for i in range(4)), "big"]
        return [store.locate(memory.storage_key(k, NS)) == "cpu" for k in keys], count(memory, "wasted")

    without, _ = resident_after_a_big_put("plain", guess=False)
    with_guesses, wasted = resident_after_a_big_put("guessed", guess=True)
    assert with_guesses == without == [False, False, False, False, True]  # the guesses changed no real entry
    assert wasted >= 1  # the oldest guess made room for the put first


def test_used_guesses_over_the_threshold_are_moved_down_before_the_next_guess(make_memory: MemoryFactory) -> None:
    """A used guess is an entry: past the threshold, the prefetcher moves the oldest entries down before its
    next copy (between requests), not the next request's put."""
    memory = on_disk_only(make_memory, ["a", "b", "c"], cpu_bytes="600KiB", offload_threshold=0.5)
    for i in range(4):  # real entries at the threshold: 4 x 64 KiB of 300 KiB
        memory.store(f"hot/{i}", chunk(100 + i), namespace=NS, compression="none")
    prefetcher = PredictivePrefetcher(memory)
    train(prefetcher, "a", "b", "c")
    after(prefetcher, "a")
    assert cpu_keys(memory, "b") == [True, True] and memory.metrics.total("kvmem_demotions_total") == 0
    assert all(v is not None for v in memory.load_many(doc("b"), namespace=NS))  # used: b is an entry now
    after(prefetcher, "b")  # c is next: b's two chunks over the threshold go down first, oldest entries first
    store = memory.chunk_store()
    assert memory.metrics.total("kvmem_demotions_total") == 2
    assert [store.locate(memory.storage_key(f"hot/{i}", NS)) for i in range(4)] == ["disk", "disk", "cpu", "cpu"]
    assert cpu_keys(memory, "b") == [True, True] and cpu_keys(memory, "c") == [True, True]
    prefetcher.close()


def test_a_newer_guess_takes_the_room_of_the_oldest_unused_guesses_never_an_entrys(make_memory: MemoryFactory) -> None:
    # real entries up to 300 KiB; guesses get the rest less 1/16 of the tier: room for 4 chunks
    memory = on_disk_only(make_memory, ["a", "b", "c"], cpu_bytes="600KiB", offload_threshold=0.5)
    for i in range(4):
        memory.store(f"hot/{i}", chunk(100 + i), namespace=NS, compression="none")
    prefetcher = PredictivePrefetcher(memory)
    train(prefetcher, "a", "b", "c")
    after(prefetcher, "a")  # b warmed
    after(prefetcher, "b")  # c warmed: the room is full
    assert cpu_keys(memory, "b") == [True, True] and cpu_keys(memory, "c") == [True, True]
    after(prefetcher, "c")  # a is next: b's guesses, the oldest, make room for it
    assert cpu_keys(memory, "a") == [True, True] and cpu_keys(memory, "c") == [True, True]
    assert cpu_keys(memory, "b") == [False, False] and count(memory, "wasted") == 2
    store = memory.chunk_store()
    assert all(store.locate(memory.storage_key(f"hot/{i}", NS)) == "cpu" for i in range(4))
    prefetcher.close()


def test_a_guess_never_takes_the_room_of_the_guesses_it_is_told_to_keep(make_memory: MemoryFactory) -> None:
    memory = on_disk_only(make_memory, ["a", "b", "c"], cpu_bytes="600KiB", offload_threshold=0.5)
    for i in range(4):
        memory.store(f"hot/{i}", chunk(100 + i), namespace=NS, compression="none")
    store = memory.chunk_store()
    held = [memory.storage_key(k, NS) for k in doc("a") + doc("b")]
    assert [store.speculate(k, keep=held)[0] for k in held] == ["warmed"] * 4  # the guesses' room: 4 chunks
    c0 = memory.storage_key(doc("c")[0], NS)
    assert store.speculate(c0, keep=held)[0] == "no_room"  # the room is full of guesses it keeps
    assert store.speculate(c0)[0] == "warmed"  # told nothing to keep: the oldest guess goes
    assert cpu_keys(memory, "a") == [False, True] and count(memory, "wasted") == 1
    memory.close()


def guessed_b(make_memory: MemoryFactory) -> tuple[kvmem.Memory, PredictivePrefetcher]:
    """A Memory whose CPU tier holds ``b``'s 2 chunks on a guess (the prefetcher learnt that ``b`` follows ``a``)."""
    memory = on_disk_only(make_memory, ["a", "b"], cpu_bytes="4MiB")
    prefetcher = PredictivePrefetcher(memory)
    train(prefetcher, "a", "b")
    after(prefetcher, "a")
    assert count(memory, "warmed") == 2
    return memory, prefetcher


def test_overwriting_or_deleting_a_guess_counts_it_wasted(make_memory: MemoryFactory) -> None:
    memory, prefetcher = guessed_b(make_memory)
    memory.store(doc("b")[0], chunk(99), namespace=NS, compression="none")
    memory.delete(doc("b")[1], namespace=NS)
    assert count(memory, "wasted") == 2 and count(memory, "used") == 0
    prefetcher.close()


def test_overwriting_guesses_in_one_store_many_counts_them_wasted(make_memory: MemoryFactory) -> None:
    """A batch put into the CPU tier (its ``put_many``) counts overwritten guesses as a single put does."""
    memory, prefetcher = guessed_b(make_memory)
    memory.store_many({key: chunk(99) for key in doc("b")}, namespace=NS, compression="none")
    assert count(memory, "wasted") == 2 and count(memory, "used") == 0
    assert memory.load(doc("b")[1], namespace=NS).eq(99).all()
    prefetcher.close()


def test_the_budget_bounds_what_one_request_warms(make_memory: MemoryFactory) -> None:
    memory = on_disk_only(make_memory, ["a", "b"], cpu_bytes="4MiB")
    prefetcher = PredictivePrefetcher(memory, budget=1)
    train(prefetcher, "a", "b")
    after(prefetcher, "a")
    assert cpu_keys(memory, "b") == [True, False]  # the entry that reaches the budget is the last
    prefetcher.close()


def wait_for(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` until it holds (a background thread reaching a point), failing after 10 s."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the background thread never got there"
        time.sleep(0.001)


def test_a_guess_is_copied_only_once_no_request_is_in_flight(make_memory: MemoryFactory) -> None:
    memory = on_disk_only(make_memory, ["a", "b"], cpu_bytes="4MiB")
    prefetcher = PredictivePrefetcher(memory, max_wait=60.0)
    train(prefetcher, "a", "b")
    with memory.activity:  # a request in flight (another thread's, say)
        prefetcher.observe(doc("a"), namespace=NS, stream="bob")
        wait_for(lambda: count(memory, "predicted") >= 1)  # the worker decided to warm b, and waits
        assert cpu_keys(memory, "b") == [False, False] and count(memory, "warmed") == 0
    prefetcher.flush()
    assert cpu_keys(memory, "b") == [True, True]
    prefetcher.close()


def test_the_models_time_is_counted_a_millisecond_at_a_time_and_all_of_it_by_flush(
    make_memory: MemoryFactory,
) -> None:
    memory = make_memory()
    prefetcher = PredictivePrefetcher(memory, patterns=RequestPatterns(popular=0))  # nothing predicted: no worker

    def counted() -> float:
        return memory.metrics.total("kvmem_predictive_prefetch_cpu_seconds_total")

    prefetcher.observe(doc("a"), namespace=NS, stream="bob")  # ~10 us: not counted yet
    assert counted() == 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < 0.05:  # far more than a millisecond of the model's time
        prefetcher.observe(doc(f"d{int((time.perf_counter() - start) * 1e5)}"), namespace=NS, stream="bob")
    assert 0.0 < counted() <= time.perf_counter() - start
    prefetcher.flush()
    after_flush = counted()
    assert after_flush > 0.0
    prefetcher.close()
    assert counted() == after_flush  # nothing left to count


def test_after_a_quiet_stretch_requests_are_learnt_in_batches_until_a_prediction_comes(
    make_memory: MemoryFactory,
) -> None:
    memory = on_disk_only(make_memory, ["a", "b"], cpu_bytes="4MiB")
    prefetcher = PredictivePrefetcher(memory)
    train(prefetcher, "a", "b")  # in the model: a -> b -> a
    for i in range(200):  # documents seen once each: nothing to predict (a and b soon not popular either)
        prefetcher.observe(doc(f"once{i}"), namespace=NS, stream="carol")
    prefetcher.flush()  # learns what waits in a batch
    prefetcher.observe(doc("a"), namespace=NS, stream="bob")
    assert prefetcher.patterns.predict(NS, "bob") == []  # quiet: bob's request waits for its batch
    prefetcher.flush()
    assert [p.head for p in prefetcher.patterns.predict(NS, "bob")] == ["b/0"]
    assert cpu_keys(memory, "b") == [True, True]  # the batch's last request predicted b: warmed
    prefetcher.observe(doc("b"), namespace=NS, stream="dave")  # no longer quiet: learnt at once
    assert [p.head for p in prefetcher.patterns.predict(NS, "dave")] == ["a/0"]
    prefetcher.close()


def test_a_guess_waits_at_most_max_wait(make_memory: MemoryFactory) -> None:
    memory = on_disk_only(make_memory, ["a", "b"], cpu_bytes="4MiB")
    prefetcher = PredictivePrefetcher(memory, max_wait=0.0)
    train(prefetcher, "a", "b")
    with memory.activity:  # never idle: the guesses are copied anyway
        after(prefetcher, "a")
        assert cpu_keys(memory, "b") == [True, True]
    prefetcher.close()


def test_memory_requests_count_as_in_flight_while_they_run(memory: kvmem.Memory) -> None:
    assert not memory.activity.watched  # no prefetcher: requests are not counted
    PredictivePrefetcher(memory).close()
    assert memory.activity.watched
    seen: list[int] = []

    def regenerate() -> torch.Tensor:  # runs inside load: the load is in flight
        seen.append(memory.activity.in_flight)
        return chunk(1)

    memory.load("absent", namespace=NS, regenerate=regenerate)  # load, and the store it makes, nested
    assert seen == [1] and memory.activity.in_flight == 0
    with pytest.raises(kvmem.KVMemError):
        memory.store("bad", object(), namespace=NS)
    assert memory.activity.in_flight == 0  # a failed request leaves the count too


def test_prefix_cache_feeds_its_requests_to_the_predictor(make_memory: MemoryFactory, tiny_model: ModelFactory) -> None:
    memory = make_memory(predictive_prefetch=True)
    model = tiny_model("llama")
    in_flight: list[int] = []
    model.register_forward_hook(lambda *_: in_flight.append(memory.activity.in_flight))
    pc = PrefixCache(model, memory, block_size=BLOCK, compression="none")
    first, second = torch.arange(3 * BLOCK) % 97, (torch.arange(3 * BLOCK) + 5) % 97
    for ids in (first, second, first, second, first):
        pc.prefill(ids)
    pc.flush()
    assert count(memory, "predicted") >= 1  # second follows first: predicted (resident here: a big CPU tier)
    # a prefill is a request in flight (the write-behind's stores of earlier chunks may be too): guesses wait
    assert in_flight and min(in_flight) >= 1
    assert memory.activity.in_flight == 0
    pc.close()


@pytest.mark.parametrize(
    ("setting", "value", "accepted"),
    [
        ("predictive_prefetch", "sometimes", "true|false"),
        ("predictive_prefetch", 1, "true | false"),
        ("predictive_prefetch_budget", 0, "a byte count >= 1"),
        ("predictive_prefetch_budget", "lots", "a byte count"),
    ],
)
def test_bad_settings_are_refused(setting: str, value: object, accepted: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{setting}={value!r}") + ".*" + re.escape(accepted)):
        kvmem.load_config(**{setting: value})


def test_settings_are_read_from_the_environment() -> None:
    config = kvmem.load_config(environ={"KVMEM_PREDICTIVE_PREFETCH": "on", "KVMEM_PREDICTIVE_PREFETCH_BUDGET": "16MiB"})
    assert config.predictive_prefetch is True and config.predictive_prefetch_budget == 16 * 1024**2


def test_bad_prefetcher_arguments_are_refused(memory: kvmem.Memory) -> None:
    with pytest.raises(ConfigError, match=r"limit=0: accepted an integer >= 1"):
        PredictivePrefetcher(memory, limit=0)
    with pytest.raises(ConfigError, match=r"budget=0: accepted"):
        PredictivePrefetcher(memory, budget=0, patterns=RequestPatterns())
    with pytest.raises(ConfigError, match=r"max_wait=-1.0: accepted a number of seconds >= 0"):
        PredictivePrefetcher(memory, max_wait=-1.0)
