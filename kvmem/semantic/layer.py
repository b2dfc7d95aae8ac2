"""``SemanticIndex``: texts of stored entries, embedded, indexed per namespace, verified on lookup.

Persistence: a side table ``kvmem_semantic`` in the catalog database holds, per
storage key, its namespace, text, the embedder name, the vector (float32
bytes) and the key the caller stored it under (in full: its exact bytes and
whether they were given as ``bytes``), which a :class:`Match` hands back. On
open, the rows of the current embedder whose entries some tier still holds are
read back into one index per namespace, without re-embedding (their
vectors also seed the embedding cache); rows of entries gone meanwhile are
deleted. Rows of another embedder are ignored (and re-embedded only when stored
again).

The vector index of a namespace is an :class:`~kvmem.semantic.auto.AutoIndex`
(exact while small, an HNSW graph built off-thread once large). Graphs are
saved under ``directory`` on :meth:`SemanticIndex.flush` and loaded on open
when they still match the rows exactly (else rebuilt in the background; the
rows, not the graph file, are the truth).

Evictions: the store calls :meth:`SemanticIndex.discard` when an entry leaves its
last tier; the vector goes at once (no dangling hit), the row at the next write.

Partitioning is structural: each namespace has its own index object, so a
lookup in one namespace never scores another's vectors.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from sqlalchemy import delete, select

from kvmem.catalog.schema import semantic_rows
from kvmem.ports import Database
from kvmem.recovery import OnRecovered
from kvmem.semantic.auto import AutoIndex
from kvmem.semantic.embedder import (
    CachedEmbedder,
    Embedder,
    SentenceTransformerEmbedder,
)
from kvmem.semantic.verify import RuleVerifier, Verifier

__all__ = ["Match", "SemanticIndex"]


@dataclass(frozen=True)
class Match:
    """One semantic hit.

    Attributes:
        key: the key the entry was stored under, in full and of the type given (``str`` or ``bytes``);
            ``None`` when its text was indexed without one.
        score: cosine similarity of the query and the indexed text.
        text: the indexed text.
        metadata: the entry's metadata.
        namespace: the namespace searched, which is the entry's: ``load(m.key, namespace=m.namespace)``.
        storage_key: the entry's storage key (64 hex digits): ``Memory.load_match(m)`` loads its value.
    """

    key: str | bytes | None
    score: float
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    namespace: str = ""
    storage_key: str = ""


class _Entry(NamedTuple):
    """What the index keeps in memory per storage key."""

    namespace: str
    text: str
    user_key: str | bytes | None


class SemanticIndex:
    """Vectors of entry texts, per namespace, persisted beside the catalog.

    Args:
        database: the catalog's database (:attr:`Memory.database <kvmem.api.Memory.database>`), whose schema
            holds the side table.
        embedder: default: the packaged all-MiniLM-L6-v2 (loaded here, so build lazily).
        verifier: strict second stage; default :class:`RuleVerifier`.
        live: which of the given storage keys the store still holds (rows of the others are
            dropped on open); default: all of them.
        directory: where HNSW graphs are saved (one file pair per namespace); None: never saved,
            rebuilt on every open.
        hnsw_from: vectors in one namespace above which its search goes through an HNSW graph.
        on_recovered: told ``"hnsw"`` when a damaged saved graph is set aside (and rebuilt from the rows).
    """

    def __init__(
        self,
        database: Database,
        embedder: Embedder | None = None,
        verifier: Verifier | None = None,
        live: Callable[[Sequence[str]], list[bool]] | None = None,
        directory: str | Path | None = None,
        hnsw_from: int = 20_000,
        on_recovered: OnRecovered | None = None,
    ) -> None:
        inner = embedder if embedder is not None else SentenceTransformerEmbedder()
        self.embedder = inner if isinstance(inner, CachedEmbedder) else CachedEmbedder(inner)
        self.verifier: Verifier = verifier if verifier is not None else RuleVerifier()
        self._database = database
        self._upsert = _upsert_statement(database)
        self._lock = threading.RLock()
        self._directory = Path(directory) if directory is not None else None
        self._hnsw_from = hnsw_from
        self._on_recovered = on_recovered
        self._indexes: dict[str, AutoIndex] = {}
        self._saved: dict[str, int] = {}  # namespace -> index version last saved (or loaded)
        self._entries: dict[str, _Entry] = {}  # storage key -> its namespace, text and caller's key
        self._stale: set[str] = set()  # discarded keys whose rows are still in the side table
        self._rebuild(live)

    def _rebuild(self, live: Callable[[Sequence[str]], list[bool]] | None) -> None:
        """Load every row of this embedder whose entry is live into its namespace's index."""
        stmt = select(semantic_rows).where(semantic_rows.c.embedder == self.embedder.name)
        with self._database.connection() as conn:
            rows = conn.execute(stmt).mappings().all()
        if live is not None and rows:
            alive = live([row["key"] for row in rows])
            self._stale.update(row["key"] for row, ok in zip(rows, alive) if not ok)
            rows = [row for row, ok in zip(rows, alive) if ok]
            self._purge()
        grouped: dict[str, tuple[list[str], list[np.ndarray]]] = {}
        for row in rows:
            vec = np.frombuffer(row["vector"], dtype=np.float32)
            if vec.shape != (self.embedder.dim,):
                continue  # written by a model of the same name and another width: re-embedded on store
            ids, vecs = grouped.setdefault(row["namespace"], ([], []))
            ids.append(row["key"])
            vecs.append(vec)
            self._entries[row["key"]] = _Entry(
                row["namespace"], row["text"], _user_key(row["user_key"], row["user_key_is_bytes"])
            )
            self.embedder.remember(row["text"], vec)
        for namespace, (ids, vecs) in grouped.items():
            path = self._graph_path(namespace)
            matrix = np.stack(vecs)
            if path is None:
                index = self._partition(namespace)
                index.add(ids, matrix)
            else:
                index = AutoIndex.load(path, ids, matrix, hnsw_from=self._hnsw_from, on_recovered=self._on_recovered)
                self._indexes[namespace] = index
            self._saved[namespace] = index.version

    def _partition(self, namespace: str) -> AutoIndex:
        index = self._indexes.get(namespace)
        if index is None:
            index = self._indexes[namespace] = AutoIndex(self.embedder.dim, hnsw_from=self._hnsw_from)
        return index

    def _graph_path(self, namespace: str) -> Path | None:
        """Where ``namespace``'s graph is saved: a hash of embedder and namespace, never a caller's string."""
        if self._directory is None:
            return None
        name = hashlib.sha256(f"{self.embedder.name}\0{namespace}".encode()).hexdigest()[:32]
        return self._directory / f"{name}.hnsw"

    def __contains__(self, key: object) -> bool:
        """Whether storage key ``key`` has a vector in some namespace's index."""
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def kind(self, namespace: str) -> str:
        """How ``namespace`` is searched now: ``"exact"`` or ``"hnsw"`` (``"exact"`` when it is empty)."""
        with self._lock:
            index = self._indexes.get(namespace)
            return index.kind if index is not None else "exact"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for graph builds in progress (each up to ``timeout`` s); whether none is left running."""
        with self._lock:
            indexes = list(self._indexes.values())
        for index in indexes:
            index.join(timeout)  # NOTE: outside the lock: lookups and stores go on meanwhile
        with self._lock:
            return not any(index.building for index in indexes)

    def add(self, key: str, text: str, namespace: str, user_key: str | bytes | None = None) -> None:
        """Index ``text`` for storage key ``key`` in ``namespace`` (replacing any earlier text).

        Args:
            key: the entry's storage key.
            text: the text to index.
            namespace: the entry's namespace (its own index).
            user_key: the key the caller stored the entry under, handed back by :meth:`user_key`.
        """
        self.add_vector(key, self.embedder.embed([text])[0], namespace, text, user_key)

    def add_vector(
        self, key: str, vector: np.ndarray, namespace: str, text: str = "", user_key: str | bytes | None = None
    ) -> None:
        """Index a vector made elsewhere (an image's CLIP embedding) for ``key``; ``text`` is its label.

        Raises:
            ValueError: ``vector`` is not a unit float32 vector of this index's width.
        """
        vec = np.asarray(vector, dtype=np.float32).reshape(-1)
        if vec.shape != (self.embedder.dim,) or not abs(float(np.linalg.norm(vec)) - 1.0) < 1e-3:
            raise ValueError(f"vector of shape {vec.shape}: expected a unit vector of {self.embedder.dim} floats")
        row = {
            "key": key,
            "namespace": namespace,
            "embedder": self.embedder.name,
            "text": text,
            "vector": vec.tobytes(),
            **_user_key_columns(user_key),
        }
        with self._lock:
            self._stale.discard(key)
            self._purge()
            with self._database.transaction() as conn:
                conn.execute(self._upsert, row)
            self._forget(key)  # a storage key lives in exactly one namespace
            self._partition(namespace).add([key], vec[None, :])
            self._entries[key] = _Entry(namespace, text, user_key)

    def discard(self, key: str) -> None:
        """Drop ``key``'s vector now (its entry was evicted); its row goes at the next write or :meth:`flush`.

        Cheap and database-free: the store calls it while it makes room.
        """
        with self._lock:
            if self._forget(key):
                self._stale.add(key)

    def flush(self) -> None:
        """Delete the rows of discarded keys; save the graphs that changed since the last save."""
        with self._lock:
            self._purge()
            for namespace, index in self._indexes.items():
                path = self._graph_path(namespace)
                if path is not None and self._saved.get(namespace) != index.version:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    index.save(path)
                    self._saved[namespace] = index.version

    def _purge(self) -> None:
        if self._stale:
            stale = sorted(self._stale)
            with self._database.transaction() as conn:
                conn.execute(delete(semantic_rows).where(semantic_rows.c.key.in_(stale)))
            self._stale.difference_update(stale)

    def _forget(self, key: str) -> bool:
        """Drop ``key`` from the in-memory indexes; whether it was there."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._indexes[entry.namespace].remove([key])
        return True

    def remove(self, key: str) -> bool:
        """Forget ``key``'s vector and text; whether it was indexed."""
        with self._lock:
            with self._database.transaction() as conn:
                gone = conn.execute(delete(semantic_rows).where(semantic_rows.c.key == key)).rowcount > 0
            self._stale.discard(key)
            found = self._forget(key)
        return gone or found

    def search(
        self, query: str, namespace: str, k: int, threshold: float | None = None, verify: bool = True
    ) -> list[tuple[str, float, str]]:
        """Candidates for ``query`` in ``namespace``: ``(key, score, text)``, best first.

        Args:
            query: the text to match.
            namespace: the only partition searched.
            k: most results.
            threshold: cosine floor (inclusive); default the embedder's calibrated one.
            verify: apply the strict verifier to each candidate over the threshold.
        """
        # over-fetch, since the verifier may reject some of the nearest
        scored = self.search_vector(self.embedder.embed([query])[0], namespace, candidate_count(k), threshold)
        if verify:
            scored = [c for c in scored if self.verifier.accepts(query, c[2])]
        return scored[:k]

    def search_vector(
        self, vector: np.ndarray, namespace: str, k: int, threshold: float | None = None
    ) -> list[tuple[str, float, str]]:
        """The ``k`` nearest entries of ``namespace`` to a unit ``vector`` scoring at least ``threshold``
        (default: the embedder's): ``(key, score, text)``, best first; no verifier."""
        floor = self.embedder.threshold if threshold is None else threshold
        with self._lock:
            index = self._indexes.get(namespace)
            found = index.search(np.asarray(vector, dtype=np.float32), k) if index is not None else []
            return [(key, score, self._entries[key].text) for key, score in found if score >= floor]

    def user_key(self, key: str) -> str | bytes | None:
        """The key the caller stored storage key ``key`` under (as given to :meth:`add`), or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.user_key if entry is not None else None


def _upsert_statement(database: Database) -> Any:
    """``INSERT .. ON CONFLICT (key) DO UPDATE`` of a side-table row in ``database``'s dialect (built once per index).

    NOTE: one statement, not a delete and an insert: on PostgreSQL two processes indexing the
    same key at once both delete nothing, and the second insert then fails on the primary key.
    """
    insert = database.insert(semantic_rows)
    return insert.on_conflict_do_update(
        index_elements=[semantic_rows.c.key],
        set_={
            name: insert.excluded[name]
            for name in ("namespace", "embedder", "text", "vector", "user_key", "user_key_is_bytes")
        },
    )


def _user_key_columns(user_key: str | bytes | None) -> dict[str, bytes | bool | None]:
    """A caller's key as its side-table columns: its exact bytes (a ``str`` as UTF-8, lone surrogates
    kept) and whether it was given as ``bytes``."""
    if user_key is None:
        return {"user_key": None, "user_key_is_bytes": None}
    if isinstance(user_key, str):
        return {"user_key": user_key.encode("utf-8", "surrogatepass"), "user_key_is_bytes": False}
    return {"user_key": bytes(user_key), "user_key_is_bytes": True}


def _user_key(raw: bytes | None, is_bytes: bool | None) -> str | bytes | None:
    """The caller's key back from its side-table columns (see :func:`_user_key_columns`)."""
    if raw is None:
        return None
    return bytes(raw) if is_bytes else bytes(raw).decode("utf-8", "surrogatepass")


def candidate_count(k: int) -> int:
    """How many nearest vectors a lookup for ``k`` results fetches before threshold and verifier."""
    return max(4 * k, k + 8)


def forget(database: Database, key: str) -> None:
    """Delete ``key``'s side-table row without loading an embedder (``Memory.delete`` before any lookup)."""
    with database.transaction() as conn:
        conn.execute(delete(semantic_rows).where(semantic_rows.c.key == key))
