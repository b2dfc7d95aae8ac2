"""The catalog: entry rows (:mod:`~kvmem.catalog.catalog`), its outage journal, pinned versions,
the records it returns and the schema of every table of its database."""
