"""The LangGraph checkpointer's four tables: checkpoints, their channel rows, value blobs, pending writes.

``langchain_kvmem.KVMemSaver`` keeps a thread's index in ``kvmem_langgraph_checkpoints`` and
``kvmem_langgraph_channels`` (which blob holds each channel's value in each checkpoint), the
values once each in ``kvmem_langgraph_blobs`` (by content hash), and the writes of the tasks of
a step in ``kvmem_langgraph_writes``.

NOTE: a frozen copy of the tables as this revision made them, not an import of
:mod:`kvmem.catalog.schema` (see 0001). A table already there is left alone.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import JSON, Column, Integer, LargeBinary, MetaData, String, Table, Text, UniqueConstraint

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

tables = MetaData()
Table(
    "kvmem_langgraph_checkpoints",
    tables,
    Column("id", Integer, primary_key=True),
    Column("thread_id", Text, nullable=False),
    Column("checkpoint_ns", Text, nullable=False),
    Column("checkpoint_id", Text, nullable=False),
    Column("parent_id", Text, nullable=True),
    Column("run_id", Text, nullable=True, index=True),
    Column("metadata", JSON, nullable=False),
    Column("body", LargeBinary, nullable=False),
    UniqueConstraint("thread_id", "checkpoint_ns", "checkpoint_id"),
    sqlite_autoincrement=True,
)
Table(
    "kvmem_langgraph_channels",
    tables,
    Column("checkpoint", Integer, primary_key=True, autoincrement=False),
    Column("channel", Text, primary_key=True),
    Column("version", Text, nullable=False),
    Column("blob", String(64), nullable=False, index=True),
)
Table(
    "kvmem_langgraph_blobs",
    tables,
    Column("key", String(64), primary_key=True),
    Column("body", LargeBinary, nullable=False),
)
Table(
    "kvmem_langgraph_writes",
    tables,
    Column("thread_id", Text, primary_key=True),
    Column("checkpoint_ns", Text, primary_key=True),
    Column("checkpoint_id", Text, primary_key=True),
    Column("task_id", Text, primary_key=True),
    Column("idx", Integer, primary_key=True, autoincrement=False),
    Column("channel", Text, nullable=False),
    Column("task_path", Text, nullable=False),
    Column("body", LargeBinary, nullable=False),
)


def upgrade() -> None:
    """Create the four tables where missing."""
    tables.create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    """Drop the four tables (every checkpoint they hold is lost)."""
    tables.drop_all(op.get_bind(), checkfirst=True)
