"""Vector indexes: exact nearest-neighbour search over unit vectors by inner product.

A :class:`VectorIndex` holds one partition's vectors (one namespace and embedder);
partitions are separate index objects, so a search can never cross them.
"""

from __future__ import annotations

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

    def search(self, vector: np.ndarray, k: int,
               allowed: Collection[str] | None = None) -> list[tuple[str, float]]:
        """The ``k`` ids closest to ``vector``, best first, restricted to ``allowed`` when given."""
        ...

    def __len__(self) -> int:
        ...


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

    def add(self, ids: Sequence[str], vectors: np.ndarray) -> None:
        """See :meth:`VectorIndex.add`.

        Raises:
            ValueError: ``vectors`` is not ``[len(ids), dim]``.
        """
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.shape != (len(ids), self.dim):
            raise ValueError(f"vectors of shape {vectors.shape}: expected ({len(ids)}, {self.dim})")
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

    def search(self, vector: np.ndarray, k: int,
               allowed: Collection[str] | None = None) -> list[tuple[str, float]]:
        """See :meth:`VectorIndex.search`."""
        n = len(self._ids)
        if n == 0 or k <= 0:
            return []
        scores = self._matrix[:n] @ np.asarray(vector, dtype=np.float32).reshape(self.dim)
        if allowed is not None:
            mask = np.fromiter((i in allowed for i in self._ids), dtype=bool, count=n)
            scores = np.where(mask, scores, -np.inf)
        top = min(k, n)
        best = np.argpartition(-scores, top - 1)[:top]
        best = best[np.argsort(-scores[best], kind="stable")]
        return [(self._ids[i], float(scores[i])) for i in best if np.isfinite(scores[i])]
