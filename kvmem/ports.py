"""The narrow ports the feature layers get from a :class:`~kvmem.api.Memory`.

The layers above the core (``kvmem.kv``, ``kvmem.agent``, ``kvmem.multimodal``,
``kvmem.semantic``, ``langchain-kvmem``) never reach a memory's tiers or catalog:
what they need beyond ``Memory``'s public operations is one of these.

- :class:`ChunkStore` (``Memory.chunk_store()``): stored blobs located, opened and
  read in part by storage key, for the KV loader. Every tier operation goes through
  the tiered store's failure handling (counted in ``kvmem_tier_errors_total``, the
  tier skipped for ``tier_retry_seconds``), as ``Memory.load``'s do: there is no
  second read path around it.
- :class:`Database` (``Memory.database``): the catalog's database for the tables
  the layers keep beside the entry rows (agent steps, semantic vectors, LangGraph
  items), read and written in transactions. The entry rows are the catalog's alone.
- :class:`PagedBuffer` and :class:`BlockTable` (:mod:`kvmem.stores.paged`): the page
  pool the GPU tier keeps its blobs in, for a layer that pages KV of its own (live offload).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from typing import Protocol

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from kvmem.errors import ConfigError
from kvmem.stores.base import StorageTier
from kvmem.stores.paged import BlockTable, PagedBuffer
from kvmem.stores.readers import BlobReader
from kvmem.stores.tiered import TieredStore

__all__ = ["BlobReader", "BlockTable", "ChunkStore", "Database", "PagedBuffer"]


class ChunkStore:
    """A memory's tiers as the KV layers read them: by storage key, tiers named by their ``name``.

    Args:
        tiers: the memory's tiered store, whose failure handling every operation goes through.
    """

    def __init__(self, tiers: TieredStore) -> None:
        self._store = tiers
        self._by_name = {t.name: t for t in tiers.tiers}

    @property
    def top(self) -> str | None:
        """The name of the fastest tier (``None`` with no tier)."""
        return self._store.tiers[0].name if self._store.tiers else None

    def locate(self, skey: str) -> str | None:
        """The name of the fastest usable tier holding ``skey`` (no CRC check), or ``None``."""
        tier = self._store.locate(skey)
        return None if tier is None else tier.name

    def open_blob(self, skey: str, tier: str) -> BlobReader | None:
        """``skey``'s blob in tier ``tier`` (as :meth:`locate` found it), opened for partial reads.

        A read from the reader raises :class:`~kvmem.errors.TierUnavailable` when the tier fails
        (counted, the tier backed off) or is being skipped.

        Returns:
            The reader, or ``None``: ``tier`` does not hold ``skey``, failed to open it, or is skipped.

        Raises:
            IntegrityError: the blob's header is not intact (quarantine it with :meth:`quarantine`).
            ConfigError: no tier is named ``tier``.
        """
        return self._store.open_blob(skey, self._tier(tier))

    def advise(self, skey: str, tier: str, lo: int, hi: int) -> None:
        """A hint to tier ``tier``: bytes ``[lo, hi)`` of ``skey``'s blob will be read soon.

        Raises:
            ConfigError: no tier is named ``tier``.
        """
        self._store.advise(skey, self._tier(tier), lo, hi)

    def quarantine(self, skey: str, tier: str, reason: Exception) -> None:
        """Take the copy of ``skey`` that tier ``tier`` served out of service (it failed a check), with
        the copies above it; counted as an integrity failure of ``tier``."""
        self._store.quarantine(skey, self._tier(tier).name, reason)

    def warm(self, skey: str) -> bool:
        """Make sure ``skey`` sits in the top tier (promoted from below, CRC-checked); whether it exists."""
        return self._store.warm(skey)

    def release(self, skey: str) -> bool:
        """Drop the memory tiers' copies of ``skey`` that a persistent tier holds too (a cache above kvmem holds
        it now); whether one was dropped."""
        return self._store.release(skey)

    def speculate(self, skey: str, keep: Collection[str] = ()) -> tuple[str, int]:
        """Copy ``skey`` into the last memory tier on a guess, only into room no entry uses (no entry is evicted
        for it; it is dropped first when a put needs the room, or when a newer guess does and it is not in
        that guess's ``keep``).

        Returns:
            ``(outcome, bytes copied)``: ``warmed``, ``resident`` (a memory tier holds it), ``no_room`` or
            ``missing`` (not stored below).
        """
        return self._store.speculate(skey, keep)

    def _tier(self, name: str) -> StorageTier:
        tier = self._by_name.get(name)
        if tier is None:
            raise ConfigError(f"tier {name!r}: this memory's tiers are {', '.join(self._by_name) or 'none'}")
        return tier


class Database(Protocol):
    """The catalog's database as the feature layers use it, for tables of their own (see the module docstring).

    A layer's errors from the database are SQLAlchemy's, raised from these
    connections; the layer decides what an outage means for its own tables.
    """

    @property
    def dialect(self) -> str:
        """The SQLAlchemy dialect's name: ``sqlite`` or ``postgresql``."""
        ...

    @property
    def shown_url(self) -> str:
        """The database's URL with any password masked: safe to log and put in an error."""
        ...

    def transaction(self) -> AbstractContextManager[Connection]:
        """A connection in a transaction, committed when the block ends (rolled back on an exception)."""
        ...

    def connection(self) -> AbstractContextManager[Connection]:
        """A connection for reads, closed (its transaction rolled back) when the block ends."""
        ...

    def insert(self, table: Table) -> sqlite.Insert | postgresql.Insert:
        """An ``INSERT`` into ``table`` in this dialect, which has ``on_conflict_do_update``."""
        ...

    def keep_row(self, conn: Connection, table: Table, key: Mapping[str, object]) -> None:
        """Keep the row of ``table`` named by ``key`` (its key columns' values) recoverable outside the
        database, as ``conn``'s transaction sees it now: call it in the transaction that changed the row
        (also one that deleted it), after the change. Only the tables of primary data take it (agent
        sessions and steps, LangGraph items, checkpoints, blobs and writes); see :mod:`kvmem.catalog.mirror`.

        Raises:
            ConfigError: ``table`` keeps no records, or ``key`` does not name its key columns.
            TierUnavailable: the record cannot be written (roll the transaction back: the exception does).
        """
        ...
