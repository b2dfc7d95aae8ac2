"""Vector indexes: nearest-neighbour search over unit vectors by inner product.

A :class:`VectorIndex` holds one partition's vectors (one namespace and embedder);
partitions are separate index objects, so a search can never cross them.

- :class:`ExactIndex` (here): brute force over one contiguous matrix. Exact, and the
  fastest below some 20k vectors (a matmul: ~0.2 ms at 10k, 7-9 ms at 100k on 2 cores).
- :class:`~kvmem.semantic.hnsw.HnswIndex`: a faiss HNSW graph (approximate, sub-linear).
- :class:`~kvmem.semantic.auto.AutoIndex`: exact while small, HNSW once large, graphs
  built in the background; what the semantic layer uses.

Every index breaks score ties by id, so equal scores come back in one order
whatever the insertion history.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np

__all__ = ["ExactIndex", "VectorIndex"]


class VectorIndex(Protocol):
    """Ids mapped to unit vectors, searched by cosine (inner product)."""

    def add(self, ids: Sequence[str], vectors: np.ndarray) -> None:
        """Insert or replace the vectors of ``ids`` (``vectors``: float32 ``[len(ids), dim]``)."""
        ...

    def remove(self, ids: Sequence[str]) -> int:
        """Remove ``ids`` (absent ones are ignored); how many were present."""
        ...

    def search(self, vector: np.ndarray, k: int, allowed: Collection[str] | None = None) -> list[tuple[str, float]]:
        """The ``k`` ids closest to ``vector``, best first (ties by id), only ids in ``allowed`` when given."""
        ...

    def __len__(self) -> int: ...


def checked_rows(ids: Sequence[str], vectors: np.ndarray, dim: int) -> np.ndarray:
    """``vectors`` as float32, or ValueError when it is not ``[len(ids), dim]``."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.shape != (len(ids), dim):
        raise ValueError(f"vectors of shape {vectors.shape}: expected ({len(ids)}, {dim})")
    return vectors


def _best(scores: np.ndarray, ids: Sequence[str], k: int) -> list[tuple[str, float]]:
    """The ``k`` best finite ``scores`` as ``(ids[i], score)``, best first, equal scores by id.

    Everything tied with the k-th score is a candidate, so which of several
    equal ids makes the cut does not depend on row order.
    """
    if len(scores) > k:
        cut = np.partition(scores, len(scores) - k)[len(scores) - k]
        rows = np.flatnonzero(scores >= cut)
    else:
        rows = np.arange(len(scores))
    found = [(float(scores[i]), ids[i]) for i in rows.tolist()]
    found = [(s, id_) for s, id_ in found if math.isfinite(s)]
    found.sort(key=lambda c: (-c[0], c[1]))
    return [(id_, s) for s, id_ in found[:k]]


class ExactIndex:
    """Brute-force search over a contiguous ``[n, dim]`` float32 matrix.

    NOTE: invariant: rows ``0..n-1`` of ``_matrix`` are live and ``_ids[i]`` owns row
    ``i``; removal moves the last row into the hole (O(1) per id), and the
    matrix grows by doubling, so adds are amortized O(1) per row.

    Args:
        dim: vector length.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._matrix = np.zeros((16, dim), dtype=np.float32)
        self._ids: list[str] = []
        self._row: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, id_: object) -> bool:
        return id_ in self._row

    @property
    def ids(self) -> list[str]:
        """Live ids; ``ids[i]`` owns row ``i`` of :attr:`vectors` (a copy)."""
        return list(self._ids)

    @property
    def vectors(self) -> np.ndarray:
        """The live ``[n, dim]`` rows, a read-only view (valid until the next add or remove)."""
        view = self._matrix[: len(self._ids)]
        view.flags.writeable = False
        return view

    def add(self, ids: Sequence[str], vectors: np.ndarray) -> None:
        """See :meth:`VectorIndex.add`.

        Raises:
            ValueError: ``vectors`` is not ``[len(ids), dim]``.
        """
        vectors = checked_rows(ids, vectors, self.dim)
        for id_, vec in zip(ids, vectors):
            row = self._row.get(id_)
            if row is None:
                row = len(self._ids)
                if row == self._matrix.shape[0]:
                    grown = np.zeros((2 * row, self.dim), dtype=np.float32)
                    grown[:row] = self._matrix
                    self._matrix = grown
                self._ids.append(id_)
                self._row[id_] = row
            self._matrix[row] = vec

    def remove(self, ids: Sequence[str]) -> int:
        """See :meth:`VectorIndex.remove`."""
        removed = 0
        for id_ in ids:
            row = self._row.pop(id_, None)
            if row is None:
                continue
            last = len(self._ids) - 1
            if row != last:  # swap the last row into the hole
                moved = self._ids[last]
                self._matrix[row] = self._matrix[last]
                self._ids[row] = moved
                self._row[moved] = row
            self._ids.pop()
            removed += 1
        return removed

    def search(self, vector: np.ndarray, k: int, allowed: Collection[str] | None = None) -> list[tuple[str, float]]:
        """See :meth:`VectorIndex.search`; with ``allowed``, only its rows are scored."""
        n = len(self._ids)
        if n == 0 or k <= 0:
            return []
        query = np.asarray(vector, dtype=np.float32).reshape(self.dim)
        if allowed is None:
            return _best(self._matrix[:n] @ query, self._ids, k)
        rows = np.unique(np.fromiter((r for r in map(self._row.get, allowed) if r is not None), dtype=np.int64))
        if rows.size == 0:
            return []
        return _best(self._matrix[rows] @ query, [self._ids[r] for r in rows.tolist()], k)

    def copy(self) -> ExactIndex:
        """An independent index with the same ids and vectors."""
        twin = ExactIndex(self.dim)
        twin._matrix = self._matrix[: max(16, len(self._ids))].copy()
        twin._ids = list(self._ids)
        twin._row = dict(self._row)
        return twin

    def has(self, id_: str, vector: np.ndarray) -> bool:
        """Whether ``id_`` is live with exactly ``vector``."""
        row = self._row.get(id_)
        return row is not None and bool(np.array_equal(self._matrix[row], vector))
