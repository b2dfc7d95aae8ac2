"""``HnswIndex``: a faiss HNSW graph with removal by tombstones, saved and loaded with a digest check."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvmem.errors import ConfigError
from kvmem.fsutil import write_atomic
from kvmem.recovery import Damaged, OnRecovered, set_aside
from kvmem.semantic.index import ExactIndex, checked_rows

try:
    import faiss
except ImportError:  # NOTE: faiss is the optional extra kvmem[semantic]; without it AutoIndex stays exact
    faiss = None  # type: ignore[assignment]

__all__ = ["HNSW_AVAILABLE", "HnswIndex", "content_digest"]

HNSW_AVAILABLE = faiss is not None
"""Whether faiss is installed, so that an :class:`HnswIndex` can be made."""

_FORMAT = 1  # NOTE: sidecar format version; a sidecar of another version is stale
_EXACT_SUBSET = 4096  # an `allowed` set this small is scored exactly, not through the graph


def content_digest(ids: Sequence[str], vectors: np.ndarray) -> str:
    """sha256 hex of ``ids`` and their vectors, independent of their order.

    Args:
        ids: unique ids.
        vectors: float32 ``[len(ids), dim]``, ``vectors[i]`` belonging to ``ids[i]``.
    """
    vectors = np.asarray(vectors, dtype="<f4")
    order = sorted(range(len(ids)), key=ids.__getitem__)
    h = hashlib.sha256(json.dumps([list(vectors.shape), [ids[i] for i in order]]).encode())
    h.update(np.ascontiguousarray(vectors[np.asarray(order, dtype=np.int64)]).data)
    return h.hexdigest()


class HnswIndex:
    """A faiss ``IndexHNSWFlat`` (inner product) over unit vectors, with removal by tombstones.

    faiss HNSW cannot delete, so each vector gets a fresh int *label* (its
    position in the graph); a removed or replaced vector's label becomes a
    tombstone that searches skip (an ``IDSelectorBitmap`` of live labels).
    When tombstones exceed ``rebuild_at`` of the graph, it is rebuilt from the
    live vectors, kept contiguous in an :class:`ExactIndex` for that (and for
    small ``allowed`` sets, scored exactly). Amortized, each removal pays for
    ``(1 - rebuild_at) / rebuild_at`` re-insertions (3 by default); but the call
    that triggers a rebuild waits for all of them (a build of the live vectors:
    ~11 s at 20k, ~150 s at 100k of 384-d on 2 cores). Memory: the live copy, plus faiss's own copy of every
    vector in the graph (tombstones included) and its links: ~2.2x the vectors.

    NOTE: invariants: ``_owner[label]`` is the id of a live label, None for a
    tombstone; ``_label[id]`` is the live label of ``id``; ``_alive[:ntotal]``
    marks live labels; ``_live`` holds exactly the ids of ``_label``.

    Args:
        dim: vector length.
        m: graph degree (faiss ``M``); more costs memory and build time, gains recall.
        ef_construction: candidate list while inserting; more builds slower, better.
        ef_search: candidate list while searching (raised to the number of results asked).
        rebuild_at: tombstone fraction of the graph that triggers a rebuild; None: never
            rebuilds itself (its owner does, as :class:`~kvmem.semantic.auto.AutoIndex` does off-thread).
    """

    def __init__(
        self, dim: int, m: int = 32, ef_construction: int = 200, ef_search: int = 64, rebuild_at: float | None = 0.25
    ) -> None:
        if not HNSW_AVAILABLE:
            raise ConfigError("HnswIndex needs faiss, which is not installed: pip install 'kvmem[semantic]'")
        for name, value in (("dim", dim), ("m", m), ("ef_construction", ef_construction), ("ef_search", ef_search)):
            if value < (2 if name == "m" else 1):
                raise ValueError(f"{name}={value}: expected an int >= {2 if name == 'm' else 1}")
        if rebuild_at is not None and not 0.0 < rebuild_at < 1.0:
            raise ValueError(f"rebuild_at={rebuild_at}: expected a fraction in (0, 1)")
        self.dim, self.m, self.ef_construction, self.ef_search = dim, m, ef_construction, ef_search
        self.rebuild_at = rebuild_at
        self.rebuilds = 0  # graph rebuilds so far (tombstone compaction)
        self._live = ExactIndex(dim)
        self._reset([])

    @classmethod
    def from_exact(
        cls,
        exact: ExactIndex,
        m: int = 32,
        ef_construction: int = 200,
        ef_search: int = 64,
        rebuild_at: float | None = 0.25,
    ) -> HnswIndex:
        """A graph over ``exact``'s vectors; ``exact`` becomes the new index's live store (not copied).

        Args:
            exact: the vectors; the caller must not use it afterwards except through the result.
            m: as in the constructor.
            ef_construction: as in the constructor.
            ef_search: as in the constructor.
            rebuild_at: as in the constructor.
        """
        index = cls(exact.dim, m, ef_construction, ef_search, rebuild_at)
        index._live = exact
        index._reset(exact.ids, exact.vectors)
        return index

    @property
    def tombstones(self) -> int:
        """Labels in the graph whose vector was removed or replaced."""
        return self._graph.ntotal - len(self._live)

    @property
    def live(self) -> ExactIndex:
        """The live vectors (shared, not copied: read, never modify)."""
        return self._live

    def __len__(self) -> int:
        return len(self._live)

    def _reset(self, ids: Sequence[str], vectors: np.ndarray | None = None) -> None:
        """A fresh graph holding ``ids`` (labels ``0..n-1``); ``_live`` must already hold them."""
        self._graph = faiss.IndexHNSWFlat(self.dim, self.m, faiss.METRIC_INNER_PRODUCT)
        self._graph.hnsw.efConstruction = self.ef_construction
        self._graph.hnsw.efSearch = self.ef_search
        if vectors is not None and len(ids):
            self._graph.add(np.ascontiguousarray(vectors, dtype=np.float32))
        self._owner: list[str | None] = list(ids)
        self._label: dict[str, int] = {id_: i for i, id_ in enumerate(ids)}
        self._alive = np.ones(max(16, len(ids)), dtype=bool)
        self._bits: np.ndarray | None = None  # packed _alive, cached until the next change

    def add(self, ids: Sequence[str], vectors: np.ndarray) -> None:
        """See :meth:`VectorIndex.add` (an id given twice keeps its last vector).

        Raises:
            ValueError: ``vectors`` is not ``[len(ids), dim]``.
        """
        vectors = checked_rows(ids, vectors, self.dim)
        last = {id_: i for i, id_ in enumerate(ids)}
        fresh = [(id_, i) for id_, i in last.items() if not self._live.has(id_, vectors[i])]
        if not fresh:
            return
        new_ids = [id_ for id_, _ in fresh]
        rows = vectors[[i for _, i in fresh]]
        for id_ in new_ids:
            self._bury(id_)
        base = self._graph.ntotal
        self._graph.add(np.ascontiguousarray(rows))
        if self._graph.ntotal > len(self._alive):
            self._alive = np.concatenate([self._alive, np.zeros(max(len(self._alive), len(rows)), dtype=bool)])
        self._alive[base : self._graph.ntotal] = True
        for j, id_ in enumerate(new_ids):
            self._label[id_] = base + j
            self._owner.append(id_)
        self._live.add(new_ids, rows)
        self._bits = None
        self._compact_if_due()

    def remove(self, ids: Sequence[str]) -> int:
        """See :meth:`VectorIndex.remove`."""
        removed = sum(self._bury(id_) for id_ in ids)
        self._live.remove(ids)
        self._compact_if_due()
        return removed

    def _bury(self, id_: str) -> bool:
        """Tombstone ``id_``'s label, if it has one (``_live`` is left to the caller)."""
        label = self._label.pop(id_, None)
        if label is None:
            return False
        self._owner[label] = None
        self._alive[label] = False
        self._bits = None
        return True

    def _compact_if_due(self) -> None:
        if self.rebuild_at is not None and self.tombstones > self.rebuild_at * self._graph.ntotal:
            self._reset(self._live.ids, self._live.vectors)
            self.rebuilds += 1

    def search(self, vector: np.ndarray, k: int, allowed: Collection[str] | None = None) -> list[tuple[str, float]]:
        """See :meth:`VectorIndex.search`.

        Small ``allowed`` sets (under 4096 ids, or an eighth of the index) are scored
        exactly: a graph filtered that hard loses its paths. When the graph returns
        fewer than it should (heavy filtering), the search falls back to exact.
        """
        n = len(self._live)
        if n == 0 or k <= 0:
            return []
        query = np.asarray(vector, dtype=np.float32).reshape(1, self.dim)
        ntotal = self._graph.ntotal
        mask: np.ndarray | None = None
        if allowed is None:
            eligible = n
            keep = self._alive_bits() if ntotal > n else None
        else:
            labels = np.unique(np.fromiter((x for x in map(self._label.get, allowed) if x is not None), dtype=np.int64))
            eligible = labels.size
            if eligible <= _EXACT_SUBSET or 8 * eligible <= n:
                return self._live.search(query, k, allowed)
            mask = np.zeros(ntotal, dtype=bool)
            mask[labels] = True
            keep = np.packbits(mask, bitorder="little")
        want = min(k, eligible)
        fetch = min(eligible, k + 8)  # a few extra so ties at the k-th score resolve by id
        # the ignores: faiss 1.15's stubs lack SearchParametersHNSW and the one-argument IDSelectorBitmap
        params = faiss.SearchParametersHNSW(efSearch=max(self.ef_search, fetch))  # type: ignore[attr-defined]
        if keep is not None:
            selector = faiss.IDSelectorBitmap(keep)  # type: ignore[call-arg, arg-type]  # NOTE: params borrows it
            params.sel = selector
        scores, labels_found = self._graph.search(query, fetch, params=params)
        found: list[tuple[float, str]] = []
        for score, label in zip(scores[0].tolist(), labels_found[0].tolist(), strict=True):
            id_ = self._owner[label] if 0 <= label < ntotal else None
            if id_ is not None and (mask is None or mask[label]):
                found.append((score, id_))
        if len(found) < want:
            return self._live.search(query, k, allowed)
        found.sort(key=lambda c: (-c[0], c[1]))
        return [(id_, score) for score, id_ in found[:k]]

    def _alive_bits(self) -> np.ndarray:
        if self._bits is None:
            self._bits = np.packbits(self._alive[: self._graph.ntotal], bitorder="little")
        return self._bits

    # -- persistence -------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the graph to ``path`` and a JSON sidecar to ``path.json``, each atomically.

        NOTE: the sidecar is renamed last and names the graph's sha256, so a crash
        between the two renames leaves a pair that :meth:`load` rejects as stale.
        """
        path = Path(path)
        graph = faiss.serialize_index(self._graph)  # same bytes as faiss.write_index
        meta = _Sidecar(
            self.dim,
            self.m,
            self.ef_construction,
            self.ef_search,
            self.rebuild_at,
            graph_sha256=hashlib.sha256(graph.data).hexdigest(),
            digest=content_digest(self._live.ids, self._live.vectors),
            labels=list(self._owner),
        )
        write_atomic(path, graph.data, durable=True)
        write_atomic(_sidecar(path), json.dumps({"format": _FORMAT, **asdict(meta)}), durable=True)

    @staticmethod
    def delete_files(path: str | os.PathLike[str]) -> None:
        """Delete what :meth:`save` wrote at ``path`` (absent files are fine)."""
        for stale in (Path(path), _sidecar(Path(path))):
            stale.unlink(missing_ok=True)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        ids: Sequence[str],
        vectors: np.ndarray,
        on_recovered: OnRecovered | None = None,
    ) -> HnswIndex | None:
        """The index saved at ``path`` if it holds exactly ``ids`` with ``vectors``, else None.

        None means missing, stale (saved from other contents) or damaged: the caller then
        builds from its rows. A damaged pair (a sidecar that is not one, a graph whose sha256
        is not the sidecar's, bytes faiss cannot read) is set aside (see :mod:`kvmem.recovery`).
        Parameters come from the sidecar.

        Args:
            path: what :meth:`save` was given.
            ids: the ids the caller holds now (unique).
            vectors: float32 ``[len(ids), dim]``.
            on_recovered: told ``"hnsw"`` when a damaged pair was set aside.
        """
        path = Path(path)
        try:
            return cls._load(path, ids, np.asarray(vectors, dtype=np.float32))
        except Damaged as exc:
            # NOTE: a crash between save's two renames also leaves a graph its sidecar does not name
            set_aside(path, "hnsw", str(exc), on_recovered, companions=(".json",))
            return None

    @classmethod
    def _load(cls, path: Path, ids: Sequence[str], vectors: np.ndarray) -> HnswIndex | None:
        """:meth:`load`, raising :class:`~kvmem.recovery.Damaged` for a damaged pair."""
        meta = _Sidecar.read(_sidecar(path))
        if meta is None or vectors.shape != (len(ids), meta.dim):
            return None
        owners = meta.labels
        if sorted(o for o in owners if o is not None) != sorted(ids) or meta.digest != content_digest(ids, vectors):
            return None
        try:
            graph_bytes = path.read_bytes()
        except OSError:  # a missing or unreadable graph is a miss, like a stale one
            return None
        if hashlib.sha256(graph_bytes).hexdigest() != meta.graph_sha256:
            raise Damaged("the graph's sha256 is not the one its sidecar names")
        try:
            # NOTE: not faiss.downcast_index: its wrapper does not own the index, which the
            # owning temporary would free; deserialize_index already returns the concrete class
            graph = faiss.deserialize_index(np.frombuffer(graph_bytes, dtype=np.uint8))
        except RuntimeError as exc:  # bytes that match a crafted sidecar but no faiss format
            raise Damaged(f"faiss cannot read the graph: {exc}") from None
        if (
            not isinstance(graph, faiss.IndexHNSWFlat)
            or graph.d != meta.dim
            or graph.metric_type != faiss.METRIC_INNER_PRODUCT
            or graph.ntotal != len(owners)
        ):
            raise Damaged("the graph is not the inner-product HNSW graph its sidecar describes")
        index = cls(meta.dim, meta.m, meta.ef_construction, meta.ef_search, meta.rebuild_at)
        index._live.add(ids, vectors)
        index._graph, index._owner = graph, owners
        index._label = {id_: label for label, id_ in enumerate(owners) if id_ is not None}
        index._alive = np.fromiter((o is not None for o in owners), dtype=bool, count=len(owners))
        return index


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


@dataclass(frozen=True)
class _Sidecar:
    """What ``path.json`` says about the graph at ``path``."""

    dim: int
    m: int
    ef_construction: int
    ef_search: int
    rebuild_at: float | None
    graph_sha256: str  # of the graph file's bytes
    digest: str  # content_digest of the live ids and vectors
    labels: list[str | None]  # label -> id, None for a tombstone

    @classmethod
    def read(cls, path: Path) -> _Sidecar | None:
        """The sidecar at ``path`` if it is a well-formed one of this format; None: missing, unreadable, or
        of another format version.

        Raises:
            Damaged: not JSON, or not the fields of a sidecar.
        """
        try:
            raw = json.loads(path.read_bytes())
        except OSError:  # missing or unreadable: nothing saved, the caller builds
            return None
        except ValueError as exc:  # also bytes that are not UTF-8
            raise Damaged(f"the sidecar is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise Damaged("the sidecar is not a JSON object")
        if raw.pop("format", None) != _FORMAT:
            return None  # written by another version of this class: stale
        if set(raw) != set(cls.__dataclass_fields__):
            raise Damaged("the sidecar does not hold a sidecar's fields")
        meta = cls(**raw)
        ints_ok = all(isinstance(v, int) and v >= 1 for v in (meta.dim, meta.m, meta.ef_construction, meta.ef_search))
        fraction_ok = meta.rebuild_at is None or (isinstance(meta.rebuild_at, float) and 0.0 < meta.rebuild_at < 1.0)
        if (
            not ints_ok
            or meta.m < 2
            or not fraction_ok
            or not isinstance(meta.graph_sha256, str)
            or not isinstance(meta.digest, str)
            or not isinstance(meta.labels, list)
            or not all(o is None or isinstance(o, str) for o in meta.labels)
        ):
            raise Damaged("the sidecar holds values no save writes")
        return meta
