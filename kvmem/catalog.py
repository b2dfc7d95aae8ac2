"""The catalog: one row per entry, in any SQLAlchemy database (SQLite by default).

The tiers hold the bytes; the catalog holds what is known about them (namespace,
kind, sizes, codec, CRC, version, hits) for ``ls``, ``stats``, ``verify`` and
``gc``. A load never waits on the catalog: hit counts are buffered in memory
and written in one transaction by :meth:`Catalog.flush`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (JSON, BigInteger, Column, Float, Integer, MetaData, String, Table, create_engine, delete,
                        event, func, select, update)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from kvmem.errors import ConfigError, TierUnavailable

__all__ = ["Catalog", "EntryRow"]

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


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


class Catalog:
    """Entry rows in the database at ``url``.

    Raises:
        ConfigError: ``url`` is not a database URL SQLAlchemy knows.
        TierUnavailable: the database cannot be reached or its schema created.
    """

    def __init__(self, url: str) -> None:
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
        self._insert = _INSERTS[self.engine.dialect.name]
        self._lock = threading.Lock()
        self._hits: dict[str, tuple[int, float]] = {}
        self._removed: set[str] = set()
        try:
            metadata_obj.create_all(self.engine)
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
        values = dict(namespace=namespace, user_key=user_key[:256], kind=kind, size=size,
                      stored_size=stored_size, codec=codec, crc=crc, tiers=",".join(tiers), metadata=metadata,
                      last_access=now, state="ok")
        stmt = self._insert(entries).values(key=key, version=1, created=now, hits=0, **values)
        stmt = stmt.on_conflict_do_update(index_elements=[entries.c.key],
                                          set_={**values, "version": entries.c.version + 1}
                                          ).returning(entries.c.version)
        with self._lock:
            self._removed.discard(key)
        with self.engine.begin() as conn:
            return int(conn.execute(stmt).scalar_one())

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

    def record_removed(self, key: str) -> None:
        """Note that ``key`` left every tier (row deleted at :meth:`flush`)."""
        with self._lock:
            self._removed.add(key)
            self._hits.pop(key, None)

    def flush(self) -> None:
        """Write buffered hits and removals in one transaction."""
        with self._lock:
            hits, self._hits = self._hits, {}
            removed, self._removed = self._removed, set()
        if not hits and not removed:
            return
        with self.engine.begin() as conn:
            for key, (count, when) in hits.items():
                conn.execute(update(entries).where(entries.c.key == key)
                             .values(hits=entries.c.hits + count, last_access=when))
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
        """``entries``, ``size`` and ``stored_size`` summed over all rows."""
        stmt = select(func.count(), func.coalesce(func.sum(entries.c.size), 0),
                      func.coalesce(func.sum(entries.c.stored_size), 0))
        with self.engine.connect() as conn:
            n, size, stored = conn.execute(stmt).one()
        return {"entries": int(n), "size": int(size), "stored_size": int(stored)}

    def close(self) -> None:
        """Flush buffered writes and release connections."""
        self.flush()
        self.engine.dispose()

