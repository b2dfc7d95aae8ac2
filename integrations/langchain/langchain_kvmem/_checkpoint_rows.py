"""The rows of ``KVMemSaver`` in kvmem's catalog database: checkpoints, channel rows, value blobs, writes.

- ``kvmem_langgraph_checkpoints``: one row per checkpoint (thread, namespace, id, parent, run id,
  the JSON-able metadata for filters, and ``body``: the checkpoint without its channel values,
  with its metadata, as one kvmem blob).
- ``kvmem_langgraph_channels``: which value holds each channel's value in each checkpoint (the key
  of a blob, or of the last element of a list), and the channel's version there.
- ``kvmem_langgraph_blobs``: the values, each stored once under the content hash of its serialized
  bytes: a channel whose version did not move since the parent checkpoint points at the parent's
  blob, and equal values (a fork's, a copied thread's) share one.
- ``kvmem_langgraph_elements``: the values that are lists, element by element: each row one element,
  naming the element before it, under a key that hashes its parent's key with its own bytes. A list
  that extends another (a thread's ``messages``, step after step) stores only its new elements: its
  first ones are the other's rows.
- ``kvmem_langgraph_writes``: the pending writes of a step's tasks, named by their checkpoint's ids
  (LangGraph may save them before their checkpoint).

This module moves bytes; :mod:`langchain_kvmem.saver` makes and checks them. Every write is one
transaction, its rows also kept outside the database (``Database.keep_row``), and rows are never
evicted: a checkpoint lives until a delete, prune or ``delete_for_runs`` removes it.

Blobs no channel row names any more are deleted by the transaction that dropped the last row
naming them; elements too, when neither a channel row nor another element (as its parent) names
them, from the last element back. NOTE (locking, SQLite and PostgreSQL alike): a transaction that links existing blobs
locks them first (``SELECT .. FOR UPDATE`` in key order; SQLite's write lock, taken by each
transaction's first statement, which is a write, covers it there); the collector locks its
candidates the same way (blobs, then elements), then deletes those nothing names, in a new
statement whose snapshot sees every link committed before. A value is never deleted under a link
being made; a link whose value was deleted first sees it gone and stores it again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row, Table, and_, bindparam, delete, exists, func, literal, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from kvmem.catalog.schema import langgraph_blobs as blobs
from kvmem.catalog.schema import langgraph_channels as channels
from kvmem.catalog.schema import langgraph_checkpoints as checkpoints
from kvmem.catalog.schema import langgraph_elements as elements
from kvmem.catalog.schema import langgraph_writes as writes
from kvmem.errors import IntegrityError
from kvmem.ports import Database

__all__ = [
    "Blob",
    "CheckpointRows",
    "Element",
    "ListValue",
    "NewCheckpoint",
    "StoredCheckpoint",
    "all_but_latest",
    "blobs",
    "channels",
    "checkpoints",
    "elements",
    "everything_of",
    "of_runs",
    "writes",
]

_CHUNK = 500  # keys per IN (...) list
Missing = Callable[[str], "str | None"]  # of the list ending at a key: the first element the caller lacks, or None


def _read_all(head: str) -> str | None:
    """The caller has no element: every list is read whole."""
    return head


_INDEX = (
    checkpoints.c.id,
    checkpoints.c.thread_id,
    checkpoints.c.checkpoint_ns,
    checkpoints.c.checkpoint_id,
    checkpoints.c.metadata,
)


@dataclass(frozen=True)
class Blob:
    """A serialized value as stored: its content hash and its kvmem blob."""

    key: str
    body: bytes


@dataclass(frozen=True)
class Element:
    """One element of a list value as stored: its key, the key of the element before it, its serialized bytes."""

    key: str
    parent: str | None
    type: str
    crc: int
    data: bytes


@dataclass(frozen=True)
class ListValue:
    """A list value as stored: its elements in order, each naming the one before it; ``key``: the last's."""

    elements: tuple[Element, ...]

    @property
    def key(self) -> str:
        return self.elements[-1].key


Value = Blob | ListValue


@dataclass(frozen=True)
class NewCheckpoint:
    """A checkpoint to store (see :meth:`CheckpointRows.put`)."""

    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_id: str | None
    run_id: str | None
    metadata: dict[str, Any]
    body: bytes
    versions: dict[str, str]  # channel -> JSON of its version, for every channel the checkpoint has


