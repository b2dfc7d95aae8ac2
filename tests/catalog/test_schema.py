"""The catalog database's schema: one declaration, Alembic revisions applied at open, on SQLite and PostgreSQL.

"A catalog made by the current release" is ``tests/data/catalog-0.1.0.sqlite3``, written by kvmem
0.1.0 at 6045537 (before the schema had a version: two stores of ``alpha``, ``beta`` in namespace
``ns`` with metadata and one hit, ``gamma`` with its text indexed in ``docs``, a pin released, agent
session ``s1`` with one step). On PostgreSQL its tables are made as 0.1.0 made them (``create_all`` of
the baseline's frozen tables) and its rows copied in.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.engine import make_url

import kvmem.migrations
from kvmem import Memory, migrations
from kvmem.agent import AgentSession
from kvmem.catalog.catalog import Catalog
from kvmem.catalog.schema import entries, metadata, semantic_rows
from kvmem.errors import SchemaError
from kvmem.migrations import SCRIPTS, VERSION_TABLE, schema_revision
from tests.servers import scratch_database

RELEASE = Path(__file__).parent / "data" / "catalog-0.1.0.sqlite3"
HEAD = ScriptDirectory(str(SCRIPTS)).get_current_head()
SMALL = {"cpu_bytes": "16MiB", "disk_bytes": "64MiB", "fsync": "never"}
ADD_TENANT = """
import sqlalchemy as sa
from alembic import op

revision = "tenant"
down_revision = "{head}"


def upgrade() -> None:
    op.add_column("kvmem_entries", sa.Column("tenant", sa.String(64), nullable=False, server_default=""))
    {then}
