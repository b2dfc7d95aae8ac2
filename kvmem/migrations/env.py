"""Alembic's environment for kvmem: migrations run on the connection :func:`kvmem.migrations.upgrade_schema` hands in.

The caller holds the schema lock and commits; nothing here opens a database or reads a URL.
"""

from __future__ import annotations

from alembic import context

from kvmem.catalog.schema import metadata
from kvmem.migrations import VERSION_TABLE

context.configure(
    connection=context.config.attributes["connection"],
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    render_as_batch=True,  # SQLite alters most columns by copying the table; batch mode does that
)
with context.begin_transaction():
    context.run_migrations()