@dataclass
class StoredCheckpoint:
    """A checkpoint's rows as read: its body, each channel's ``(key, blob or None)``, its writes.

    A channel whose blob is ``None`` holds a list, ``key`` its last element in ``elements`` (or is missing):
    ``elements`` holds every element read with the checkpoint (shared by those read together).
    """

    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_id: str | None
    body: bytes
    elements: dict[str, Element]
    channels: dict[str, tuple[str, bytes | None]] = field(default_factory=dict)
    writes: list[tuple[str, str, bytes]] = field(default_factory=list)  # (task id, channel, blob), in order


class CheckpointRows:
    """The checkpointer's tables in one catalog database (see the module docstring).

    Args:
        database: the memory's catalog database (``Memory.database``).
    """

    def __init__(self, database: Database) -> None:
        self._database = database
        stmt = database.insert(checkpoints)
        self._upsert = stmt.on_conflict_do_update(
            index_elements=[checkpoints.c.thread_id, checkpoints.c.checkpoint_ns, checkpoints.c.checkpoint_id],
            set_={name: stmt.excluded[name] for name in ("parent_id", "run_id", "metadata", "body")},
        ).returning(checkpoints.c.id)
        self._add_blob = database.insert(blobs).on_conflict_do_nothing()
        self._add_element = database.insert(elements).on_conflict_do_nothing()
        self._add_write = database.insert(writes).on_conflict_do_nothing()
        stmt = database.insert(writes)
        self._set_write = stmt.on_conflict_do_update(
            index_elements=list(writes.primary_key.columns),
            set_={name: stmt.excluded[name] for name in ("channel", "task_path", "body")},
        )
        # the reads, built once: a checkpoint with its channel rows and blobs in one query
        loaded = select(
            *_INDEX[:4],
            checkpoints.c.parent_id,
            checkpoints.c.body,
            channels.c.channel,
            channels.c.blob,
            blobs.c.body.label("value"),
        ).select_from(
            checkpoints.outerjoin(channels, channels.c.checkpoint == checkpoints.c.id).outerjoin(
                blobs, blobs.c.key == channels.c.blob
            )
        )
        of_thread = select(checkpoints.c.id).where(
            checkpoints.c.thread_id == bindparam("thread_id"), checkpoints.c.checkpoint_ns == bindparam("checkpoint_ns")
        )
        self._newest = loaded.where(
            checkpoints.c.id == of_thread.order_by(checkpoints.c.checkpoint_id.desc()).limit(1).scalar_subquery()
        )
        self._named = loaded.where(
            checkpoints.c.id
            == of_thread.where(checkpoints.c.checkpoint_id == bindparam("checkpoint_id")).scalar_subquery()
        )
        self._by_ids = loaded.where(checkpoints.c.id.in_(bindparam("ids", expanding=True)))
        # the elements of lists, from their last: each once (UNION) when several lists may share them, in one
        # checkpoint's read without the dedup (UNION ALL: ~40% faster on SQLite; a rare shared prefix comes twice)
        chain = select(elements).where(elements.c.key.in_(bindparam("keys", expanding=True))).cte(recursive=True)
        step = select(elements).join(chain, elements.c.key == chain.c.parent)
        self._chains = {True: select(chain.union(step)), False: select(chain.union_all(step))}
        self._writes = (
            select(writes)
            .where(
                writes.c.thread_id.in_(bindparam("threads", expanding=True)),
                writes.c.checkpoint_id.in_(bindparam("ids", expanding=True)),
            )
            .order_by(writes.c.task_path, writes.c.task_id, writes.c.idx)
        )

    # -- writes ---------------------------------------------------------------------------------
    def put(self, new: NewCheckpoint, fresh: dict[str, Value], serialize: Callable[[str], Value | None]) -> None:
        """Store ``new`` and link each of its channels to a value (a blob or a list), in one transaction.

        A channel's value is, in this order: ``fresh[channel]``; the parent's, when the parent holds the
        channel at the same version; ``serialize(channel)`` (``None``: the channel has no value here).
        A list's elements stored already (the first ones of the parent's list) are not stored again.

        Raises:
            IntegrityError: a channel's blob was deleted with its parent during the put, and the
                checkpoint carries no value to store it again from.
        """
        with self._database.transaction() as conn:
            row_id = conn.execute(  # NOTE: a write first: SQLite's write lock before any read
                self._upsert,
                {
                    "thread_id": new.thread_id,
                    "checkpoint_ns": new.checkpoint_ns,
                    "checkpoint_id": new.checkpoint_id,
                    "parent_id": new.parent_id,
                    "run_id": new.run_id,
                    "metadata": new.metadata,
                    "body": new.body,
                },
            ).scalar_one()
            replaced = conn.execute(  # a checkpoint stored again gets its channels anew
                delete(channels).where(channels.c.checkpoint == row_id).returning(channels.c.blob)
            ).scalars()
            dropped = set(replaced)
            parent = self._parent_channels(conn, new)
            chosen: dict[str, Value | str] = {}  # a value to store, or the key of the parent's
            for channel, version in new.versions.items():
                if channel in fresh:
                    chosen[channel] = fresh[channel]
                elif channel in parent and parent[channel][0] == version:
                    chosen[channel] = parent[channel][1]
                elif (value := serialize(channel)) is not None:
                    chosen[channel] = value
            keys = self._link(conn, chosen, serialize, new)
            if keys:
                conn.execute(
                    channels.insert(),
                    [
                        {"checkpoint": row_id, "channel": ch, "version": new.versions[ch], "blob": key}
                        for ch, key in keys.items()
                    ],
                )
            self._collect(conn, dropped - set(keys.values()))
            self._database.keep_row(conn, checkpoints, _checkpoint_key(new))

    def put_writes(
        self, thread_id: str, checkpoint_ns: str, checkpoint_id: str, rows: Sequence[dict[str, Any]]
    ) -> None:
        """Store a task's writes to a checkpoint: ``rows`` of ``task_id, idx, channel, task_path, body``.

        A write whose ``(task_id, idx)`` is stored already is kept, unless ``idx`` < 0 (LangGraph's
        special writes: an error, an interrupt, ...), which replaces it.
        """
        with self._database.transaction() as conn:
            for row in rows:
                values = {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns, "checkpoint_id": checkpoint_id, **row}
                conn.execute(self._set_write if row["idx"] < 0 else self._add_write, values)
                self._database.keep_row(conn, writes, {name: values[name] for name in _WRITE_KEY})

    def delete(self, where: ColumnElement[bool], orphan_writes: ColumnElement[bool] | None = None) -> int:
        """Delete the checkpoints ``where`` selects, their channel rows and writes, and the values left unnamed.

        Args:
            where: a condition on ``kvmem_langgraph_checkpoints``.
            orphan_writes: also delete the writes this condition on ``kvmem_langgraph_writes`` selects (those
                saved for a checkpoint that was never stored).

        Returns:
            How many checkpoints went.
        """
        with self._database.transaction() as conn:
            gone = conn.execute(
                delete(checkpoints)
                .where(where)
                .returning(
                    checkpoints.c.id, checkpoints.c.thread_id, checkpoints.c.checkpoint_ns, checkpoints.c.checkpoint_id
                )
            ).all()
            unnamed: set[str] = set()
            for chunk in _chunks([row.id for row in gone]):
                unnamed.update(
                    conn.execute(
                        delete(channels).where(channels.c.checkpoint.in_(chunk)).returning(channels.c.blob)
                    ).scalars()
                )
            targets = {(row.thread_id, row.checkpoint_ns, row.checkpoint_id) for row in gone}
            dropped = {
                tuple(w._mapping[n] for n in _WRITE_KEY)
                for w in self._writes_of(conn, targets)
                if (w.thread_id, w.checkpoint_ns, w.checkpoint_id) in targets
            }
            for thread_id, checkpoint_ns, checkpoint_id in targets:
                conn.execute(
                    delete(writes).where(
                        writes.c.thread_id == thread_id,
                        writes.c.checkpoint_ns == checkpoint_ns,
                        writes.c.checkpoint_id == checkpoint_id,
                    )
                )
            if orphan_writes is not None:
                dropped.update(conn.execute(delete(writes).where(orphan_writes).returning(*writes.primary_key.columns)))
            for key in dropped:
                self._database.keep_row(conn, writes, dict(zip(_WRITE_KEY, key)))
            self._collect(conn, unnamed)
            for row in gone:
                self._database.keep_row(conn, checkpoints, _checkpoint_key(row))
        return len(gone)

    def copy_thread(self, source: str, target: str) -> None:
        """Copy every checkpoint and write of thread ``source`` to thread ``target``; values are shared, not copied.

        Checkpoints and writes ``target`` holds already (the same namespace and id) are kept as they are.
        """
        with self._database.transaction() as conn:
            cols = [c.name for c in checkpoints.c if c.name not in ("id", "thread_id")]
            conn.execute(  # NOTE: a write first (see put)
                self._database.insert(checkpoints)
                .from_select(
                    ["thread_id", *cols],
                    select(literal(target), *(checkpoints.c[c] for c in cols)).where(checkpoints.c.thread_id == source),
                )
                .on_conflict_do_nothing()
            )
            old, new = checkpoints.alias("old"), checkpoints.alias("new")
            linked = (
                select(new.c.id, channels.c.channel, channels.c.version, channels.c.blob)
                .select_from(channels.join(old, channels.c.checkpoint == old.c.id))
                .join(
                    new,
                    and_(
                        new.c.thread_id == target,
                        new.c.checkpoint_ns == old.c.checkpoint_ns,
                        new.c.checkpoint_id == old.c.checkpoint_id,
                    ),
                )
                .where(old.c.thread_id == source)
            )
            self._lock(conn, {row.blob for row in conn.execute(linked)})
            conn.execute(
                self._database.insert(channels)
                .from_select(["checkpoint", "channel", "version", "blob"], linked)
                .on_conflict_do_nothing()
            )
            wcols = [c.name for c in writes.c if c.name != "thread_id"]
            conn.execute(
                self._database.insert(writes)
                .from_select(
                    ["thread_id", *wcols],
                    select(literal(target), *(writes.c[c] for c in wcols)).where(writes.c.thread_id == source),
                )
                .on_conflict_do_nothing()
            )
            for row in conn.execute(select(*_INDEX[1:4]).where(checkpoints.c.thread_id == target)).all():
                self._database.keep_row(conn, checkpoints, _checkpoint_key(row))
            for key in conn.execute(select(*writes.primary_key.columns).where(writes.c.thread_id == target)).all():
                self._database.keep_row(conn, writes, dict(zip(_WRITE_KEY, key)))

    # -- reads ----------------------------------------------------------------------------------
    def one(
        self, thread_id: str, checkpoint_ns: str, checkpoint_id: str | None, missing: Missing = _read_all
    ) -> StoredCheckpoint | None:
        """The checkpoint ``checkpoint_id`` of the thread's namespace (``None``: its newest), or ``None``; of its
        lists, the elements from the one ``missing`` names back (see :meth:`_load`)."""
        params = {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns}
        with self._database.connection() as conn:
            if checkpoint_id is None:
                found = self._load(conn, conn.execute(self._newest, params), False, missing)
            else:
                rows = conn.execute(self._named, {**params, "checkpoint_id": checkpoint_id})
                found = self._load(conn, rows, False, missing)
        return next(iter(found.values()), None)

    def index(
        self, thread_id: str | None, checkpoint_ns: str | None, checkpoint_id: str | None, before: str | None
    ) -> list[Row[Any]]:
        """``id, thread_id, checkpoint_ns, checkpoint_id, metadata`` of the checkpoints that match, newest first.

        ``None`` matches any thread, namespace or id; ``before``: only ids below it.
        """
        stmt = select(*_INDEX)
        for column, value in (
            (checkpoints.c.thread_id, thread_id),
            (checkpoints.c.checkpoint_ns, checkpoint_ns),
            (checkpoints.c.checkpoint_id, checkpoint_id),
        ):
            if value is not None:
                stmt = stmt.where(column == value)
        if before is not None:
            stmt = stmt.where(checkpoints.c.checkpoint_id < before)
        with self._database.connection() as conn:
            return list(conn.execute(stmt.order_by(checkpoints.c.checkpoint_id.desc(), checkpoints.c.id.desc())))

    def load(self, ids: Sequence[int], missing: Missing = _read_all) -> list[StoredCheckpoint]:
        """The checkpoints of rows ``ids`` (as :meth:`index` names them) still stored, in that order (their lists
        as :meth:`one` reads them)."""
        with self._database.connection() as conn:
            rows = (row for chunk in _chunks(ids) for row in conn.execute(self._by_ids, {"ids": chunk}))
            found = self._load(conn, rows, True, missing)
        return [found[i] for i in ids if i in found]

    def counts(self) -> dict[str, int]:
        """Rows per table: ``checkpoints``, ``channels``, ``blobs``, ``elements``, ``writes`` (for tests and
        diagnostics)."""
        with self._database.connection() as conn:
            return {
                name: conn.execute(select(func.count()).select_from(table)).scalar_one()
                for name, table in (
                    ("checkpoints", checkpoints),
                    ("channels", channels),
                    ("blobs", blobs),
                    ("elements", elements),
                    ("writes", writes),
                )
            }

    # -- helpers --------------------------------------------------------------------------------
    def _load(
        self, conn: Connection, rows: Iterable[Row[Any]], shared: bool, missing: Missing
    ) -> dict[int, StoredCheckpoint]:
        """The checkpoints of ``rows`` (of a ``loaded`` query: a checkpoint's row per channel), by row id, with
        their writes and the elements of their lists (``shared``: lists that may share elements, each read
        once): of the list ending at element ``head``, those from ``missing(head)`` back (the caller has the
        ones after it; ``None``: all of them)."""
        found: dict[int, StoredCheckpoint] = {}
        read: dict[str, Element] = {}
        heads: set[str] = set()
        for row in rows:
            stored = found.get(row.id)
            if stored is None:
                stored = found[row.id] = StoredCheckpoint(
                    row.thread_id, row.checkpoint_ns, row.checkpoint_id, row.parent_id, row.body, read
                )
            if row.channel is not None:
                stored.channels[row.channel] = (row.blob, row.value)
                if row.value is None and (start := missing(row.blob)) is not None:
                    heads.add(start)
        for chunk in _chunks(sorted(heads)):
            for e in conn.execute(self._chains[shared], {"keys": chunk}):
                read[e.key] = Element(e.key, e.parent, e.type, e.crc, e.data)
        by_ids = {(c.thread_id, c.checkpoint_ns, c.checkpoint_id): c for c in found.values()}
        for w in self._writes_of(conn, set(by_ids)):
            if (target := by_ids.get((w.thread_id, w.checkpoint_ns, w.checkpoint_id))) is not None:
                target.writes.append((w.task_id, w.channel, w.body))
        return found

    def _writes_of(self, conn: Connection, targets: Collection[tuple[str, str, str]]) -> list[Row[Any]]:
        """The writes of the checkpoints ``targets`` names (and maybe others of their threads: filter them),
        in ``writes_sort_key`` order: task path, task id, index."""
        found: list[Row[Any]] = []
        threads = sorted({t for t, _, _ in targets})
        ids = sorted({c for _, _, c in targets})
        for thread_chunk in _chunks(threads):
            for id_chunk in _chunks(ids):
                found += conn.execute(self._writes, {"threads": thread_chunk, "ids": id_chunk}).all()
        return found

    def _parent_channels(self, conn: Connection, new: NewCheckpoint) -> dict[str, tuple[str, str]]:
        """The parent's channels: ``channel -> (version JSON, blob key)`` (none without a stored parent)."""
        if new.parent_id is None:
            return {}
        rows = conn.execute(
            select(channels.c.channel, channels.c.version, channels.c.blob)
            .select_from(channels.join(checkpoints, channels.c.checkpoint == checkpoints.c.id))
            .where(
                checkpoints.c.thread_id == new.thread_id,
                checkpoints.c.checkpoint_ns == new.checkpoint_ns,
                checkpoints.c.checkpoint_id == new.parent_id,
            )
        )
        return {row.channel: (row.version, row.blob) for row in rows}

    def _link(
        self,
        conn: Connection,
        chosen: dict[str, Value | str],
        serialize: Callable[[str], Value | None],
        new: NewCheckpoint,
    ) -> dict[str, str]:
        """Make sure each chosen value is stored (locked, or inserted); ``channel -> value key``."""
        present = self._lock(conn, _keys_of(chosen.values()))
        for channel, value in list(chosen.items()):
            if isinstance(value, str) and value not in present:  # deleted with the parent meanwhile: store it again
                again = serialize(channel)
                if again is None:
                    raise IntegrityError(
                        f"thread {new.thread_id!r} checkpoint {new.checkpoint_id}: channel {channel!r}'s value "
                        f"was deleted with the parent checkpoint {new.parent_id} while this one was stored"
                    )
                chosen[channel] = again
                present |= self._lock(conn, _keys_of([again]))
        values = [v for v in chosen.values() if not isinstance(v, str)]
        self._insert(
            conn,
            blobs,
            self._add_blob,
            {v.key: {"key": v.key, "body": v.body} for v in values if isinstance(v, Blob)},
            present,
        )
        self._insert(
            conn,
            elements,
            self._add_element,
            {e.key: vars(e) for v in values if isinstance(v, ListValue) for e in v.elements},
            present,
        )
        return {ch: v if isinstance(v, str) else v.key for ch, v in chosen.items()}

    def _insert(
        self, conn: Connection, table: Table, stmt: Any, rows: dict[str, dict[str, Any]], present: set[str]
    ) -> None:
        """Insert the ``rows`` (by key) of ``table`` not ``present`` (in key order), keeping their records."""
        missing = [rows[key] for key in sorted(rows.keys() - present)]
        if missing:
            conn.execute(stmt, missing)
        for row in missing:
            self._database.keep_row(conn, table, {"key": row["key"]})

    def _lock(self, conn: Connection, keys: Iterable[str], tables: Sequence[Table] = (blobs, elements)) -> set[str]:
        """Lock the rows of ``tables`` (blobs, elements) ``keys`` names for this transaction, in key order;
        the keys of those that exist."""
        present: set[str] = set()
        ordered = sorted(set(keys))
        for table in tables:
            for chunk in _chunks(ordered):
                present.update(
                    conn.execute(
                        select(table.c.key).where(table.c.key.in_(chunk)).order_by(table.c.key).with_for_update()
                    ).scalars()
                )
        return present

    def _collect(self, conn: Connection, candidates: set[str]) -> None:
        """Delete the blobs and elements among ``candidates`` that nothing names (see the module docstring); an
        element deleted makes its parent a candidate."""
        self._lock(conn, candidates)
        for chunk in _chunks(sorted(candidates)):
            gone = conn.execute(
                delete(blobs)
                .where(blobs.c.key.in_(chunk), ~exists().where(channels.c.blob == blobs.c.key))
                .returning(blobs.c.key)
            ).scalars()
            for key in list(gone):
                self._database.keep_row(conn, blobs, {"key": key})
        child = elements.alias("child")
        while candidates:
            parents: set[str] = set()
            for chunk in _chunks(sorted(candidates)):
                gone = conn.execute(
                    delete(elements)
                    .where(
                        elements.c.key.in_(chunk),
                        ~exists().where(channels.c.blob == elements.c.key),
                        ~exists().where(child.c.parent == elements.c.key),
                    )
                    .returning(elements.c.key, elements.c.parent)
                ).all()
                for key, parent in gone:
                    self._database.keep_row(conn, elements, {"key": key})
                    if parent is not None:
                        parents.add(parent)
            candidates = parents
            self._lock(conn, candidates, (elements,))


