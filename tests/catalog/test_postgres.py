"""The catalog on PostgreSQL: the Memory API, several processes ("nodes") at once, agent sessions, faults.

Each test gets a database of its own on the session's throwaway server (``postgres_url``);
the outage test runs a server of its own to stop and start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest
import torch

from kvmem import Memory
from kvmem.agent import AgentSession
from kvmem.errors import TierUnavailable
from tests.servers import PostgresServer, free_port, scratch_database
from tests.workers import append_steps, check_value, make_value

SMALL = {"cpu_bytes": "16MiB", "disk_bytes": "128MiB", "fsync": "never"}


@pytest.fixture
def pg(postgres_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database for this test."""
    with scratch_database(postgres_url) as url:
        yield url


def node(path: Path | str, url: str) -> Memory:
    """A Memory with tiers of its own (one machine) and the shared catalog at ``url``."""
    return Memory(str(path), catalog_url=url, **SMALL)


def test_store_load_info_versions_delete_and_entries(tmp_path: Path, pg: str) -> None:
    with node(tmp_path / "a", pg) as mem:
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        mem.store("k1", t, metadata={"who": "me", "nul": "a\x00b"})
        mem.store("k1", t + 1)
        mem.store("k2", b"bytes", namespace="ns")
        mem.store("nul\x00key", "text")  # PostgreSQL refuses NUL in text: escaped in the catalog
        assert torch.equal(mem.load("k1"), t + 1) and mem.load("k2", namespace="ns") == b"bytes"
        info = mem.info("k1")
        assert info is not None and info.version == 2 and info.hits == 1 and info.metadata == {}
        assert info.kind == "tensor" and info.user_key == "k1" and info.tiers
        assert mem.info("k2", namespace="ns").version == 1
        assert {e.user_key for e in mem.entries()} == {"k1", "k2", "nul\\x00key"}
        assert [e.user_key for e in mem.entries(namespace="ns")] == ["k2"]
        assert mem.stats().entries == 3
        assert mem.delete("k1") and mem.info("k1") is None and mem.load("k1") is None
        assert mem.database.dialect == "postgresql"
    with node(tmp_path / "b", pg) as other:  # another machine sees the rows, not the bytes
        assert other.info("k2", namespace="ns").version == 1 and other.stats().entries == 2


def _store_rounds(path: str, url: str, worker: int, keys: list[str], rounds: int) -> int:
    """Store every key ``rounds`` times (and load it back) from its own process and tiers; loads done."""
    loads = 0
    with node(path, url) as mem:
        for r in range(rounds):
            for key in keys:
                ver = worker * 1000 + r
                mem.store(key, make_value(key, ver, 256))
                assert check_value(key, mem.load(key), 256) == ver  # its own tiers: its own last write
                loads += 1
    return loads


def test_processes_on_several_nodes_lose_no_update(tmp_path: Path, pg: str) -> None:
    keys, rounds, workers = [f"shared/{i}" for i in range(4)], 12, 3
    node(tmp_path / "init", pg).close()  # schema made once; the race on it is in test_schema.py
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        loads = sum(
            pool.map(
                _store_rounds,
                [str(tmp_path / f"node{w}") for w in range(workers)],
                [pg] * workers,
                range(workers),
                [keys] * workers,
                [rounds] * workers,
            )
        )
    with node(tmp_path / "check", pg) as mem:
        for key in keys:
            info = mem.info(key)
            assert info is not None and info.version == workers * rounds, (key, info)
        assert mem.stats().recorded_hits == loads == workers * rounds * len(keys)


def test_agent_session_compare_and_swap_race(tmp_path: Path, pg: str) -> None:
    with node(tmp_path / "init", pg) as mem:
        AgentSession("race", memory=mem, system_prompt="sys")
    workers, n = 3, 8
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(
            pool.map(
                append_steps,
                [str(tmp_path / f"node{w}") for w in range(workers)],
                range(workers),
                [n] * workers,
                [pg] * workers,
            )
        )
    with node(tmp_path / "check", pg) as mem:
        session = AgentSession.resume("race", memory=mem)
        chain = session.steps  # verified link by link
        assert len(chain) == workers * n
        for w in range(workers):  # every worker's steps, each exactly once and in its own order
            assert [x.thought for x in chain if x.thought.startswith(f"w{w} ")] == [f"w{w} step {i}" for i in range(n)]
        fork = session.fork("race-fork")
        fork.append_step("only in the fork", "", "")
        from kvmem.agent.chain import sweep

        assert sweep(mem.database) == 0  # every committed step is reachable


