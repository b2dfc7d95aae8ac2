"""WriteBehind: its thread starts with it, and a memory's flush and close wait for what it queued."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from kvmem import Memory
from kvmem.kv.background import WriteBehind


def writer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvmem-write-behind")}


def test_the_thread_starts_with_the_writer_not_at_the_first_store() -> None:
    before = writer_threads()
    writer = WriteBehind()
    try:
        started = writer_threads() - before
        assert len(started) == 1 and next(iter(started)).is_alive()
    finally:
        writer.close()


def test_a_memorys_flush_and_close_wait_for_the_stores_a_writer_queued(tmp_path: Path) -> None:
    mem = Memory(tmp_path / "kvmem")
    writer = WriteBehind()
    mem.add_writer(writer)
    gate = threading.Event()

    def slow_store(key: str) -> None:
        gate.wait(5)
        time.sleep(0.05)
        mem.store(key, torch.arange(4), namespace="t")

    writer.submit(lambda: slow_store("a" * 64))
    gate.set()
    mem.flush()
    assert mem.contains("a" * 64, namespace="t")
    writer.submit(lambda: slow_store("b" * 64))
    mem.close()  # NOTE: the store queued before close is done before the tiers close
    with Memory(tmp_path / "kvmem") as again:
        assert torch.equal(again.load("b" * 64, namespace="t"), torch.arange(4))
    writer.close()


def test_a_job_queued_in_a_request_runs_when_it_ends(tmp_path: Path) -> None:
    with Memory(tmp_path / "kvmem") as mem:
        writer = WriteBehind(activity=mem.activity, max_wait=60)
        ran = threading.Event()
        with mem.activity:  # NOTE: a request in flight (e.g. a prefill before its first token)
            writer.submit(ran.set)
            assert not ran.wait(0.2)  # not beside the request
        assert ran.wait(5)  # at its end, not after max_wait
        writer.close()


def test_a_job_waits_for_a_request_at_most_max_wait(tmp_path: Path) -> None:
    with Memory(tmp_path / "kvmem") as mem:
        writer = WriteBehind(activity=mem.activity, max_wait=0.2)
        ran = threading.Event()
        with mem.activity:  # NOTE: a server that is never idle still stores
            start = time.perf_counter()
            writer.submit(ran.set)
            assert ran.wait(5)
            assert time.perf_counter() - start >= 0.2
        writer.close()


def test_flush_and_close_in_a_request_store_at_once_and_lose_nothing(tmp_path: Path) -> None:
    mem = Memory(tmp_path / "kvmem")
    writer = WriteBehind(activity=mem.activity, max_wait=60)
    mem.add_writer(writer)
    with mem.activity:
        writer.submit(lambda: mem.store("a" * 64, torch.arange(4), namespace="t"))
        start = time.perf_counter()
        mem.flush()  # NOTE: hurries the queued store: no wait for the request (or max_wait)
        assert time.perf_counter() - start < 30 and mem.contains("a" * 64, namespace="t")
        ran = threading.Event()
        writer.submit(ran.set)
        assert not ran.wait(0.2)  # once the flush returned, queued jobs wait for the request again
        writer.submit(lambda: mem.store("b" * 64, torch.arange(5), namespace="t"))
        mem.close()
    with Memory(tmp_path / "kvmem") as again:
        assert torch.equal(again.load("a" * 64, namespace="t"), torch.arange(4))
        assert torch.equal(again.load("b" * 64, namespace="t"), torch.arange(5))
    writer.close()
