"""The catalog: one row per entry, in any SQLAlchemy database (SQLite by default).

The tiers hold the bytes; the catalog holds what is known about them (namespace,
kind, sizes, codec, CRC, version, hits) for ``ls``, ``stats``, ``verify`` and
``gc``. A load never waits on the catalog: hit counts are buffered in memory
and written in one transaction by :meth:`Catalog.flush`, which a timer thread
runs within ``flush_seconds`` of the first buffered update.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (JSON, BigInteger, Column, Float, Integer, MetaData, String, Table, bindparam, create_engine,
                        delete, event, func, select, update)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from kvmem.errors import ConfigError, TierUnavailable

__all__ = ["Catalog", "EntryRow", "create_tables"]

log = logging.getLogger(__name__)

metadata_obj = MetaData()
entries = Table(
    "kvmem_entries", metadata_obj,
    Column("key", String(64), primary_key=True),
    Column("namespace", String(256), nullable=False, default=""),
    Column("user_key", String(256), nullable=False, default=""),
    Column("kind", String(16), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("stored_size", BigInteger, nullable=False),
    Column("codec", String(32), nullable=False),
    Column("crc", BigInteger, nullable=False),
    Column("version", Integer, nullable=False, default=1),
    Column("tiers", String(128), nullable=False, default=""),
    Column("created", Float, nullable=False),
    Column("last_access", Float, nullable=False),
    Column("hits", BigInteger, nullable=False, default=0),
    Column("metadata", JSON, nullable=False, default=dict),
    Column("state", String(16), nullable=False, default="ok"),
)

_INSERTS = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}


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


_UPSERT_SET = ("namespace", "user_key", "kind", "size", "stored_size", "codec", "crc", "tiers", "metadata",
               "last_access", "state")


def create_tables(metadata: MetaData, engine: Engine, attempts: int = 3) -> None:
    """``metadata.create_all(engine)``, tolerating another process creating the same tables at once.

    NOTE: create_all checks, then creates; two processes opening a fresh database both
    see no table and one fails with "already exists" (a duplicate-type error on
    PostgreSQL). Trying again sees the other's tables and creates nothing.

    Raises:
        SQLAlchemyError: the database keeps failing (unreachable, read-only, ...).
    """
    for attempt in range(attempts):
        try:
            metadata.create_all(engine)
            return
        except SQLAlchemyError:
            if attempt == attempts - 1:
                raise


def _upsert_statement(insert: Any) -> Any:
    """``INSERT .. ON CONFLICT (key) DO UPDATE`` of a whole row, its values bound at execution.

    NOTE: built once per catalog. Building it per call with ``.values(...)`` cost
    ~0.6 ms of SQLAlchemy statement construction per store (measured: 0.7-1.0 ms
    vs 0.13 ms per upsert), more than the SQLite transaction itself.
    """
    stmt = insert(entries)
    return stmt.on_conflict_do_update(
        index_elements=[entries.c.key],
        set_={**{name: stmt.excluded[name] for name in _UPSERT_SET}, "version": entries.c.version + 1},
    ).returning(entries.c.version)


# NOTE: one prebuilt statement run as executemany: building an UPDATE per key cost
# ~0.4 ms each (measured: 256 buffered hits flushed in 85-125 ms, vs a few ms now).
_ADD_HITS = (update(entries).where(entries.c.key == bindparam("k"))
             .values(hits=entries.c.hits + bindparam("n"), last_access=bindparam("t")))


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


class Catalog:
    """Entry rows in the database at ``url``.

    Args:
        url: SQLAlchemy database URL.
        flush_seconds: write buffered hits and removals from a timer thread this long
            after the first one (``None``: only when :meth:`flush` is called).
        on_error: told of a database failure in that timer thread (default: logged).

    Raises:
        ConfigError: ``url`` is not a database URL SQLAlchemy knows.
        TierUnavailable: the database cannot be reached or its schema created.
    """

    def __init__(self, url: str, *, flush_seconds: float | None = None,
                 on_error: Callable[[SQLAlchemyError], None] | None = None) -> None:
        try:
            parsed = make_url(url)
        except ArgumentError:
            raise ConfigError(f"catalog_url={url!r}: expected a SQLAlchemy URL such as "
                              "'sqlite:///path/catalog.sqlite3' or 'postgresql+psycopg://host/db'") from None
        if parsed.get_backend_name() not in _INSERTS:
            raise ConfigError(f"catalog_url={url!r}: backend {parsed.get_backend_name()!r} is not supported; "
                              f"accepted {', '.join(_INSERTS)}")
        if parsed.get_backend_name() == "sqlite" and parsed.database:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        self.url = url
        self.engine: Engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._upsert = _upsert_statement(_INSERTS[self.engine.dialect.name])
        self._lock = threading.Lock()
        self._hits: dict[str, tuple[int, float]] = {}
        self._removed: set[str] = set()
        self._flush_seconds = flush_seconds
        self._on_error = on_error
        self._timer: threading.Timer | None = None
        self._closed = False
        try:
            create_tables(metadata_obj, self.engine)
        except SQLAlchemyError as exc:
            raise TierUnavailable(f"catalog {parsed.render_as_string(hide_password=True)} cannot be "
                                  f"reached: {exc.__class__.__name__}: {exc.orig if hasattr(exc, 'orig') else exc}"
                                  ) from None

    def upsert(self, key: str, *, namespace: str, user_key: str, kind: str, size: int, stored_size: int,
               codec: str, crc: int, tiers: list[str], metadata: dict[str, Any]) -> int:
        """Record a store of ``key``: a new row at version 1, or the next version of an existing one.

        Returns:
            The version now current.
        """
        now = time.time()
        row = dict(key=key, namespace=namespace, user_key=user_key[:256], kind=kind, size=size,
                   stored_size=stored_size, codec=codec, crc=crc, tiers=",".join(tiers), metadata=metadata,
                   last_access=now, state="ok", version=1, created=now, hits=0)
        with self._lock:
            self._removed.discard(key)
        with self.engine.begin() as conn:
            return int(conn.execute(self._upsert, row).scalar_one())

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
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Start the timer that writes buffered updates, unless one is pending (caller holds ``_lock``).

        NOTE: the caller (a load) only buffers; the database write happens on the
        timer thread. A timer inherited through ``fork`` is not alive, so a child
        process starts its own.
        """
        if self._flush_seconds is None or self._closed or (self._timer is not None and self._timer.is_alive()):
            return
        self._timer = threading.Timer(self._flush_seconds, self._timed_flush)
        self._timer.name = "kvmem-catalog-flush"
        self._timer.daemon = True
        self._timer.start()

    def _timed_flush(self) -> None:
        try:
            self.flush()
        except SQLAlchemyError as exc:
            if self._on_error is None:
                log.warning("kvmem: catalog flush failed (%s); buffered hits were dropped", exc)
            else:
                self._on_error(exc)
        finally:
            with self._lock:
                self._timer = None
                if self._hits or self._removed:
                    self._schedule_flush()  # buffered while this flush ran

    def flush(self) -> None:
        """Write buffered hits and removals in one transaction."""
        with self._lock:
            hits, self._hits = self._hits, {}
            removed, self._removed = self._removed, set()
        if not hits and not removed:
            return
        with self.engine.begin() as conn:
            if hits:
                conn.execute(_ADD_HITS, [{"k": key, "n": count, "t": when} for key, (count, when) in hits.items()])
            if removed:
                conn.execute(delete(entries).where(entries.c.key.in_(sorted(removed))))

    def delete(self, key: str) -> bool:
        """Remove the row of ``key``; whether there was one."""
        with self._lock:
            self._hits.pop(key, None)
        with self.engine.begin() as conn:
            return conn.execute(delete(entries).where(entries.c.key == key)).rowcount > 0

    def set_state(self, key: str, state: str) -> None:
        """Mark ``key`` (``ok`` or ``quarantined``)."""
        with self.engine.begin() as conn:
            conn.execute(update(entries).where(entries.c.key == key).values(state=state))

    def rows(self, namespace: str | None = None, limit: int | None = None,
             order: str = "last_access") -> list[EntryRow]:
        """Rows, most recently used first (or by ``order``: ``last_access``, ``hits``, ``size``)."""
        col = {"last_access": entries.c.last_access, "hits": entries.c.hits, "size": entries.c.size}.get(order)
        if col is None:
            raise ConfigError(f"order={order!r}: accepted last_access, hits, size")
        stmt = select(entries).order_by(col.desc())
        if namespace is not None:
            stmt = stmt.where(entries.c.namespace == namespace)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.engine.connect() as conn:
            return [EntryRow(**r) for r in conn.execute(stmt).mappings()]

    def keys(self) -> Iterator[str]:
        """Every key in the catalog."""
        with self.engine.connect() as conn:
            return iter([r[0] for r in conn.execute(select(entries.c.key))])

    def totals(self) -> dict[str, int]:
        """``entries``, and ``size``, ``stored_size`` and ``hits`` summed over all rows."""
        stmt = select(func.count(), func.coalesce(func.sum(entries.c.size), 0),
                      func.coalesce(func.sum(entries.c.stored_size), 0), func.coalesce(func.sum(entries.c.hits), 0))
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
        self.flush()
        self.engine.dispose()

