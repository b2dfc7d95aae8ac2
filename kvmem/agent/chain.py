"""Agent steps as a hash chain in the catalog database.

A step's key is the sha256 of its canonical JSON, which holds its parent's key,
so a session's head key names its whole history (a Merkle chain). Step bodies
are lz4-compressed JSON rows of ``kvmem_agent_steps``; sessions are rows of
``kvmem_agent_sessions`` whose head moves by compare-and-swap. The tables live
in the catalog database (SQLite by default, PostgreSQL when shared), so a
session survives restarts and is shared by every process on that catalog, and
steps are never evicted the way cached tensors are.

Steps are shared, never copied: a fork is a new session row pointing into the
same chain. Rows no session reaches any more are deleted by :func:`sweep`.

Every write here also keeps the rows it changed recoverable outside the database
(``Database.keep_row``, in the same transaction): the chain is primary data, and a
catalog rebuilt after damage restores sessions and steps from those records.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import lz4.frame
from sqlalchemy import delete, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError as SqlIntegrityError

from kvmem.catalog.schema import agent_sessions as sessions
from kvmem.catalog.schema import agent_steps as steps
from kvmem.errors import IntegrityError
from kvmem.keys import content_hash
from kvmem.ports import Database

__all__ = ["Step", "create_session", "delete_session", "sessions", "steps"]

_FORMAT = 1
_DOMAIN = "kvmem/agent/step"


@dataclass(frozen=True)
class Step:
    """One thought / action / observation of an agent, or a summary of folded steps.

    ``key`` hashes every other field but ``index`` (the position, known from the chain).
    """

    index: int
    thought: str
    action: str
    observation: str
    key: str
    parent_key: str | None
    created: float
    kind: str = "step"  # or "summary"

    def text(self) -> str:
        """How the step reads in a prompt."""
        if self.kind == "summary":
            return f"Summary of earlier steps: {self.thought}\n"
        return f"Thought: {self.thought}\nAction: {self.action}\nObservation: {self.observation}\n"


def _canonical(parent: str | None, kind: str, thought: str, action: str, observation: str, created: float) -> bytes:
    body = {
        "format": _FORMAT,
        "parent": parent,
        "kind": kind,
        "thought": thought,
        "action": action,
        "observation": observation,
        "created": created,
    }
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def make_step(
    index: int,
    parent: str | None,
    thought: str,
    action: str,
    observation: str,
    kind: str = "step",
    created: float | None = None,
) -> tuple[Step, bytes]:
    """A new step and its row body."""
    created = time.time() if created is None else created
    raw = _canonical(parent, kind, thought, action, observation, created)
    step = Step(index, thought, action, observation, content_hash(raw, _DOMAIN), parent, created, kind)
    return step, lz4.frame.compress(raw)


def link(
    database: Database,
    name: str,
    old_head: str | None,
    rows: list[tuple[str, str | None, bytes]],
    new_head: str | None,
    length: int,
) -> bool:
    """In one transaction: store ``rows`` (key, parent, body) not stored yet and move ``name``'s head
    from ``old_head`` to ``new_head``; False (nothing written) when the head was no longer ``old_head``.

    NOTE: one transaction, so a step is never visible without the head that links it (a
    sweep can never take it) and a lost race leaves nothing behind.
    """
    try:
        with database.transaction() as conn:
            added = [
                (key, parent, body)
                for key, parent, body in rows
                if conn.execute(select(steps.c.key).where(steps.c.key == key)).first() is None
            ]
            for key, parent, body in added:
                conn.execute(steps.insert(), {"key": key, "parent": parent, "body": body})
            was = sessions.c.head.is_(None) if old_head is None else sessions.c.head == old_head
            moved = conn.execute(
                update(sessions)
                .where(sessions.c.name == name, was)
                .values(head=new_head, length=length, updated=time.time())
            ).rowcount
            if moved != 1:
                raise _Moved  # rolls the inserts back with the transaction
            for key, _, _ in added:
                database.keep_row(conn, steps, {"key": key})
            database.keep_row(conn, sessions, {"name": name})
    except (_Moved, SqlIntegrityError):  # also a concurrent writer storing the same step first
        return False
    return True


def create_session(database: Database, name: str, head: str | None, length: int, system: str, updated: float) -> None:
    """Store a new session row ``name`` whose chain ends at ``head`` (``length`` steps).

    Raises:
        sqlalchemy.exc.IntegrityError: a session ``name`` exists already.
    """
    with database.transaction() as conn:
        conn.execute(
            sessions.insert(), {"name": name, "head": head, "length": length, "system": system, "updated": updated}
        )
        database.keep_row(conn, sessions, {"name": name})


def delete_session(database: Database, name: str) -> None:
    """Delete the session row ``name`` (its steps stay until :func:`sweep`)."""
    with database.transaction() as conn:
        conn.execute(delete(sessions).where(sessions.c.name == name))
        database.keep_row(conn, sessions, {"name": name})


class _Moved(Exception):
    """The head was not where the writer last saw it."""


def _decode(index: int, key: str, row: object | None, session: str) -> Step:
    """The step stored under ``key``, checked against its key, or IntegrityError naming ``index``."""
    where = f"session {session!r}: step {index} ({key[:12]}…)"
    if row is None:
        raise IntegrityError(f"{where} is missing from the step table")
    try:
        raw = lz4.frame.decompress(row.body)  # type: ignore[attr-defined]
        body = json.loads(raw)
    except (RuntimeError, ValueError) as exc:
        raise IntegrityError(f"{where} is corrupt: {exc}") from None
    if content_hash(raw, _DOMAIN) != key or body.get("format") != _FORMAT or body.get("parent") != row.parent:  # type: ignore[attr-defined]
        raise IntegrityError(f"{where} was altered: its content no longer hashes to its key")
    return Step(
        index, body["thought"], body["action"], body["observation"], key, body["parent"], body["created"], body["kind"]
    )


def read_chain(conn: Connection, head: str | None, length: int, session: str) -> list[Step]:
    """Every step from the root to ``head``, each verified; IntegrityError names the first bad step.

    Raises:
        IntegrityError: a step missing, corrupt, altered, or a chain longer or shorter than ``length``.
    """
    chain: list[Step] = []
    key = head
    while key is not None:
        index = length - 1 - len(chain)
        if index < 0:
            raise IntegrityError(f"session {session!r}: the chain is longer than its recorded {length} steps")
        row = conn.execute(select(steps.c.parent, steps.c.body).where(steps.c.key == key)).first()
        step = _decode(index, key, row, session)
        chain.append(step)
        key = step.parent_key
    if len(chain) != length:
        raise IntegrityError(f"session {session!r}: the chain has {len(chain)} steps, its head row says {length}")
    return chain[::-1]


def _reachable(conn: Connection) -> set[str]:
    parents: dict[str, str | None] = {k: p for k, p in conn.execute(select(steps.c.key, steps.c.parent))}
    seen: set[str] = set()
    for (head,) in conn.execute(select(sessions.c.head).where(sessions.c.head.is_not(None))):
        key = head
        while key is not None and key not in seen:
            seen.add(key)
            key = parents.get(key)
    return seen


def sweep(database: Database) -> int:
    """Delete step rows no session's chain reaches; how many.

    Steps are inserted in the same transaction as the head that links them
    (:func:`link`), so no committed step is ever unreachable to a sweep.
    """
    with database.transaction() as conn:
        live = _reachable(conn)
        dead = [k for (k,) in conn.execute(select(steps.c.key)) if k not in live]
        for i in range(0, len(dead), 500):
            conn.execute(delete(steps).where(steps.c.key.in_(dead[i : i + 500])))
        for key in dead:
            database.keep_row(conn, steps, {"key": key})
    return len(dead)
