"""The catalog: one row per entry, in any SQLAlchemy database (SQLite by default).

The tiers hold the bytes; the catalog holds what is known about them (namespace,
kind, sizes, codec, CRC, version, hits) for ``ls``, ``stats``, ``verify`` and
``gc``. A load never waits on the catalog: hit counts are buffered in memory
and written in one transaction by :meth:`Catalog.flush`, which a timer thread
runs within ``flush_seconds`` of the first buffered update.

The same code serves SQLite (one machine) and PostgreSQL (a catalog shared by
several machines). Every write is one atomic statement per row (an upsert that
adds to ``version``, an ``UPDATE .. SET hits = hits + n``), so concurrent
writers never lose each other's updates and no global lock is taken. A write
that fails because the database cannot be reached is kept in memory and retried
by the timer thread until the database answers again (see :meth:`Catalog.upsert`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Table, bindparam, create_engine, delete, event, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError, SQLAlchemyError

from kvmem.catalog.journal import Journal
from kvmem.catalog.mirror import RowMirror
from kvmem.catalog.schema import entries
from kvmem.errors import ConfigError, SchemaError, TierUnavailable
from kvmem.migrations import upgrade_schema
from kvmem.recovery import OnRecovered, recover_sqlite
from kvmem.redaction import redact

__all__ = ["Catalog", "EntryRow", "StoreRow", "dialect_insert", "unreachable"]

log = logging.getLogger(__name__)

_INSERTS = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}
_LIVE: weakref.WeakSet[Catalog] = weakref.WeakSet()  # this process's catalogs, for flush_all
_MAX_PENDING = 100_000  # rows kept for a retry while the database is unreachable
_PG_CONNECT_TIMEOUT = 5  # seconds; libpq's default waits on the OS (minutes on a dropped route)


@dataclass(frozen=True)
class EntryRow:
    """One catalog row."""

    key: str
    namespace: str
    user_key: str
    kind: str
    size: int
    stored_size: int
    codec: str
    crc: int
    version: int
    tiers: str
    created: float
    last_access: float
    hits: int
    metadata: dict[str, Any]
    state: str


_UPSERT_SET = (
    "namespace",
    "user_key",
    "kind",
    "size",
    "stored_size",
    "codec",
    "crc",
    "tiers",
    "metadata",
    "last_access",
    "state",
)


def dialect_insert(dialect: str) -> Any:
    """The ``insert`` construct with ``on_conflict_do_update`` for ``dialect`` (``sqlite`` or ``postgresql``)."""
    return _INSERTS[dialect]


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database could not be reached (worth a retry), not that a write was wrong."""
    return isinstance(exc, (OperationalError, InterfaceError)) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    )


