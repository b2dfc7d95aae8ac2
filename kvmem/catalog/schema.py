"""The catalog database's tables, all of them, declared once.

Every table kvmem keeps in its catalog database (SQLite or PostgreSQL) is declared
here, in one ``MetaData``: the catalog's entry rows, pinned versions, agent chains,
the semantic side table, and the LangGraph store and checkpointer of ``langchain-kvmem``. Nothing
else creates or alters a table: :func:`kvmem.migrations.upgrade_schema` brings a
database to the newest revision when a :class:`~kvmem.catalog.catalog.Catalog` opens it.

NOTE: a change here needs a new revision in ``kvmem/migrations/versions/`` that makes
the same change to an existing database (``tests/catalog/test_schema.py`` checks that the
revisions, applied in order, build exactly these tables).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
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

__all__ = [
    "agent_sessions",
    "agent_steps",
    "entries",
    "langgraph_blobs",
    "langgraph_channels",
    "langgraph_checkpoints",
    "langgraph_elements",
    "langgraph_items",
    "langgraph_vectors",
    "langgraph_writes",
    "metadata",
    "pins",
    "semantic_rows",
    "versions",
]

metadata = MetaData()

# -- the catalog (kvmem.catalog.catalog) --------------------------------------------------------
entries = Table(
    "kvmem_entries",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("namespace", String(256), nullable=False, default=""),
    Column("user_key", String(256), nullable=False, default=""),
    Column("kind", String(16), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("stored_size", BigInteger, nullable=False),
    Column("codec", String(32), nullable=False),
    Column("crc", BigInteger, nullable=False),
    Column("version", Integer, nullable=False, default=1),
    Column("tiers", String(128), nullable=False, default=""),
    Column("created", Float, nullable=False),
    Column("last_access", Float, nullable=False),
    Column("hits", BigInteger, nullable=False, default=0),
    Column("metadata", JSON, nullable=False, default=dict),
    Column("state", String(16), nullable=False, default="ok"),
)

# -- pinned versions (kvmem.catalog.versions) ---------------------------------------------------
versions = Table(
    "kvmem_versions",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("crc", BigInteger, nullable=False),
    Column("created", Float, nullable=False),
    Column("body", LargeBinary, nullable=False),  # the blob, as the tiers held it (CRC-checked on read)
)
pins = Table(
    "kvmem_pins",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("key", String(64), nullable=False),
    Column("version", Integer, nullable=False),
    Column("holder", String(128), nullable=False),  # host:pid of the pinning process, for `kvmem` diagnostics
    Column("expires", Float, nullable=False),
    Index("kvmem_pins_version", "key", "version"),
)

# -- agent step chains (kvmem.agent.chain) ------------------------------------------------------
agent_sessions = Table(
    "kvmem_agent_sessions",
    metadata,
    Column("name", String(256), primary_key=True),
    Column("head", String(64), nullable=True),  # None for a session with no step yet
    Column("length", Integer, nullable=False),
    Column("system", Text, nullable=False),
    Column("updated", Float, nullable=False),
)
agent_steps = Table(
    "kvmem_agent_steps",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("parent", String(64), nullable=True, index=True),
    Column("body", LargeBinary, nullable=False),  # lz4 frame of the canonical JSON the key hashes
)

# -- the semantic side table (kvmem.semantic.layer) ---------------------------------------------
semantic_rows = Table(
    "kvmem_semantic",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("namespace", String(256), nullable=False, index=True),
    Column("embedder", String(256), nullable=False),
    Column("text", Text, nullable=False),
    Column("vector", LargeBinary, nullable=False),
    # the caller's key as given to Memory.store, in full (the catalog keeps a 256-character preview);
    # NULL for vectors indexed without one (add_vector: an image's embedding)
    Column("user_key", LargeBinary, nullable=True),
    Column("user_key_is_bytes", Boolean, nullable=True),
)

# -- the LangGraph store of langchain-kvmem (langchain_kvmem.store) -----------------------------
langgraph_items = Table(
    "kvmem_langgraph_items",
    metadata,
    Column("id", Integer, primary_key=True),  # creation order; never reused (AUTOINCREMENT / SERIAL)
    Column("namespace", Text, nullable=False),  # labels joined by "." (a label never holds one)
    Column("key", Text, nullable=False),
    Column("value", JSON, nullable=False),
    Column("created_at", Float, nullable=False),  # epoch seconds
    Column("updated_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True, index=True),  # expired when <= now
    Column("ttl_minutes", Float, nullable=True),
    UniqueConstraint("namespace", "key"),
    sqlite_autoincrement=True,
)
langgraph_vectors = Table(
    "kvmem_langgraph_vectors",
    metadata,
    Column("item_id", Integer, primary_key=True, autoincrement=False),
    Column("field", Text, primary_key=True),  # the index path, "path.i" when it yields several texts
    Column("vector", LargeBinary, nullable=False),  # float32, L2-normalized (all zeros for a zero vector)
)

# -- the LangGraph checkpointer of langchain-kvmem (langchain_kvmem.saver) ----------------------
langgraph_checkpoints = Table(
    "kvmem_langgraph_checkpoints",
    metadata,
    Column("id", Integer, primary_key=True),  # names the checkpoint's channel rows; never reused
    Column("thread_id", Text, nullable=False),
    Column("checkpoint_ns", Text, nullable=False),  # "" for the root graph, "node:task" for a subgraph
    Column("checkpoint_id", Text, nullable=False),  # LangGraph's uuid6: sorts as the checkpoints were made
    Column("parent_id", Text, nullable=True),  # the parent's checkpoint_id, same thread and namespace
    Column("run_id", Text, nullable=True, index=True),  # metadata["run_id"], for delete_for_runs
    Column("metadata", JSON, nullable=False),  # the JSON-able metadata, for list(filter=)
    Column("body", LargeBinary, nullable=False),  # kvmem blob: checkpoint without its values, and metadata
    UniqueConstraint("thread_id", "checkpoint_ns", "checkpoint_id"),
    sqlite_autoincrement=True,
)
langgraph_channels = Table(
    "kvmem_langgraph_channels",
    metadata,
    Column("checkpoint", Integer, primary_key=True, autoincrement=False),  # kvmem_langgraph_checkpoints.id
    Column("channel", Text, primary_key=True),
    Column("version", Text, nullable=False),  # JSON of the channel's version in that checkpoint
    # kvmem_langgraph_blobs.key, or kvmem_langgraph_elements.key: the last element of a list value
    Column("blob", String(64), nullable=False, index=True),
)
langgraph_blobs = Table(
    "kvmem_langgraph_blobs",
    metadata,
    Column("key", String(64), primary_key=True),  # content hash of the serialized value
    Column("body", LargeBinary, nullable=False),  # kvmem blob (CRC32C) of the serialized value
)
langgraph_writes = Table(
    "kvmem_langgraph_writes",
    metadata,
    # NOTE: named by the checkpoint's ids, not its row: LangGraph may save writes before their checkpoint
    Column("thread_id", Text, primary_key=True),
    Column("checkpoint_ns", Text, primary_key=True),
    Column("checkpoint_id", Text, primary_key=True),
    Column("task_id", Text, primary_key=True),
    Column("idx", Integer, primary_key=True, autoincrement=False),
    Column("channel", Text, nullable=False),
    Column("task_path", Text, nullable=False),
    Column("body", LargeBinary, nullable=False),  # kvmem blob (CRC32C) of the serialized value
)
langgraph_elements = Table(
    "kvmem_langgraph_elements",
    metadata,
    # sha256 over the parent's key, the type and the data: a list's chain of keys hashes all its elements
    Column("key", String(64), primary_key=True),
    Column("parent", String(64), nullable=True, index=True),  # the element before it; None: the first
    Column("type", Text, nullable=False),  # the serde's type of the element
    Column("crc", BigInteger, nullable=False),  # CRC32C of data
    Column("data", LargeBinary, nullable=False),  # the element as the serde serialized it
)
