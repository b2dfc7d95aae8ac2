"""Rows that exist nowhere else, also kept as CRC-checked blob files beside a SQLite catalog.

Most of what the catalog database holds is *about* the blobs in the tiers and is rebuilt from
their headers when the database is damaged (:mod:`kvmem.recovery`). Some tables hold primary
data instead: agent sessions and steps (:mod:`kvmem.agent.chain`), the LangGraph store's
items, with their vectors (``langchain_kvmem.store``), and the LangGraph checkpointer's
checkpoints, with their channel rows, value blobs, list elements and writes (``langchain_kvmem.saver``). Each
row of those is also kept as a *record*: one file in kvmem's blob format (JSON header, payload
segments for binary columns, CRC32C over every byte; no pickle) under
``<database file>.records/<kind>/``, named by the sha256 of the row's key columns. A record holds
the row and its child rows (an item's vectors, a checkpoint's channel rows).

- A writer calls :meth:`RowMirror.sync` in the transaction that changed the row, after the
  change: the record is rewritten from the row as that transaction sees it, or removed when the
  row is gone. A record that cannot be written fails the transaction
  (:class:`~kvmem.errors.TierUnavailable`): no change commits that a damaged catalog would lose.
  NOTE: on SQLite a transaction holds the database's write lock from its first write until it
  commits, so the records of one row are written in the order their transactions commit.
  NOTE: a record is replaced atomically but not fsynced, as the database's own commits are not
  (``synchronous=NORMAL``): a killed process loses none, a power cut may lose the last ones.
  Fsyncing each record cost ~15 ms more per agent step here (two records, two fsyncs each).
- A catalog opening a database that was set aside as damaged, or whose file was missing or
  empty, inserts the rows of every intact record (:meth:`RowMirror.open`); a record that fails
  its check is logged and skipped.
- A database from before records (no records directory yet) gets a record for each of its
  rows when first opened.

A PostgreSQL catalog, or an in-memory SQLite one, has no records (``RowMirror(None)``): there is
no damaged file for kvmem to set aside and rebuild.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sqlalchemy import Table, false, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine

from kvmem import blob as blobfmt
from kvmem.catalog.schema import (
    agent_sessions,
    agent_steps,
    langgraph_blobs,
    langgraph_channels,
    langgraph_checkpoints,
    langgraph_elements,
    langgraph_items,
    langgraph_vectors,
    langgraph_writes,
)
from kvmem.errors import ConfigError, IntegrityError, TierUnavailable
from kvmem.fsutil import write_atomic
from kvmem.keys import content_hash

__all__ = ["MIRRORED", "Mirrored", "RowMirror"]

log = logging.getLogger(__name__)

_FORMAT = 1
_DOMAIN = "kvmem/catalog/row-record"


@dataclass(frozen=True)
class Mirrored:
    """A table whose rows are kept as records.

    Attributes:
        kind: the records' directory under the records root.
        table: the table.
        key: the columns that name a row (a record's file name hashes their values).
        children: ``(table, column, parent column)`` of rows kept in their parent's record: those
            whose ``column`` equals the row's ``parent column``.
    """

    kind: str
    table: Table
    key: tuple[str, ...]
    children: tuple[tuple[Table, str, str], ...] = ()


MIRRORED: dict[str, Mirrored] = {
    spec.table.name: spec
    for spec in (
        Mirrored("agent-sessions", agent_sessions, ("name",)),
        Mirrored("agent-steps", agent_steps, ("key",)),
        Mirrored("langgraph-items", langgraph_items, ("namespace", "key"), ((langgraph_vectors, "item_id", "id"),)),
        Mirrored(
            "langgraph-checkpoints",
            langgraph_checkpoints,
            ("thread_id", "checkpoint_ns", "checkpoint_id"),
            ((langgraph_channels, "checkpoint", "id"),),
        ),
        Mirrored("langgraph-blobs", langgraph_blobs, ("key",)),
        Mirrored("langgraph-elements", langgraph_elements, ("key",)),
        Mirrored(
            "langgraph-writes",
            langgraph_writes,
            ("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"),
        ),
    )
}
"""The mirrored tables, by table name."""


class RowMirror:
    """The records of the mirrored rows of one SQLite database (see the module docstring).

    Args:
        root: the records directory; ``None``: the database keeps no records (every call is a no-op).
    """

    def __init__(self, root: Path | None) -> None:
        self.root = root

    @classmethod
    def beside(cls, database: Path) -> RowMirror:
        """The records of the SQLite database file ``database``: ``<database>.records``."""
        return cls(database.with_name(f"{database.name}.records"))

    def sync(self, conn: Connection, table: Table, key: Mapping[str, object]) -> None:
        """Make the record of ``table``'s row named by ``key`` match the row as ``conn``'s transaction sees it.

        Call it in the transaction that changed the row, after the change.

        Raises:
            ConfigError: ``table`` is not mirrored, or ``key`` does not name its key columns.
            TierUnavailable: the record cannot be written or removed (the caller's transaction then rolls back).
        """
        spec = _spec(table, key)
        if self.root is None:
            return
        path = self.root / spec.kind / content_hash(json.dumps([key[c] for c in spec.key]), _DOMAIN)
        row = conn.execute(select(table).where(*(table.c[c] == key[c] for c in spec.key))).mappings().first()
        try:
            if row is None:
                path.unlink(missing_ok=True)
            else:
                write_atomic(path, _encode(conn, spec, dict(row)), durable=False)
        except OSError as exc:
            raise TierUnavailable(f"row record {path} of {table.name} {dict(key)!r} cannot be written: {exc}") from exc

    def open(self, engine: Engine, lost: bool) -> None:
        """Restore the rows of a ``lost`` database from the records; give a database from before records its records.

        Args:
            engine: the database's engine (its schema already current).
            lost: the database was set aside as damaged, or its file was missing or empty.
        """
        if self.root is None or (self.root.is_dir() and not lost):
            return
        with engine.begin() as conn:
            # NOTE: a write that changes nothing takes SQLite's write lock: no writer commits (and writes a
            # record) while the records are read or made, and a second process opening waits, then finds them
            conn.execute(update(agent_sessions).where(false()).values(length=0))
            if lost and self.root.is_dir():
                log.warning("kvmem: %d row records restored from %s", self._restore(conn), self.root)
            elif not self.root.is_dir():
                self._backfill(conn)

    def _restore(self, conn: Connection) -> int:
        """Insert the rows of every intact record whose row the database lacks; how many records were restored."""
        assert self.root is not None
        restored = 0
        for spec in MIRRORED.values():
            for path in sorted(self.root.glob(f"{spec.kind}/[0-9a-f]*")):
                try:
                    rows = _decode(path.read_bytes(), spec)
                except (OSError, IntegrityError) as exc:
                    log.warning("kvmem: row record %s not restored (%s)", path, exc)
                    continue
                (table, values), *children = rows
                # NOTE: child rows only with their own row: they name it by a column (an item's id) that
                # another row may hold now
                if conn.execute(sqlite.insert(table).on_conflict_do_nothing(), values).rowcount:
                    for child, child_values in children:
                        conn.execute(sqlite.insert(child).on_conflict_do_nothing(), child_values)
                    restored += 1
        return restored

    def _backfill(self, conn: Connection) -> None:
        """Write the record of every mirrored row, then make the records directory (also when there are none)."""
        assert self.root is not None
        for spec in MIRRORED.values():
            for row in conn.execute(select(*(spec.table.c[c] for c in spec.key))).all():
                self.sync(conn, spec.table, dict(zip(spec.key, row)))
        self.root.mkdir(parents=True, exist_ok=True)


def _spec(table: Table, key: Mapping[str, object]) -> Mirrored:
    """The :class:`Mirrored` of ``table``, checked against ``key``.

    Raises:
        ConfigError: ``table`` is not mirrored, or ``key`` does not name its key columns.
    """
    spec = MIRRORED.get(table.name)
    if spec is None:
        raise ConfigError(f"table {table.name!r} keeps no row records; mirrored: {', '.join(MIRRORED)}")
    if sorted(key) != sorted(spec.key):
        raise ConfigError(f"key {dict(key)!r} of {table.name}: expected the columns {', '.join(spec.key)}")
    return spec


def _encode(conn: Connection, spec: Mirrored, row: dict[str, Any]) -> bytes:
    """The record of ``row`` of ``spec.table`` and its child rows (as ``conn`` reads them): a sealed blob."""
    rows = [(spec.table, row)]
    for child, column, parent in spec.children:
        found = conn.execute(select(child).where(child.c[column] == row[parent])).mappings()
        rows += [(child, dict(r)) for r in found]
    payload: list[bytes] = []  # the binary values, one payload segment each
    described = []
    for table, values in rows:
        binary = {name: len(payload) + i for i, name in enumerate(n for n, v in values.items() if isinstance(v, bytes))}
        payload += [values[name] for name in binary]
        plain = {name: value for name, value in values.items() if name not in binary}
        described.append({"table": table.name, "values": plain, "binary": binary})
    extents = zip(blobfmt.segment_offsets([len(v) for v in payload], blobfmt.ALIGN), map(len, payload))
    header = {"kind": "rows", "format": _FORMAT, "record": spec.kind, "rows": described, "extents": list(extents)}
    segments = [np.frombuffer(value, dtype=np.uint8) for value in payload]
    return b"".join(part.tobytes() for part in blobfmt.encode(header, segments, align=blobfmt.ALIGN).parts)


def _decode(data: bytes, spec: Mirrored) -> list[tuple[Table, dict[str, Any]]]:
    """The rows of a record of ``spec``'s table, every CRC checked.

    Raises:
        IntegrityError: a CRC that does not match, a truncated file, or a header that is not a record of ``spec``.
    """
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    header, start = blobfmt.verify(buf)
    tables = {spec.table.name: spec.table, **{child.name: child for child, _, _ in spec.children}}
    if header.get("kind") != "rows" or header.get("format") != _FORMAT or header.get("record") != spec.kind:
        raise IntegrityError(f"not a row record of {spec.table.name} (format {_FORMAT})")
    rows = []
    try:
        for entry in header["rows"]:
            table = tables[entry["table"]]
            values = dict(entry["values"])
            for name, segment in entry["binary"].items():
                at, size = header["extents"][segment]
                values[name] = data[start + at : start + at + size]
            if not set(values) <= set(table.c.keys()):
                raise KeyError(f"columns {sorted(set(values) - set(table.c.keys()))}")
            rows.append((table, values))
    except (KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"row record of {spec.table.name} names what its tables lack: {exc}") from None
    if not rows or rows[0][0] is not spec.table:
        raise IntegrityError(f"row record of {spec.table.name} does not start with a row of it")
    return rows