_WRITE_KEY = ("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx")


def _checkpoint_key(row: Any) -> dict[str, str]:
    return {"thread_id": row.thread_id, "checkpoint_ns": row.checkpoint_ns, "checkpoint_id": row.checkpoint_id}


def _keys_of(values: Iterable[Value | str]) -> set[str]:
    """The keys of the rows that ``values`` (values, or keys of stored ones) store: a list's are its elements'."""
    keys: set[str] = set()
    for value in values:
        if isinstance(value, ListValue):
            keys.update(e.key for e in value.elements)
        else:
            keys.add(value if isinstance(value, str) else value.key)
    return keys


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]


def everything_of(thread_ids: Sequence[str]) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    """The conditions on checkpoints and on writes that select every row of ``thread_ids``."""
    return checkpoints.c.thread_id.in_(thread_ids), writes.c.thread_id.in_(thread_ids)


def of_runs(run_ids: Sequence[str]) -> ColumnElement[bool]:
    """The checkpoints whose metadata names one of ``run_ids``."""
    return checkpoints.c.run_id.in_(run_ids)


def all_but_latest(thread_ids: Sequence[str]) -> ColumnElement[bool]:
    """The checkpoints of ``thread_ids`` but the newest of each namespace."""
    newer = checkpoints.alias("newer")
    return and_(
        checkpoints.c.thread_id.in_(thread_ids),
        exists().where(
            newer.c.thread_id == checkpoints.c.thread_id,
            newer.c.checkpoint_ns == checkpoints.c.checkpoint_ns,
            newer.c.checkpoint_id > checkpoints.c.checkpoint_id,
        ),
    )
