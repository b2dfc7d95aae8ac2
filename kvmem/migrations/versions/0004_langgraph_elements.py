"""The LangGraph checkpointer stores a list-valued channel element by element: ``kvmem_langgraph_elements``.

Each row is one element of a list (its serde type, its serialized bytes and their CRC32C) and names
the element before it (``parent``): a list is the chain from its last element back to its first, and
a channel row of ``kvmem_langgraph_channels`` names either a blob or the last element of such a chain.
A list that extends another (the ``messages`` of a thread's next checkpoint) shares its rows: each
element is stored once per distinct prefix, not once per checkpoint.

NOTE: a frozen copy of the table as this revision made it (see 0001). A table already there is left
alone.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Column, LargeBinary, MetaData, String, Table, Text

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

tables = MetaData()
Table(
    "kvmem_langgraph_elements",
    tables,
    Column("key", String(64), primary_key=True),
    Column("parent", String(64), nullable=True, index=True),
    Column("type", Text, nullable=False),
    Column("crc", BigInteger, nullable=False),
    Column("data", LargeBinary, nullable=False),
)


def upgrade() -> None:
    """Create the table where missing."""
    tables.create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    """Drop the table (the list values of every checkpoint stored since are lost)."""
    tables.drop_all(op.get_bind(), checkfirst=True)
