"""The semantic side table keeps the caller's key: ``kvmem_semantic.user_key`` and ``user_key_is_bytes``.

A :class:`~kvmem.semantic.Match` leads back to the key given to ``Memory.store`` in full
and of its type (the catalog keeps only a 256-character preview). Rows indexed before
this revision get NULL in both: they are read back as having no caller's key.

NOTE: a column already there is left alone: databases made by the development code
between these columns' arrival and this revision (create_all, no version table) have
them and are taken as revision 0001.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_COLUMNS = (
    sa.Column("user_key", sa.LargeBinary, nullable=True),
    sa.Column("user_key_is_bytes", sa.Boolean, nullable=True),
)


def upgrade() -> None:
    """Add the two nullable columns to ``kvmem_semantic`` where missing."""
    present = {column["name"] for column in sa.inspect(op.get_bind()).get_columns("kvmem_semantic")}
    for column in _COLUMNS:
        if column.name not in present:
            op.add_column("kvmem_semantic", column)


def downgrade() -> None:
    """Drop the two columns (the keys they kept are lost; matches then carry no caller's key)."""
    with op.batch_alter_table("kvmem_semantic") as batch:
        for column in _COLUMNS:
            batch.drop_column(column.name)