"""


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty catalog database: a SQLite file, or a fresh PostgreSQL database (with a password no one checks)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.sqlite3'}"
        return
    with scratch_database(request.getfixturevalue("postgres_url")) as pg:
        yield make_url(pg).set(password="s3cret-pw").render_as_string(hide_password=False)


def release_catalog(url: str) -> None:
    """Make the database at ``url`` the 0.1.0 catalog (see the module docstring)."""
    if url.startswith("sqlite"):
        shutil.copy(RELEASE, make_url(url).database)
        return
    baseline = ScriptDirectory(str(SCRIPTS)).get_revision("0001").module.tables
    source, target = create_engine(f"sqlite:///{RELEASE}"), create_engine(url)
    with source.connect() as src, target.begin() as dst:
        for table in baseline.sorted_tables:
            if inspect(src).has_table(table.name):
                table.create(dst)
                rows = src.execute(select(table)).mappings().all()
                if rows:
                    dst.execute(table.insert(), [dict(row) for row in rows])
    source.dispose()
    target.dispose()


def with_revision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str = "pass") -> None:
    """Make kvmem migrate with its own revisions plus ``tenant``: adds ``kvmem_entries.tenant``, runs ``then``."""
    scripts = tmp_path / "migrations"
    shutil.copytree(SCRIPTS, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / "9999_tenant.py").write_text(ADD_TENANT.format(head=HEAD, then=then))
    monkeypatch.setattr(kvmem.migrations, "SCRIPTS", scripts)
    monkeypatch.setattr(kvmem.migrations, "HEAD", "tenant")  # what that newer release would declare


def revision_and_columns(url: str) -> tuple[str | None, list[str]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        found = schema_revision(conn), [c["name"] for c in inspect(conn).get_columns("kvmem_entries")]
    engine.dispose()
    return found


def assert_release_rows_kept(mem: Memory) -> None:
    alpha, beta = mem.info("alpha"), mem.info("beta", namespace="ns")
    assert alpha is not None and alpha.version == 2 and alpha.kind == "tensor"
    assert beta is not None and beta.version == 1 and beta.hits == 1 and beta.metadata == {"who": "release-0.1.0"}
    assert [s.thought for s in AgentSession.resume("s1", memory=mem).steps] == ["think"]


def test_the_declared_head_is_the_newest_revision_shipped() -> None:
    """A catalog at ``migrations.HEAD`` opens without loading Alembic: it must name the real head."""
    assert migrations.HEAD == HEAD


def test_a_fresh_catalog_is_built_by_the_revisions_to_exactly_the_declared_schema(url: str) -> None:
    Catalog(url).close()
    engine = create_engine(url)
    with engine.connect() as conn:
        assert schema_revision(conn) == HEAD
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        assert compare_metadata(context, metadata) == []
    engine.dispose()


def test_a_release_catalog_is_migrated_to_the_head_and_keeps_its_rows(url: str, tmp_path: Path) -> None:
    release_catalog(url)
    assert revision_and_columns(url)[0] is None
    with Memory(str(tmp_path / "mem"), catalog_url=url, **SMALL) as mem:
        assert_release_rows_kept(mem)
        mem.store("delta", b"new")
        assert mem.info("delta").version == 1
    assert revision_and_columns(url)[0] == HEAD == "0004"
    engine = create_engine(url)
    assert set(metadata.tables) <= set(inspect(engine).get_table_names())
    with engine.connect() as conn:  # 0002: the semantic row indexed by 0.1.0 is kept, with no caller's key
        rows = conn.execute(select(semantic_rows)).mappings().all()
    engine.dispose()
    assert [(r["namespace"], r["text"], len(r["vector"]), r["user_key"], r["user_key_is_bytes"]) for r in rows] == [
        ("docs", "what is the answer", 1536, None, None)
    ]


def test_a_release_catalog_opens_after_a_revision_adds_a_column(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release_catalog(url)
    with_revision(tmp_path, monkeypatch)
    with Memory(str(tmp_path / "mem"), catalog_url=url, **SMALL) as mem:
        assert_release_rows_kept(mem)
        mem.store("alpha", torch.zeros(3))  # the upsert leaves the new column to its default
        assert mem.info("alpha").version == 3
    found, columns = revision_and_columns(url)
    assert found == "tenant" and "tenant" in columns
    engine = create_engine(url)
    with engine.connect() as conn:
        assert set(conn.execute(text("SELECT tenant FROM kvmem_entries")).scalars()) == {""}
        assert conn.execute(select(entries.c.user_key).order_by(entries.c.user_key)).scalars().all() == [
            "alpha",
            "beta",
            "gamma",
        ]
    engine.dispose()
    Catalog(url).close()  # at the newest revision already: opens without migrating
    assert revision_and_columns(url)[0] == "tenant"


def test_a_failed_migration_leaves_the_database_as_it_was(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release_catalog(url)
    Catalog(url).close()
    with_revision(tmp_path, monkeypatch, then='op.execute("SELECT no_such_column FROM kvmem_entries")')
    with pytest.raises(SchemaError, match=f"from revision '{HEAD}' to 'tenant' failed, nothing changed") as err:
        Catalog(url)
    assert "s3cret-pw" not in str(err.value)
    assert revision_and_columns(url) == (HEAD, [c.name for c in entries.columns])
    monkeypatch.undo()
    with Memory(str(tmp_path / "mem"), catalog_url=url, **SMALL) as mem:
        assert_release_rows_kept(mem)


def test_a_catalog_migrated_by_a_newer_kvmem_is_refused_untouched(url: str) -> None:
    Catalog(url).close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
    with pytest.raises(SchemaError, match="schema revision '9999', which this kvmem does not know") as err:
        Catalog(url)
    assert "s3cret-pw" not in str(err.value) and "upgrade kvmem" in str(err.value)
    with engine.connect() as conn:
        assert schema_revision(conn) == "9999"
    engine.dispose()


def open_at_once(urls: list[str]) -> list[BaseException]:
    """Open and close a catalog on each of ``urls``, each from a thread of its own, all at once; the errors."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(urls))

    def open_catalog(url: str) -> None:
        try:
            barrier.wait()
            Catalog(url).close()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=open_catalog, args=(url,)) for url in urls]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors


def test_catalogs_opening_one_fresh_database_at_once_migrate_it_once(url: str) -> None:
    assert open_at_once([url] * 4) == []
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all() == [HEAD]
    engine.dispose()


def test_one_process_migrates_several_databases_at_once(tmp_path: Path) -> None:
    urls = [f"sqlite:///{tmp_path / f'catalog{i}.sqlite3'}" for i in range(4)]
    assert open_at_once(urls) == []
    assert [revision_and_columns(url)[0] for url in urls] == [HEAD] * 4
