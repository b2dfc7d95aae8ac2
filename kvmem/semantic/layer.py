"""``SemanticIndex``: texts of stored entries, embedded, indexed per namespace, verified on lookup.

Persistence: a side table ``kvmem_semantic`` in the catalog database holds, per
storage key, its namespace, text, the embedder name and the vector (float32
bytes). On open, the rows of the current embedder whose entries some tier still
holds are read back into one index per namespace, without re-embedding (their
vectors also seed the embedding cache); rows of entries gone meanwhile are
deleted. Rows of another embedder are ignored (and re-embedded only when stored
again).

Evictions: the store calls :meth:`SemanticIndex.discard` when an entry leaves its
last tier; the vector goes at once (no dangling hit), the row at the next write.

Partitioning is structural: each namespace has its own index object, so a
lookup in one namespace never scores another's vectors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import (
    Column,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    delete,
    inspect,
    select,
)
from sqlalchemy.engine import Engine

from kvmem.semantic.embedder import (
    CachedEmbedder,
    Embedder,
    SentenceTransformerEmbedder,
)
from kvmem.semantic.index import ExactIndex
from kvmem.semantic.verify import RuleVerifier, Verifier

__all__ = ["Match", "SemanticIndex"]

_meta = MetaData()
semantic_rows = Table(
    "kvmem_semantic", _meta,
    Column("key", String(64), primary_key=True),
    Column("namespace", String(256), nullable=False, index=True),
    Column("embedder", String(256), nullable=False),
    Column("text", Text, nullable=False),
    Column("vector", LargeBinary, nullable=False),
)


@dataclass(frozen=True)
class Match:
    """One semantic hit: the entry's storage key, cosine score, indexed text, and metadata."""

    key: str
    score: float
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


class SemanticIndex:
    """Vectors of entry texts, per namespace, persisted beside the catalog.

    Args:
        engine: the catalog's database engine (the side table is created there).
        embedder: default: the packaged all-MiniLM-L6-v2 (loaded here, so build lazily).
        verifier: strict second stage; default :class:`RuleVerifier`.
        live: which of the given storage keys the store still holds (rows of the others are
            dropped on open); default: all of them.
    """

    def __init__(self, engine: Engine, embedder: Embedder | None = None, verifier: Verifier | None = None,
                 live: Callable[[Sequence[str]], list[bool]] | None = None) -> None:
        inner = embedder if embedder is not None else SentenceTransformerEmbedder()
        self.embedder = inner if isinstance(inner, CachedEmbedder) else CachedEmbedder(inner)
        self.verifier: Verifier = verifier if verifier is not None else RuleVerifier()
        self._engine = engine
        self._lock = threading.RLock()
        self._indexes: dict[str, ExactIndex] = {}
        self._texts: dict[str, str] = {}
        self._stale: set[str] = set()  # NOTE: discarded keys whose rows are still in the side table
        _meta.create_all(engine)
        self._rebuild(live)

    def _rebuild(self, live: Callable[[Sequence[str]], list[bool]] | None) -> None:
        """Load every row of this embedder whose entry is live into its namespace's index."""
        stmt = select(semantic_rows).where(semantic_rows.c.embedder == self.embedder.name)
        with self._engine.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        if live is not None and rows:
            alive = live([row["key"] for row in rows])
            self._stale.update(row["key"] for row, ok in zip(rows, alive) if not ok)
            rows = [row for row, ok in zip(rows, alive) if ok]
            self._purge()
        for row in rows:
            vec = np.frombuffer(row["vector"], dtype=np.float32)
            if vec.shape != (self.embedder.dim,):
                continue  # NOTE: written by a model of the same name and another width: re-embedded on store
            self._partition(row["namespace"]).add([row["key"]], vec[None, :])
            self._texts[row["key"]] = row["text"]
            self.embedder.remember(row["text"], vec)

    def _partition(self, namespace: str) -> ExactIndex:
        index = self._indexes.get(namespace)
        if index is None:
            index = self._indexes[namespace] = ExactIndex(self.embedder.dim)
        return index

    def __contains__(self, key: object) -> bool:
        """Whether storage key ``key`` has a vector in some namespace's index."""
        with self._lock:
            return key in self._texts

    def __len__(self) -> int:
        with self._lock:
            return len(self._texts)

    def add(self, key: str, text: str, namespace: str) -> None:
        """Index ``text`` for storage key ``key`` in ``namespace`` (replacing any earlier text)."""
        vec = self.embedder.embed([text])[0]
        row = {"key": key, "namespace": namespace, "embedder": self.embedder.name, "text": text,
               "vector": vec.tobytes()}
        with self._lock:
            self._stale.discard(key)
            self._purge()
            with self._engine.begin() as conn:
                conn.execute(delete(semantic_rows).where(semantic_rows.c.key == key))
                conn.execute(semantic_rows.insert(), row)
            for index in self._indexes.values():  # NOTE: a storage key lives in exactly one namespace
                index.remove([key])
            self._partition(namespace).add([key], vec[None, :])
            self._texts[key] = text

    def discard(self, key: str) -> None:
        """Drop ``key``'s vector now (its entry was evicted); its row goes at the next write or :meth:`flush`.

        Cheap and database-free: the store calls it while it makes room.
        """
        with self._lock:
            if self._forget(key):
                self._stale.add(key)

    def flush(self) -> None:
        """Delete the rows of discarded keys."""
        with self._lock:
            self._purge()

    def _purge(self) -> None:
        if self._stale:
            stale = sorted(self._stale)
            with self._engine.begin() as conn:
                conn.execute(delete(semantic_rows).where(semantic_rows.c.key.in_(stale)))
            self._stale.difference_update(stale)

    def _forget(self, key: str) -> bool:
        """Drop ``key`` from the in-memory indexes; whether it was there."""
        found = [index.remove([key]) for index in self._indexes.values()]  # NOTE: every index, no short cut
        return self._texts.pop(key, None) is not None or any(found)

    def remove(self, key: str) -> bool:
        """Forget ``key``'s vector and text; whether it was indexed."""
        with self._lock:
            with self._engine.begin() as conn:
                gone = conn.execute(delete(semantic_rows).where(semantic_rows.c.key == key)).rowcount > 0
            self._stale.discard(key)
            found = self._forget(key)
        return gone or found

    def search(self, query: str, namespace: str, k: int, threshold: float | None = None,
               verify: bool = True) -> list[tuple[str, float, str]]:
        """Candidates for ``query`` in ``namespace``: ``(key, score, text)``, best first.

        Args:
            query: the text to match.
            namespace: the only partition searched.
            k: most results.
            threshold: cosine floor (inclusive); default the embedder's calibrated one.
            verify: apply the strict verifier to each candidate over the threshold.
        """
        floor = self.embedder.threshold if threshold is None else threshold
        vec = self.embedder.embed([query])[0]
        with self._lock:
            index = self._indexes.get(namespace)
            # NOTE: over-fetch, since the verifier may reject some of the nearest
            found = index.search(vec, max(4 * k, k + 8)) if index is not None else []
            scored = [(key, score, self._texts[key]) for key, score in found if score >= floor]
        if verify:
            scored = [c for c in scored if self.verifier.accepts(query, c[2])]
        return scored[:k]


def forget(engine: Engine, key: str) -> None:
    """Delete ``key``'s side-table row without loading an embedder (``Memory.delete`` before any lookup)."""
    # NOTE: no DDL here: concurrent deletes creating the table would race ("already exists")
    if not inspect(engine).has_table(semantic_rows.name):
        return
    with engine.begin() as conn:
        conn.execute(delete(semantic_rows).where(semantic_rows.c.key == key))
