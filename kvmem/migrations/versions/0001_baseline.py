"""Baseline: the eight tables as kvmem 0.1.0 made them, before the schema had a version.

kvmem 0.1.0 created each table with ``create_all`` when first used, so a catalog it
made holds any subset of them. This revision creates the ones missing and leaves
the others, and their rows, as they are; the database is then at revision 0001.

NOTE: a frozen copy of the 0.1.0 tables, not an import of :mod:`kvmem.catalog.schema`: that
module moves on with later revisions, and this one must build the tables they start
from. Never edit it; change the schema with a new revision.

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

tables = MetaData()  # also read by tests, to build a 0.1.0 catalog on PostgreSQL
Table(
    "kvmem_entries",
    tables,
    Column("key", String(64), primary_key=True),
    Column("namespace", String(256), nullable=False),
    Column("user_key", String(256), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("stored_size", BigInteger, nullable=False),
    Column("codec", String(32), nullable=False),
    Column("crc", BigInteger, nullable=False),
    Column("version", Integer, nullable=False),
    Column("tiers", String(128), nullable=False),
    Column("created", Float, nullable=False),
    Column("last_access", Float, nullable=False),
    Column("hits", BigInteger, nullable=False),
    Column("metadata", JSON, nullable=False),
    Column("state", String(16), nullable=False),
)
Table(
    "kvmem_versions",
    tables,
    Column("key", String(64), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("crc", BigInteger, nullable=False),
    Column("created", Float, nullable=False),
    Column("body", LargeBinary, nullable=False),
)
Table(
    "kvmem_pins",
    tables,
    Column("id", String(32), primary_key=True),
    Column("key", String(64), nullable=False),
    Column("version", Integer, nullable=False),
    Column("holder", String(128), nullable=False),
    Column("expires", Float, nullable=False),
    Index("kvmem_pins_version", "key", "version"),
)
Table(
    "kvmem_agent_sessions",
    tables,
    Column("name", String(256), primary_key=True),
    Column("head", String(64), nullable=True),
    Column("length", Integer, nullable=False),
    Column("system", Text, nullable=False),
    Column("updated", Float, nullable=False),
)
Table(
    "kvmem_agent_steps",
    tables,
    Column("key", String(64), primary_key=True),
    Column("parent", String(64), nullable=True, index=True),
    Column("body", LargeBinary, nullable=False),
)
Table(
    "kvmem_semantic",
    tables,
    Column("key", String(64), primary_key=True),
    Column("namespace", String(256), nullable=False, index=True),
    Column("embedder", String(256), nullable=False),
    Column("text", Text, nullable=False),
    Column("vector", LargeBinary, nullable=False),
)
Table(
    "kvmem_langgraph_items",
    tables,
    Column("id", Integer, primary_key=True),
    Column("namespace", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("value", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True, index=True),
    Column("ttl_minutes", Float, nullable=True),
    UniqueConstraint("namespace", "key"),
    sqlite_autoincrement=True,
)
Table(
    "kvmem_langgraph_vectors",
    tables,
    Column("item_id", Integer, primary_key=True, autoincrement=False),
    Column("field", Text, primary_key=True),
    Column("vector", LargeBinary, nullable=False),
)


def upgrade() -> None:
    """Create the tables a 0.1.0 catalog lacks (``checkfirst``: existing ones are kept with their rows)."""
    tables.create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    """Not supported: dropping the baseline would drop every row."""
    raise NotImplementedError("kvmem's baseline schema (revision 0001) cannot be downgraded")
