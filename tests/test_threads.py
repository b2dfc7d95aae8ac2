"""Background threads yield to the request's threads: their wake-ups never preempt compute (SCHED_BATCH), and they
run on the cores set for them."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem.kv.background import WriteBehind
from kvmem.threads import set_background_cpus, yield_to_compute

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")


def _policy(name: str) -> int:
    (thread,) = [t for t in threading.enumerate() if t.name.startswith(name)]
    assert thread.native_id is not None
    return os.sched_getscheduler(thread.native_id)


def test_write_behind_runs_as_batch_work_and_still_runs_every_job() -> None:
    before = os.sched_getscheduler(0)
    done: list[int] = []
    writer = WriteBehind()
    try:
        for i in range(5):
            writer.submit(lambda i=i: done.append(i))
        writer.flush()
        assert _policy("kvmem-write-behind") == os.SCHED_BATCH
    finally:
        writer.close()
    assert done == [0, 1, 2, 3, 4]
    assert os.sched_getscheduler(0) == before  # the caller's thread (the request's) is left as it was


def test_write_back_thread_runs_as_batch_work(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path, cpu_bytes="16MiB", disk_bytes="64MiB", write_policy="back") as memory:
        memory.store("a", torch.arange(1024, dtype=torch.float32))
        assert _policy("kvmem-write-back") == os.SCHED_BATCH
        memory.flush()
    with kvmem.Memory(tmp_path, cpu_bytes=0, disk_bytes="64MiB") as reopened:  # what the thread wrote
        assert torch.equal(reopened.load("a"), torch.arange(1024, dtype=torch.float32))


def test_background_threads_run_on_the_cores_set_for_them_and_the_caller_keeps_its_own() -> None:
    own = os.sched_getaffinity(0)
    kept = {min(own)}  # NOTE: one of this process's cores (on one core the test still runs, on that core)
    seen: dict[str, set[int]] = {}

    def background() -> None:
        yield_to_compute()
        seen["background"] = os.sched_getaffinity(0)

    set_background_cpus(kept)
    try:
        thread = threading.Thread(target=background)
        thread.start()
        thread.join()
    finally:
        set_background_cpus(None)
    thread = threading.Thread(target=lambda: seen.update(unset=os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    assert seen["background"] == kept
    assert os.sched_getaffinity(0) == own and seen["unset"] == own  # the maker and later threads are left alone
