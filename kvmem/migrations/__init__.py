"""The catalog database's schema history: Alembic revisions, applied when a catalog opens.

:func:`upgrade_schema` brings a database to the newest revision of :mod:`kvmem.catalog.schema`
and records it in ``kvmem_schema_version`` (Alembic's version table, named so that an
application's own Alembic history in the same database is left alone). A catalog made
before the schema had a version (kvmem 0.1.0) is taken as revision 0001, its missing
tables created and its rows kept.

Locking: the check and every migration run in one transaction that first takes the
schema lock: ``pg_advisory_xact_lock`` on PostgreSQL (the key kvmem 0.1.0 took to create
tables), ``BEGIN IMMEDIATE`` (the database's write lock) on SQLite. Processes opening one
database at once wait for each other; the first migrates, the others find it done. DDL is
transactional on both, so a migration that fails leaves the database at its old revision.
Within a process, one thread migrates at a time (Alembic keeps its context in globals).
"""

from __future__ import annotations

import functools
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import func, inspect, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from kvmem.errors import SchemaError
from kvmem.redaction import redact

if TYPE_CHECKING:  # Alembic loads only when a database must migrate: its import costs ~0.35 s
    from alembic.script import ScriptDirectory

__all__ = ["HEAD", "SCRIPTS", "VERSION_TABLE", "schema_revision", "upgrade_schema"]

SCRIPTS = Path(__file__).parent  # env.py and versions/: the revisions shipped with this kvmem
VERSION_TABLE = "kvmem_schema_version"
HEAD = "0004"
"""The newest revision under ``versions/`` (tests/catalog/test_schema.py holds the two equal): a catalog
already there opens without loading Alembic."""
# NOTE: one fixed key for pg_advisory_xact_lock, shared by every kvmem process (0.1.0's key too)
_SCHEMA_LOCK = zlib.crc32(b"kvmem/schema")
# NOTE: Alembic's ``context`` and ``op`` are module globals: one migration at a time per process
_IN_PROCESS = threading.Lock()


def schema_revision(conn: Connection) -> str | None:
    """The revision the database of ``conn`` records (``None``: no version table, made by 0.1.0 or empty)."""
    if not inspect(conn).has_table(VERSION_TABLE):
        return None
    return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def upgrade_schema(engine: Engine, attempts: int = 3) -> str:
    """Bring the database of ``engine`` to the newest revision under the schema lock; that revision.

    Cheap when there is nothing to do: one read of the version table, no lock.

    Args:
        engine: the catalog's engine.
        attempts: tries on SQLite, which refuses a connection at once, without waiting, while
            another switches a fresh database to WAL (the catalog's connect pragma).

    Raises:
        SchemaError: the database records a revision this kvmem does not know (made by a
            newer kvmem), or a migration failed (the database is left at its old revision).
        SQLAlchemyError: the database cannot be reached.
    """
    for attempt in range(attempts):
        try:
            return _upgrade(engine)
        except OperationalError:
            if engine.dialect.name != "sqlite" or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def _upgrade(engine: Engine) -> str:
    with engine.connect() as conn:
        if schema_revision(conn) == HEAD:
            return HEAD
    head = _head()
    with _IN_PROCESS, engine.connect() as conn:
        _lock(conn)
        found = schema_revision(conn)
        _check_known(engine, found)
        if found != head:
            _migrate(engine, conn, found, head)
        conn.commit()
    return head


@functools.cache
def _scripts(location: Path) -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(location))


def _head() -> str:
    """The newest revision shipped with this kvmem."""
    head = _scripts(SCRIPTS).get_current_head()
    if head is None:  # only an install that lost versions/ has none
        raise SchemaError(
            f"no schema revision under {SCRIPTS}/versions: this kvmem install is incomplete; reinstall kvmem"
        )
    return head


def _lock(conn: Connection) -> None:
    """Take the schema lock, held until ``conn``'s transaction ends."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(_SCHEMA_LOCK)))
    else:  # NOTE: pysqlite begins no transaction before DDL: begin one that holds the write lock
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _check_known(engine: Engine, found: str | None) -> None:
    """Raise :class:`SchemaError` if ``found`` is not a revision of this kvmem's history."""
    from alembic.util import CommandError

    try:
        if found is None or _scripts(SCRIPTS).get_revision(found) is not None:
            return
    except CommandError:
        pass
    raise SchemaError(
        f"catalog {_shown(engine)} is at schema revision {found!r}, which this kvmem does not know "
        f"(it knows {_scripts(SCRIPTS).get_current_head()!r} and older): a newer kvmem migrated it; "
        "upgrade kvmem to open it"
    )


def _migrate(engine: Engine, conn: Connection, found: str | None, head: str) -> None:
    """Run the revisions after ``found`` up to ``head`` on ``conn`` (in its transaction, not committed)."""
    from alembic import command
    from alembic.config import Config
    from alembic.util import CommandError

    config = Config()
    config.set_main_option("script_location", str(SCRIPTS).replace("%", "%%"))
    config.attributes["connection"] = conn
    try:
        command.upgrade(config, head)
    except (SQLAlchemyError, CommandError) as exc:
        conn.rollback()
        raise SchemaError(
            f"catalog {_shown(engine)}: migrating its schema from revision {found!r} to {head!r} "
            f"failed, nothing changed: {exc.__class__.__name__}: {getattr(exc, 'orig', exc)}"
        ) from None


def _shown(engine: Engine) -> str:
    return redact(engine.url.render_as_string(hide_password=False))
