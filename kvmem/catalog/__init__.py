"""The catalog: entry rows (:mod:`~kvmem.catalog.catalog`), its outage journal, pinned versions,
the records it returns and the schema of every table of its database.

The names below are the old ``kvmem.catalog`` module's, kept for one release; they go in the
next one. Import from :mod:`kvmem.catalog.catalog` instead.
"""

from kvmem.catalog.catalog import Catalog, EntryRow, StoreRow, dialect_insert, unreachable

__all__ = ["Catalog", "EntryRow", "StoreRow", "dialect_insert", "unreachable"]
