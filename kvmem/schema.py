"""Old import path of :mod:`kvmem.catalog.schema`, kept for one release; it goes in the next one.

Import from ``kvmem.catalog.schema`` instead.
"""

from kvmem.catalog.schema import (
    agent_sessions,
    agent_steps,
    entries,
    langgraph_items,
    langgraph_vectors,
    metadata,
    pins,
    semantic_rows,
    versions,
)

__all__ = [
    "agent_sessions",
    "agent_steps",
    "entries",
    "langgraph_items",
    "langgraph_vectors",
    "metadata",
    "pins",
    "semantic_rows",
    "versions",
]