def _journaled(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` as the journal records them: a CRC not computed yet is recorded as 0 (unknown)."""
    return [row if not callable(row["crc"]) else {**row, "crc": 0} for row in rows]


def _resolved(crc: int | Callable[[], int | None]) -> int:
    """A row's CRC: given, or computed now by the function given (0 when it has none to give)."""
    return (crc() or 0) if callable(crc) else crc


def _upsert_statement(insert: Any, returning: bool = True) -> Any:
    """``INSERT .. ON CONFLICT (key) DO UPDATE`` of a whole row, its values bound at execution.

    NOTE: built once per catalog. Building it per call with ``.values(...)`` cost
    ~0.6 ms of SQLAlchemy statement construction per store (measured: 0.7-1.0 ms
    vs 0.13 ms per upsert), more than the SQLite transaction itself. Without
    ``returning`` it runs as one executemany for a whole flush.
    """
    stmt = insert(entries)
    stmt = stmt.on_conflict_do_update(
        index_elements=[entries.c.key],
        # NOTE: the row's ``version`` is the number of stores it records (1, or more replayed
        # after an outage): added in the same statement, so concurrent upserts never lose one
        set_={
            **{name: stmt.excluded[name] for name in _UPSERT_SET},
            "version": entries.c.version + stmt.excluded.version,
        },
    )
    return stmt.returning(entries.c.version) if returning else stmt


# NOTE: one prebuilt statement run as executemany: building an UPDATE per key cost
# ~0.4 ms each (measured: 256 buffered hits flushed in 85-125 ms, vs a few ms now).
_ADD_HITS = (
    update(entries)
    .where(entries.c.key == bindparam("k"))
    .values(hits=entries.c.hits + bindparam("n"), last_access=bindparam("t"))
)


def _pg_text(value: str) -> str:
    """``value`` storable as PostgreSQL text, which refuses NUL characters (written ``\\x00`` instead)."""
    return value.replace("\x00", "\\x00") if "\x00" in value else value


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def _parse_url(url: str) -> URL:
    """``url`` parsed by SQLAlchemy.

    Raises:
        ConfigError: ``url`` is not a SQLAlchemy URL, or its password holds an ``@`` that was not
            percent-encoded (SQLAlchemy would take the rest for the host and send it, password and all,
            to the driver, whose error would quote it).
    """
    try:
        parsed: URL | None = make_url(url)
    except (ArgumentError, ValueError):  # NOTE: a port that is not a number; its message may quote a password
        parsed = None
    if parsed is None or "@" in (parsed.host or ""):
        raise ConfigError(
            f"catalog_url={redact(url)!r}: cannot be parsed; expected a SQLAlchemy URL such as "
            "'sqlite:///path/catalog.sqlite3' or 'postgresql+psycopg://user@host/db' "
            "(percent-encode an @ in the password)"
        ) from None
    return parsed


class StoreRow(NamedTuple):
    """One store of an entry, as its catalog row records it (:meth:`Catalog.upsert`, :meth:`Catalog.upsert_later`).

    ``crc`` may be a function, called when the row is written (see :meth:`Catalog.upsert_later`).
    """

    key: str
    namespace: str
    user_key: str
    kind: str
    size: int
    stored_size: int
    codec: str
    crc: int | Callable[[], int | None]
    tiers: list[str]
    metadata: dict[str, Any]


class Catalog:
    """Entry rows in the database at ``url``.

    Args:
        url: SQLAlchemy database URL.
        flush_seconds: write buffered hits and removals from a timer thread this long
            after the first one (``None``: only when :meth:`flush` is called).
        on_error: told of a database failure in that timer thread (default: logged).
        journal: a directory where upserts the database missed are also kept on disk
            (:mod:`kvmem.catalog.journal`): a process killed during an outage loses none, the next
            catalog opened there replays them. ``None``: kept in memory only.
        on_recovered: told ``"catalog"`` when a damaged SQLite database was set aside before opening
            (a fresh one is created; see :mod:`kvmem.recovery`), ``"journal"`` for a damaged journal.

    A SQLite file database keeps the rows that exist nowhere else (agent sessions and steps,
    LangGraph items) also as records beside it (:mod:`kvmem.catalog.mirror`); when the database
    was set aside, or its file is missing or empty, its rows are restored from them here.

    Raises:
        ConfigError: ``url`` is not a database URL SQLAlchemy knows.
        TierUnavailable: the database cannot be reached or its schema created, or its row records
            (:mod:`kvmem.catalog.mirror`) cannot be written.
        SchemaError: the database's schema is newer than this kvmem's, or migrating it failed
            (:func:`kvmem.migrations.upgrade_schema`).
    """

    def __init__(
        self,
        url: str,
        *,
        flush_seconds: float | None = None,
        on_error: Callable[[SQLAlchemyError], None] | None = None,
        journal: Path | None = None,
        on_recovered: OnRecovered | None = None,
    ) -> None:
        parsed, shown = _parse_url(url), redact(url)
        if parsed.get_backend_name() not in _INSERTS:
            raise ConfigError(
                f"catalog_url={shown!r}: backend {parsed.get_backend_name()!r} is not supported; "
                f"accepted {', '.join(_INSERTS)}"
            )
        self.mirror, lost = RowMirror(None), False
        if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
            path = Path(parsed.database)
            path.parent.mkdir(parents=True, exist_ok=True)
            lost = recover_sqlite(path, on_recovered) or not path.exists() or path.stat().st_size == 0
            self.mirror = RowMirror.beside(path)
        self.url = url
        connect_args: dict[str, Any] = {}
        if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
            connect_args["connect_timeout"] = _PG_CONNECT_TIMEOUT
        try:
            self.engine: Engine = create_engine(url, pool_pre_ping=True, connect_args=connect_args)
        except (ArgumentError, ImportError) as exc:
            raise ConfigError(f"catalog_url={shown!r}: {exc} (PostgreSQL needs kvmem[postgres]: psycopg)") from None
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._upsert = _upsert_statement(_INSERTS[self.engine.dialect.name])
        self._upsert_rows = _upsert_statement(_INSERTS[self.engine.dialect.name], returning=False)
        self._text: Callable[[str], str] = _pg_text if self.engine.dialect.name == "postgresql" else str
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._hits: dict[str, tuple[int, float]] = {}
        self._removed: set[str] = set()
        self._pending: dict[str, dict[str, Any]] = {}  # upserts the database missed, replayed by flush
        self.dropped = 0  # pending writes given up (queue full, or refused by the database)
        self._flush_seconds = flush_seconds
        self._on_error = on_error
        self._timer: threading.Timer | None = None
        self._timer_pid = 0  # the process that started _timer
        self._closed = False
        try:
            upgrade_schema(self.engine)
            self.mirror.open(self.engine, lost)
        except (SchemaError, TierUnavailable):  # a schema from a newer kvmem; row records that cannot be written
            self.engine.dispose()
            raise
        except SQLAlchemyError as exc:
            self.engine.dispose()
            raise TierUnavailable(
                f"catalog {shown} cannot be "
                f"reached: {exc.__class__.__name__}: {exc.orig if hasattr(exc, 'orig') else exc}"
            ) from None
        self._journal = Journal(journal, on_recovered) if journal is not None else None
        _LIVE.add(self)
        if self._journal is not None:
            with self._lock:
                for row in self._journal.claim_orphans():  # stores of a process killed before its flush
                    self._queue(row)
                self._schedule_flush()

    # -- the Database port (kvmem.ports): the layers' tables beside the entry rows -----------------
    @property
    def dialect(self) -> str:
        """The SQLAlchemy dialect's name: ``sqlite`` or ``postgresql``."""
        return self.engine.dialect.name

    @property
    def shown_url(self) -> str:
        """The database's URL with any password masked: safe to log and put in an error."""
        return redact(self.url)

    def transaction(self) -> AbstractContextManager[Connection]:
        """A connection in a transaction, committed when the block ends (rolled back on an exception)."""
        return self.engine.begin()

    def connection(self) -> AbstractContextManager[Connection]:
        """A connection for reads, closed (its transaction rolled back) when the block ends."""
        return self.engine.connect()

    def insert(self, table: Table) -> sqlite.Insert | postgresql.Insert:
        """An ``INSERT`` into ``table`` in this dialect, which has ``on_conflict_do_update``."""
        return sqlite.insert(table) if self.dialect == "sqlite" else postgresql.insert(table)

    def keep_row(self, conn: Connection, table: Table, key: Mapping[str, object]) -> None:
        """Keep the row of ``table`` named by ``key`` recoverable outside the database, as ``conn`` sees it now
        (see :meth:`kvmem.catalog.mirror.RowMirror.sync`)."""
        self.mirror.sync(conn, table, key)

    # -- entry rows ------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Writes waiting for the database (it failed them as unreachable); retried by :meth:`flush`."""
        with self._lock:
            return len(self._pending) + len(self._removed)

    def upsert(self, store: StoreRow) -> int:
        """Record a store of ``key`` now: a new row at version 1, or the next version of an existing one.

        When the database cannot be reached, the row is kept (with the count of
        stores it stands for) and the error raised; the timer thread, or the next
        :meth:`flush`, writes it once the database answers, so the catalog catches up
        with every store made meanwhile, versions included.

        Returns:
            The version now current.
        """
        row = self._row(store)
        alone = dict(row)  # this store alone (version 1): what the journal records
        with self._lock:
            self._removed.discard(store.key)
            missed = self._pending.pop(store.key, None)
            if missed is not None:
                row["version"] += missed["version"]
                row["created"] = missed["created"]
                row["crc"] = _resolved(row["crc"])
        try:
            with self.engine.begin() as conn:
                return int(conn.execute(self._upsert, row).scalar_one())
        except SQLAlchemyError as exc:
            if unreachable(exc):
                with self._lock:
                    self._keep([row])
                    if self._journal is not None:
                        self._journal.append([alone])
                    self._schedule_flush()
            raise

    def upsert_later(self, store: StoreRow, *, durable: bool = True) -> None:
        """Record ``store`` at the next :meth:`flush` (within ``flush_seconds``): write-behind.

        Several stores of a key before a flush make one row write that adds all their
        versions. Its ``crc`` may be a function, called at the flush (a blob whose CRCs are
        computed when first needed: the flush computes them, off the caller's thread);
        ``None`` from it (the blob is gone already) records 0.

        NOTE: a store's row is written after the store returned: :meth:`flush` (which
        ``info``, ``stats``, ``entries`` and pins call first) makes it visible. Until then
        it is in the journal (one appended line, not fsynced): a process killed before the
        flush loses no row, the next catalog opened on the directory writes it. A row whose
        bytes die with the process (``durable=False``: only a memory tier holds them) is not
        journaled: after a crash it would name nothing.
        """
        row = self._row(store)
        with self._lock:
            self._removed.discard(store.key)
            # NOTE: a killed process loses no durable row: the next catalog replays it
            if durable and self._journal is not None:
                self._journal.append(_journaled([row]))
            self._queue(row)
            self._schedule_flush()

    def _queue(self, row: dict[str, Any]) -> None:
        """Queue ``row``, the newest store of its key: it adds the versions of a row queued before it
        (caller holds ``_lock``)."""
        older = self._pending.get(row["key"])
        if older is not None:
            row["version"] += older["version"]
            row["created"] = older["created"]
        elif len(self._pending) >= _MAX_PENDING:
            self.dropped += 1
            return
        self._pending[row["key"]] = row

    def _row(self, store: StoreRow) -> dict[str, Any]:
        """The row ``store`` writes (version 1)."""
        now = time.time()
        return {
            "key": store.key,
            "namespace": self._text(store.namespace),
            "user_key": self._text(store.user_key[:256]),
            "kind": store.kind,
            "size": store.size,
            "stored_size": store.stored_size,
            "codec": store.codec,
            "crc": store.crc,
            "tiers": ",".join(store.tiers),
            "metadata": store.metadata,
            "last_access": now,
            "state": "ok",
            "version": 1,
            "created": now,
            "hits": 0,
        }

    def _keep(self, rows: list[dict[str, Any]]) -> None:
        """Queue upserts for a retry, merged with newer ones of the same keys (caller holds ``_lock``)."""
        for row in rows:
            newer = self._pending.get(row["key"])
            if newer is not None:  # stored again while this one was being retried
                newer["version"] += row["version"]
                newer["created"] = min(newer["created"], row["created"])
            elif row["key"] not in self._removed:
                if len(self._pending) >= _MAX_PENDING:
                    self.dropped += 1
                    continue
                self._pending[row["key"]] = row

    def get(self, key: str) -> EntryRow | None:
        """The row of ``key``, or ``None``."""
        with self.engine.connect() as conn:
            row = conn.execute(select(entries).where(entries.c.key == key)).mappings().first()
        return EntryRow(**row) if row else None

    def record_hit(self, key: str) -> None:
        """Count a hit (buffered until :meth:`flush`)."""
        with self._lock:
            count, _ = self._hits.get(key, (0, 0.0))
            self._hits[key] = (count + 1, time.time())
            self._schedule_flush()

    def record_removed(self, key: str) -> None:
        """Note that ``key`` left every tier (row deleted at :meth:`flush`)."""
        with self._lock:
            self._removed.add(key)
            self._hits.pop(key, None)
            self._pending.pop(key, None)
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Start the timer that writes buffered updates, unless one is pending (caller holds ``_lock``).

        NOTE: the caller (a load) only buffers; the database write happens on the
        timer thread. A timer inherited through ``fork`` is not alive, so a child
        process starts its own.
        """
        # NOTE: the timer clears _timer when done; comparing pids (not is_alive(), ~1 us on every load) tells
        # an inherited one
        if self._flush_seconds is None or self._closed or (self._timer is not None and self._timer_pid == os.getpid()):
            return
        self._timer_pid = os.getpid()
        self._timer = threading.Timer(self._flush_seconds, self._timed_flush)
        self._timer.name = "kvmem-catalog-flush"
        self._timer.daemon = True
        self._timer.start()

    def _timed_flush(self) -> None:
        try:
            self.flush()
        except SQLAlchemyError as exc:
            if self._on_error is None:
                log.warning(
                    "kvmem: catalog flush failed (%s); %s",
                    exc,
                    "retrying" if unreachable(exc) else "buffered updates were dropped",
                )
            else:
                self._on_error(exc)
        finally:
            with self._lock:
                self._timer = None
                if self._hits or self._removed or self._pending:
                    self._schedule_flush()  # buffered while this flush ran, or kept for a retry

    def flush(self) -> None:
        """Write missed upserts, buffered hits and removals in one transaction.

        Raises:
            SQLAlchemyError: the database failed; when it could not be reached, everything is
                kept for the next flush, else (the database refused the writes) dropped.
        """
        # NOTE: one flush at a time: two flushes of one key's rows (the timer's, a pin's flush_all) in two
        # transactions could commit out of order, leaving the row with the total version but an older CRC
        with self._flushing:
            self._flush()

    def _flush(self) -> None:
        """:meth:`flush` (caller holds ``_flushing``)."""
        with self._lock:
            hits, self._hits = self._hits, {}
            removed, self._removed = self._removed, set()
            pending, self._pending = self._pending, {}
        if not hits and not removed and not pending:
            return
        for row in pending.values():  # outside the lock: a CRC computed here may take a while
            row["crc"] = _resolved(row["crc"])
        try:
            with self.engine.begin() as conn:
                # NOTE: rows in key order: two processes flushing overlapping keys lock them in
                # the same order, never into a deadlock (PostgreSQL locks each updated row)
                if pending:  # one executemany: a flush of thousands of stores holds the GIL for little
                    conn.execute(self._upsert_rows, [pending[key] for key in sorted(pending)])
                if hits:
                    conn.execute(_ADD_HITS, [{"k": key, "n": hits[key][0], "t": hits[key][1]} for key in sorted(hits)])
                if removed:
                    conn.execute(delete(entries).where(entries.c.key.in_(sorted(removed))))
            if pending and self._journal is not None:
                with self._lock:  # the database has them now; what is queued since stays journaled
                    self._journal.rewrite(_journaled(self._pending.values()))
        except SQLAlchemyError as exc:
            if not unreachable(exc):
                with self._lock:
                    self.dropped += len(pending) + len(removed)
                raise
            with self._lock:  # merged with what was buffered meanwhile, which is newer
                for key in removed:
                    if key not in self._pending:
                        self._removed.add(key)
                self._keep([pending[key] for key in sorted(pending)])
                for key, (count, when) in hits.items():
                    if key not in self._removed:
                        now_count, now_when = self._hits.get(key, (0, 0.0))
                        self._hits[key] = (count + now_count, max(when, now_when))
                if pending and self._journal is not None:  # NOTE: from now on a crash must not lose them
                    self._journal.rewrite(_journaled(self._pending.values()))
            raise

    def flush_all(self) -> None:
        """:meth:`flush` every open catalog of this process on this database (e.g. for a pin, which must
        see the rows other memories of this process queued).

        Raises:
            SQLAlchemyError: as :meth:`flush`.
        """
        for catalog in list(_LIVE):
            if catalog.url == self.url and not catalog._closed:
                catalog.flush()

    def delete(self, key: str) -> bool:
        """Remove the row of ``key``; whether there was one.

        When the database cannot be reached, the removal is kept for :meth:`flush`.
        """
        with self._lock:
            self._hits.pop(key, None)
            if self._pending.pop(key, None) is not None and self._journal is not None:
                self._journal.rewrite(_journaled(self._pending.values()))  # NOTE: never replayed after the delete
        try:
            with self.engine.begin() as conn:
                return conn.execute(delete(entries).where(entries.c.key == key)).rowcount > 0
        except SQLAlchemyError as exc:
            if unreachable(exc):
                self.record_removed(key)
            raise

    def replace_crcs(self, changes: list[tuple[str, int, int]]) -> None:
        """Record new blob CRCs: ``(key, old, new)`` each, applied only where the row still names ``old``
        (a blob rewritten in another format; a row a store changed meanwhile keeps its newer CRC)."""
        with self.engine.begin() as conn:
            conn.execute(
                update(entries)
                .where((entries.c.key == bindparam("k")) & (entries.c.crc == bindparam("old")))
                .values(crc=bindparam("new")),
                [{"k": k, "old": old, "new": new} for k, old, new in changes],
            )

    def set_state(self, key: str, state: str) -> None:
        """Mark ``key`` (``ok`` or ``quarantined``)."""
        with self.engine.begin() as conn:
            conn.execute(update(entries).where(entries.c.key == key).values(state=state))

    def rows(
        self, namespace: str | None = None, limit: int | None = None, order: str = "last_access"
    ) -> list[EntryRow]:
        """Rows, most recently used first (or by ``order``: ``last_access``, ``hits``, ``size``)."""
        col = {"last_access": entries.c.last_access, "hits": entries.c.hits, "size": entries.c.size}.get(order)
        if col is None:
            raise ConfigError(f"order={order!r}: accepted last_access, hits, size")
        stmt = select(entries).order_by(col.desc())
        if namespace is not None:
            stmt = stmt.where(entries.c.namespace == self._text(namespace))
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.engine.connect() as conn:
            return [EntryRow(**r) for r in conn.execute(stmt).mappings()]

    def keys(self, hottest_first: bool = False) -> Iterator[str]:
        """Every key in the catalog (with ``hottest_first``: by hits, most first)."""
        stmt = select(entries.c.key).order_by(entries.c.hits.desc()) if hottest_first else select(entries.c.key)
        with self.engine.connect() as conn:
            return iter([r[0] for r in conn.execute(stmt)])

    def totals(self) -> dict[str, int]:
        """``entries``, and ``size``, ``stored_size`` and ``hits`` summed over all rows."""
        stmt = select(
            func.count(),
            func.coalesce(func.sum(entries.c.size), 0),
            func.coalesce(func.sum(entries.c.stored_size), 0),
            func.coalesce(func.sum(entries.c.hits), 0),
        )
        with self.engine.connect() as conn:
            n, size, stored, hits = conn.execute(stmt).one()
        return {"entries": int(n), "size": int(size), "stored_size": int(stored), "hits": int(hits)}

    def close(self) -> None:
        """Stop the flush timer, flush buffered writes and release connections."""
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            timer.join()  # a flush already running finishes before the engine goes
        try:
            self.flush()
        finally:
            if self._journal is not None:
                self._journal.close()
            self.engine.dispose()
