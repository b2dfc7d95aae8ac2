"""Pinned versions (copy-on-pin): a reader keeps the version it pinned while writers move on.

Single-process semantics first, then real reader processes (``tests/version_worker.py``)
on one node (shared directory, SQLite catalog) and on two nodes (own directories, a
shared Redis tier and PostgreSQL catalog), a reader killed while holding a pin, and a
stress run of pins, writes and collections racing on PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

import kvmem
from kvmem.catalog.versions import pins, versions
from kvmem.errors import ConfigError, PinExpired, TierUnavailable
from tests.servers import scratch_database
from tests.workers import check_value, make_value

ROOT = Path(__file__).resolve().parents[2]
KEY = "doc"


def kept(mem: kvmem.Memory) -> list[int]:
    """Versions of ``KEY`` kept in the catalog database."""
    skey = mem.storage_key(KEY)
    with mem.database.connection() as conn:
        return sorted(conn.execute(select(versions.c.version).where(versions.c.key == skey)).scalars())


def pin_count(mem: kvmem.Memory) -> int:
    with mem.database.connection() as conn:
        return conn.execute(select(func.count()).select_from(pins)).scalar_one()


# -- one process ------------------------------------------------------------------------------------


def test_a_pin_keeps_its_version_while_the_key_moves_on(memory: kvmem.Memory) -> None:
    memory.store(KEY, make_value(KEY, 1))
    first = memory.pin(KEY)
    assert first is not None and first.version == 1
    memory.store(KEY, make_value(KEY, 2))
    memory.store(KEY, make_value(KEY, 3))
    assert check_value(KEY, first.load()) == 1  # the pinned version, from the kept copy
    assert check_value(KEY, memory.load(KEY)) == 3  # plain readers get the newest
    second = memory.pin(KEY)
    assert second is not None and second.version == 3 and check_value(KEY, second.load()) == 3
    assert kept(memory) == [1, 3]  # versions 2 was never pinned: never copied
    first.release()
    assert kept(memory) == [3]  # reclaimed at release: no other pin holds it
    with pytest.raises(PinExpired, match="released"):
        first.load()
    with second:
        assert check_value(KEY, second.load()) == 3
    assert kept(memory) == [] and pin_count(memory) == 0


def test_pins_of_one_version_share_one_copy_until_the_last_lets_go(memory: kvmem.Memory) -> None:
    memory.store(KEY, make_value(KEY, 1))
    a, b = memory.pin(KEY), memory.pin(KEY)
    assert a is not None and b is not None and a.version == b.version == 1
    memory.store(KEY, make_value(KEY, 2))
    assert kept(memory) == [1] and pin_count(memory) == 2
    a.release()
    assert kept(memory) == [1] and check_value(KEY, b.load()) == 1
    b.release()
    assert kept(memory) == []


def test_missing_key_bad_lease_and_close_release(memory: kvmem.Memory, tmp_path: Path) -> None:
    assert memory.pin("never stored") is None
    memory.store(KEY, make_value(KEY, 1))
    for bad in (0, -1.0, "10", True):
        with pytest.raises(ConfigError, match="lease="):
            memory.pin(KEY, lease=bad)  # type: ignore[arg-type]
    held = memory.pin(KEY)
    assert held is not None and pin_count(memory) == 1
    memory.close()  # releases what it holds
    with kvmem.Memory(tmp_path / "kvmem", cpu_bytes="64MiB", disk_bytes="512MiB") as reopened:
        assert pin_count(reopened) == 0 and kept(reopened) == []


def test_leases_renew_while_held_and_expire_when_not(memory: kvmem.Memory, tmp_path: Path) -> None:
    memory.store(KEY, make_value(KEY, 1))
    short = memory.pin(KEY, lease=0.6)
    assert short is not None
    memory.store(KEY, make_value(KEY, 2))
    time.sleep(1.5)  # more than two leases: alive only because the renewer ran
    assert memory.gc().versions_reclaimed == 0
    assert check_value(KEY, short.load()) == 1
    # a holder that stops renewing (here: its renewal is pushed into the past) loses the version to gc
    with memory.database.transaction() as conn:
        conn.execute(pins.update().values(expires=time.time() - 1))
    with memory._versions._lock:
        memory._versions._held.clear()  # NOTE: this process's renewer no longer knows the pin: as if it died
    assert memory.gc().versions_reclaimed == 1
    with pytest.raises(PinExpired, match="expired"):
        short.load()


def test_the_catalog_gone_is_a_clear_error(tmp_path: Path, postgres_server: object) -> None:
    from tests.servers import PostgresServer

    assert isinstance(postgres_server, PostgresServer)
    with kvmem.Memory(tmp_path / "n", catalog_url=postgres_server.url, cpu_bytes="8MiB", disk_bytes="8MiB") as mem:
        mem.store(KEY, make_value(KEY, 1))
        held = mem.pin(KEY)
        assert held is not None
        postgres_server.stop()
        with pytest.raises(TierUnavailable, match="need the catalog"):
            mem.pin(KEY)
        assert check_value(KEY, held.load()) == 1  # still current in the tiers: served without the catalog
        held.release()  # the outage only delays the release (logged); never raises


# -- reader processes -------------------------------------------------------------------------------


class Reader:
    """A ``tests/version_worker.py`` process on a memory at ``path`` with ``settings``."""

    def __init__(self, path: Path, settings: dict[str, object]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.version_worker", str(path), json.dumps(settings), KEY],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, command: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.ask("exit") == ["BYE"]
        self.proc.wait(timeout=30)


@pytest.fixture
def pg(postgres_url: str) -> Iterator[str]:
    with scratch_database(postgres_url) as url:
        yield url


@pytest.fixture(params=["one node", "two nodes"])
def node_settings(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], tuple[Path, dict[str, object]]]:
    """``settings(name) -> (path, settings)``: one shared directory and SQLite catalog, or directories of
    their own sharing a Redis tier and a PostgreSQL catalog."""
    base: dict[str, object] = {"cpu_bytes": "16MiB", "disk_bytes": "64MiB", "fsync": "never"}
    if request.param == "two nodes":
        base["remote_url"] = request.getfixturevalue("redis_url") + f"?prefix=pins:{time.monotonic_ns()}:"
        base["catalog_url"] = request.getfixturevalue("pg")
        return lambda name: (tmp_path / name, base)
    return lambda name: (tmp_path / "shared", base)


def test_reader_process_holds_v1_while_a_writer_writes_v2(node_settings: Callable[[str], tuple[Path, dict]]) -> None:
    path, settings = node_settings("writer")
    with kvmem.Memory(path, **settings) as writer:
        writer.store(KEY, make_value(KEY, 1))
        writer.flush()
        reader = Reader(*node_settings("reader"))
        try:
            assert reader.ask("pin") == ["PINNED", "1", "1"]
            writer.store(KEY, make_value(KEY, 2))
            writer.flush()
            assert reader.ask("load") == ["PINNED-VALUE", "1"]  # the reader still reads v1
            newcomer = Reader(*node_settings("newcomer"))
            try:
                assert newcomer.ask("pin") == ["PINNED", "2", "2"]  # new readers get v2
            finally:
                newcomer.close()  # closing releases its pin: v2 is reclaimed
            assert kept(writer) == [1]
            assert writer.gc().versions_reclaimed == 0  # v1 is still pinned
            assert reader.ask("release") == ["RELEASED"]
            assert kept(writer) == []  # after release v1 is reclaimed
            assert check_value(KEY, writer.load(KEY)) == 2
            # its own upper tiers still hold v1 (promoted when it pinned): a new pin takes the catalog's v2
            assert reader.ask("pin") == ["PINNED", "2", "2"]
        finally:
            reader.close()


def test_a_killed_readers_pin_expires_and_gc_reclaims_its_version(tmp_path: Path) -> None:
    settings: dict[str, object] = {
        "cpu_bytes": "16MiB",
        "disk_bytes": "64MiB",
        "fsync": "never",
        "pin_lease_seconds": 1.0,
    }
    with kvmem.Memory(tmp_path / "shared", **settings) as writer:
        writer.store(KEY, make_value(KEY, 1))
        writer.flush()
        reader = Reader(tmp_path / "shared", settings)
        try:
            assert reader.ask("pin") == ["PINNED", "1", "1"]
            writer.store(KEY, make_value(KEY, 2))
            time.sleep(1.2)
            assert writer.gc().versions_reclaimed == 0  # alive: renewed
            os.kill(reader.proc.pid, signal.SIGKILL)
            reader.proc.wait(timeout=30)
            deadline = time.monotonic() + 10
            while kept(writer) and time.monotonic() < deadline:
                time.sleep(0.2)
                writer.gc()
            assert kept(writer) == [] and pin_count(writer) == 0
        finally:
            reader.proc.kill()


def test_pins_writes_and_collections_racing_on_postgres(tmp_path: Path, pg: str) -> None:
    """Writers store versions whose value names its version; readers pin and check that every pinned load
    returns exactly the pinned version while gc runs beside them."""
    # NOTE: one shared directory whose CPU tiers hold nothing: both memories read the same disk tier
    settings: dict[str, object] = {
        "cpu_bytes": "4KiB",
        "disk_bytes": "64MiB",
        "fsync": "never",
        "catalog_url": pg,
        "pin_lease_seconds": 5,
    }
    errors: list[BaseException] = []
    stop = threading.Event()
    pinned = [0]
    with kvmem.Memory(tmp_path / "d", **settings) as writer, kvmem.Memory(tmp_path / "d", **settings) as reader:
        writer.store(KEY, make_value(KEY, 1))

        def guarded(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    while not stop.is_set():
                        fn()
                except BaseException as exc:
                    errors.append(exc)
                    stop.set()

            return run

        version = iter(range(2, 10_000))
        one_writer = threading.Lock()  # NOTE: stores in version order, so value version == catalog version

        def write() -> None:
            with one_writer:
                writer.store(KEY, make_value(KEY, next(version)))

        def read() -> None:
            held = [p for p in (writer.pin(KEY), reader.pin(KEY)) if p is not None]
            pinned[0] += len(held)
            for p in held:
                assert check_value(KEY, p.load()) == p.version
            write()
            for p in held:
                assert check_value(KEY, p.load()) == p.version
                p.release()

        threads = [threading.Thread(target=guarded(fn)) for fn in (write, read, read, reader.gc)]
        for t in threads:
            t.start()
        time.sleep(4)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert errors == [], errors
        assert next(version) > 20 and pinned[0] > 20  # the writers and the pins really ran
        reader.gc()
        assert kept(reader) == [] and pin_count(reader) == 0
