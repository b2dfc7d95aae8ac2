"""Agent sessions and steps survive a damaged SQLite catalog: their rows are kept as records beside it.

Each test writes through the public API on a real data directory (a real SQLite file, a real
disk tier), closes it, damages the catalog file for real (:mod:`tests.catalog.damage`) and opens
it again: the rows come back from the records, byte for byte, and the sessions resume.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from kvmem import Memory
from kvmem.agent import AgentSession, SessionNotFound
from kvmem.catalog.schema import agent_sessions, agent_steps, entries
from kvmem.errors import ConfigError, TierUnavailable
from tests.catalog.damage import FAULTS, damage_sqlite
from tests.catalog.test_schema import RELEASE

SETTINGS = {"cpu_bytes": "4MiB", "disk_bytes": "64MiB", "fsync": "never"}
SYSTEM = "You are a support agent."


def fill(session: AgentSession, n: int, tag: str = "") -> None:
    for i in range(n):
        session.append_step(thought=f"{tag}think {i}", action=f"lookup({i})", observation=f"result {i}")


def agent_rows(mem: Memory) -> dict[str, list[dict[str, Any]]]:
    """Every row of the agent tables, in key order."""
    with mem.database.connection() as conn:
        return {
            "sessions": [dict(r) for r in conn.execute(select(agent_sessions).order_by("name")).mappings()],
            "steps": [dict(r) for r in conn.execute(select(agent_steps).order_by("key")).mappings()],
        }


def records(path: Path, kind: str) -> list[Path]:
    return sorted((path / "catalog.sqlite3.records" / kind).iterdir())


@pytest.mark.parametrize("fault", FAULTS)
def test_agent_sessions_and_steps_survive_a_damaged_catalog(tmp_path: Path, fault: str) -> None:
    path = tmp_path / "kvmem"
    with Memory(path, **SETTINGS) as mem:
        support = AgentSession("support", memory=mem, system_prompt=SYSTEM)
        fill(support, 4)
        support.fork("branch", at=1).append_step("branch thought", "branch()", "branched")
        folded = AgentSession("folded", memory=mem, max_steps=4, summarize=lambda s: f"{len(s)} steps")
        fill(folded, 7, "f")  # folds twice: new keys, the old steps swept
        gone = AgentSession("gone", memory=mem)
        fill(gone, 2, "g")
        gone.delete()
        mem.store("entry", b"a cached value")
        before = agent_rows(mem)
        chains = {name: AgentSession.resume(name, memory=mem).steps for name in ("support", "branch", "folded")}
    damage_sqlite(path / "catalog.sqlite3", fault)

    with Memory(path, **SETTINGS) as mem:
        assert agent_rows(mem) == before
        for name, steps in chains.items():
            again = AgentSession.resume(name, memory=mem)
            assert again.steps == steps and again.head == steps[-1].key  # same keys, content, times
        assert AgentSession.resume("support", memory=mem).system_prompt == SYSTEM
        with pytest.raises(SessionNotFound):
            AgentSession.resume("gone", memory=mem)
        AgentSession.resume("support", memory=mem).append_step("after", "the", "rebuild")
    with Memory(path, **SETTINGS) as mem:
        assert [s.thought for s in AgentSession.resume("support", memory=mem).steps][-2:] == ["think 3", "after"]
        assert len(records(path, "agent-steps")) == len(agent_rows(mem)["steps"])  # swept, deleted: no record left


def test_a_catalog_from_before_records_gets_them_when_first_opened(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    path.mkdir()
    shutil.copy(RELEASE, path / "catalog.sqlite3")  # kvmem 0.1.0's: agent session s1 with one step, no records
    with Memory(path, **SETTINGS) as mem:
        steps = AgentSession.resume("s1", memory=mem).steps
        before = agent_rows(mem)
    assert len(steps) == 1
    damage_sqlite(path / "catalog.sqlite3", "magic")
    with Memory(path, **SETTINGS) as mem:
        assert agent_rows(mem) == before and AgentSession.resume("s1", memory=mem).steps == steps
    assert len(records(path, "agent-steps")) == 1


def test_a_damaged_record_is_skipped_and_the_others_restored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kvmem"
    with Memory(path, **SETTINGS) as mem:
        fill(AgentSession("kept", memory=mem), 2, "k")
        AgentSession("hit", memory=mem)  # no step: its only record is its session's
        kept = AgentSession.resume("kept", memory=mem).steps
    sessions = records(path, "agent-sessions")
    hit = next(p for p in sessions if b'"hit"' in p.read_bytes())
    data = bytearray(hit.read_bytes())
    data[random.Random(1).randrange(len(data))] ^= 0x01  # one bit, anywhere: header, JSON or padding
    hit.write_bytes(bytes(data))
    damage_sqlite(path / "catalog.sqlite3", "magic")
    with caplog.at_level(logging.WARNING, logger="kvmem.catalog.mirror"), Memory(path, **SETTINGS) as mem:
        assert AgentSession.resume("kept", memory=mem).steps == kept
        with pytest.raises(SessionNotFound):
            AgentSession.resume("hit", memory=mem)
    assert f"row record {hit} not restored" in caplog.text


def test_a_step_whose_record_cannot_be_written_is_not_stored(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    with Memory(path, **SETTINGS) as mem:
        session = AgentSession("s", memory=mem)
        fill(session, 1)
        steps_dir = path / "catalog.sqlite3.records" / "agent-steps"
        shutil.rmtree(steps_dir)
        steps_dir.write_bytes(b"")  # a file where the records' directory must be: no record can be written
        with pytest.raises(TierUnavailable, match="agent-steps"):
            session.append_step("lost", "", "")
        assert len(AgentSession.resume("s", memory=mem)) == 1  # the append rolled back with its record


def test_only_the_tables_of_primary_data_keep_records(tmp_path: Path) -> None:
    with Memory(tmp_path / "kvmem", **SETTINGS) as mem, mem.database.transaction() as conn:
        with pytest.raises(ConfigError, match="'kvmem_entries' keeps no row records"):
            mem.database.keep_row(conn, entries, {"key": "k"})
        with pytest.raises(ConfigError, match=r"key \{'id': 'x'\} of kvmem_agent_sessions: expected the columns name"):
            mem.database.keep_row(conn, agent_sessions, {"id": "x"})