@pytest.mark.parametrize(
    "credentials, options",
    [("kvmem:s3cret@", ""), ("kvmem@", "?password=s3cret"), ("kvmem:s3cret@", "?sslmode=disable&sslpassword=s3cret")],
)
def test_unreachable_at_start_is_a_clear_error_without_the_password(
    tmp_path: Path, credentials: str, options: str
) -> None:
    port = free_port()
    url = f"postgresql+psycopg://{credentials}127.0.0.1:{port}/kvmem{options}"
    started = time.monotonic()
    with pytest.raises(TierUnavailable, match=f"127.0.0.1:{port}") as caught:
        Memory(str(tmp_path), catalog_url=url, **SMALL)
    assert "s3cret" not in str(caught.value) and "***" in str(caught.value)
    assert time.monotonic() - started < 10


def _wait(condition: Callable[[], bool], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_outage_mid_run_keeps_serving_and_the_catalog_catches_up(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.url
    with node(tmp_path / "a", url) as mem:
        for i in range(4):
            mem.store(f"k{i}", make_value(f"k{i}", 1, 256))
        assert mem.load("k0") is not None
        mem.flush()

        postgres_server.stop()
        for i in range(2, 6):  # new versions of k2, k3; new keys k4, k5
            mem.store(f"k{i}", make_value(f"k{i}", 2, 256))
        mem.store("k5", make_value("k5", 3, 256))
        assert mem.delete("k1")
        for i in (0, 2, 3, 4, 5):  # the data path goes on through the local tiers
            assert check_value(f"k{i}", mem.load(f"k{i}"), 256) == (3 if i == 5 else 1 if i == 0 else 2)
        assert mem.info("k2") is None  # the catalog is down: no facts, no exception
        assert list(mem.entries()) == []
        assert mem._catalog.pending == 5  # k2..k5 upserts and the removal of k1
        assert mem.metrics.total("kvmem_tier_errors_total") > 0

        postgres_server.start()
        _wait(lambda: mem._catalog.pending == 0)  # the timer thread retried without being asked
        mem.flush()
        versions = {e.user_key: e.version for e in mem.entries()}
        assert versions == {"k0": 1, "k2": 2, "k3": 2, "k4": 1, "k5": 2}
        assert mem.info("k0").hits == 2 and mem.info("k2").hits == 1  # hits counted during the outage too
        assert mem._catalog.dropped == 0
    with node(tmp_path / "b", url) as other:  # and another node sees it all
        assert {e.user_key: e.version for e in other.entries()} == versions


_OUTAGE_CHILD = """
import json, sys
from kvmem import Memory
mem = Memory(sys.argv[1], catalog_url=sys.argv[2], **json.loads(sys.argv[3]))
mem.store("a", b"a1")
print("READY", flush=True)
sys.stdin.readline()  # the parent stops PostgreSQL
for key, value in (("b", b"b1"), ("a", b"a2"), ("c", b"c1"), ("a", b"a3")):
    mem.store(key, value)
print("STORED", mem._catalog.pending, flush=True)
sys.stdin.readline()  # killed here
"""


def test_a_process_killed_during_an_outage_loses_no_catalog_write(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """Stores made while PostgreSQL is down are journaled: the next memory opened there writes them."""
    import json
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _OUTAGE_CHILD, str(tmp_path / "n"), postgres_server.url, json.dumps(SMALL)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().split() == ["READY"]
        postgres_server.stop()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["STORED", "3"]  # a (twice), b, c queued
        assert len(list((tmp_path / "n" / "catalog-pending").glob("pending.*.jsonl"))) == 1
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    postgres_server.start()
    with node(tmp_path / "n", postgres_server.url) as mem:  # claims the dead process's journal
        _wait(lambda: mem._catalog.pending == 0)
        assert {e.user_key: e.version for e in mem.entries()} == {"a": 3, "b": 1, "c": 1}
        assert (mem.load("a"), mem.load("b"), mem.load("c")) == (b"a3", b"b1", b"c1")
        assert list((tmp_path / "n" / "catalog-pending").iterdir()) == []  # taken by the database: gone


def test_nodes_with_their_own_tiers_never_reap_each_others_rows(tmp_path: Path, pg: str) -> None:
    """A shared catalog without a shared tier: B holds none of A's entries, and must not drop their rows."""
    with node(tmp_path / "a", pg) as a:
        a.store("kept", torch.ones(8))
    with node(tmp_path / "b", pg) as b:
        assert b.gc().rows_removed == 0 and b.verify(fix=True, progress=False).missing == []
    with node(tmp_path / "a", pg) as a:
        info = a.info("kept")
        assert info is not None and torch.equal(a.load("kept"), torch.ones(8))
