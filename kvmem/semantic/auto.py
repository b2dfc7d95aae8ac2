"""``AutoIndex``: exact while small, HNSW once large, graphs built off the caller's thread."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Sequence

import numpy as np

from kvmem.recovery import OnRecovered
from kvmem.semantic.hnsw import HNSW_AVAILABLE, HnswIndex
from kvmem.semantic.index import ExactIndex, checked_rows
from kvmem.threads import yield_to_compute

__all__ = ["AutoIndex"]

log = logging.getLogger(__name__)


class _Build:
    """A graph built on a daemon thread from a private copy of the live vectors.

    NOTE: faiss releases the GIL while it inserts, so the owner keeps serving
    (and changing) its current index meanwhile; it logs those changes in
    :attr:`log` and replays them onto the graph before the graph serves.
    """

    def __init__(self, live: ExactIndex, m: int, ef_construction: int, ef_search: int) -> None:
        self.log: list[tuple[list[str], np.ndarray | None]] = []  # (ids, vectors) added, (ids, None) removed
        self.graph: HnswIndex | None = None
        self._thread = threading.Thread(
            target=self._run, args=(live, m, ef_construction, ef_search), name="kvmem-hnsw-build", daemon=True
        )
        self._thread.start()

    def _run(self, live: ExactIndex, m: int, ef_construction: int, ef_search: int) -> None:
        yield_to_compute()
        try:
            self.graph = HnswIndex.from_exact(live, m, ef_construction, ef_search, rebuild_at=None)
        except (MemoryError, RuntimeError) as exc:  # the owner keeps serving what it has
            log.warning(
                "kvmem: building an HNSW graph of %d vectors failed (%s); search stays as it was", len(live), exc
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the build has finished (after waiting up to ``timeout`` seconds; None: for good)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class AutoIndex:
    """Exact while small, HNSW once large: the semantic layer's index.

    Why by size (384-d, 2 cores, index time only): an exact search is a matmul
    over all rows, ~0.2 ms at 10k and 7-9 ms at 100k, exact and with nothing to
    build; the graph (defaults) answers in ~0.75 ms at 100k with recall@1 ~1.0,
    but costs a build (~11 s at 20k, ~150 s at 100k), ~1.2x the vectors' size in
    extra memory, and exactness.

    Past ``hnsw_from`` live vectors a graph is built on a background thread from
    a copy of the vectors; searches stay exact until it is ready, then go through
    it (changes made meanwhile are replayed onto it first). Removed vectors are
    tombstones in the graph; past ``rebuild_at`` of it, a fresh graph is built
    the same way. Below ``hnsw_from // 2`` the index goes back to exact at once
    (the gap keeps an index at the boundary from flapping). Nothing a caller
    does waits for a build, unless ``background=False`` or :meth:`wait`.

    Not thread-safe: one lock around every call, as :class:`~kvmem.semantic.SemanticIndex` does.

    Args:
        dim: vector length.
        hnsw_from: live vectors above which search goes through a graph.
        m: as in :class:`HnswIndex`.
        ef_construction: as in :class:`HnswIndex`.
        ef_search: as in :class:`HnswIndex`.
        rebuild_at: tombstone fraction of the graph that starts a rebuild.
        background: build graphs on a thread (False: inside the call that needs one).
    """

    def __init__(
        self,
        dim: int,
        hnsw_from: int = 20_000,
        m: int = 32,
        ef_construction: int = 200,
        ef_search: int = 64,
        rebuild_at: float = 0.25,
        background: bool = True,
    ) -> None:
        if hnsw_from < 2:
            raise ValueError(f"hnsw_from={hnsw_from}: expected an int >= 2")
        if not 0.0 < rebuild_at < 1.0:
            raise ValueError(f"rebuild_at={rebuild_at}: expected a fraction in (0, 1)")
        self.dim, self.hnsw_from, self.rebuild_at, self.background = dim, hnsw_from, rebuild_at, background
        self.m, self.ef_construction, self.ef_search = m, ef_construction, ef_search
        self.version = 0  # bumped by every change; owners compare it to skip saving an unchanged graph
        self._index: ExactIndex | HnswIndex = ExactIndex(dim)
        self._build: _Build | None = None
        self._told_exact = False  # warned once that faiss is missing and search stays exact

    @property
    def kind(self) -> str:
        """``"exact"`` or ``"hnsw"``: what searches go through now."""
        self._adopt_if_done()
        return "hnsw" if isinstance(self._index, HnswIndex) else "exact"

    @property
    def building(self) -> bool:
        """Whether a graph is being built."""
        self._adopt_if_done()
        return self._build is not None

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, id_: object) -> bool:
        index = self._index
        return id_ in (index.live if isinstance(index, HnswIndex) else index)

    def add(self, ids: Sequence[str], vectors: np.ndarray) -> None:
        """See :meth:`~kvmem.semantic.index.VectorIndex.add`; may start a graph build."""
        ids = list(ids)
        vectors = checked_rows(ids, vectors, self.dim)
        self._adopt_if_done()
        self._index.add(ids, vectors)
        if self._build is not None:
            self._build.log.append((ids, vectors.copy()))
        self.version += 1
        self._plan()

    def remove(self, ids: Sequence[str]) -> int:
        """See :meth:`~kvmem.semantic.index.VectorIndex.remove`; may drop the graph or start a rebuild."""
        ids = list(ids)
        self._adopt_if_done()
        removed = self._index.remove(ids)
        if self._build is not None:
            self._build.log.append((ids, None))
        if removed:
            self.version += 1
        self._plan()
        return removed

    def search(self, vector: np.ndarray, k: int, allowed: Collection[str] | None = None) -> list[tuple[str, float]]:
        """See :meth:`~kvmem.semantic.index.VectorIndex.search`."""
        self._adopt_if_done()
        return self._index.search(vector, k, allowed)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a graph build in progress and let it serve; whether none is left running."""
        self.join(timeout)
        return not self.building

    def join(self, timeout: float | None = None) -> None:
        """Wait for a graph build in progress to finish, changing nothing (safe without the owner's lock)."""
        build = self._build
        if build is not None:
            build.wait(timeout)

    def _plan(self) -> None:
        """Go back to exact, or start a build, as the live count and the tombstones call for."""
        index = self._index
        if len(index) < self.hnsw_from // 2:
            self._build = None  # a running build finishes on its own thread; its graph is dropped
            if isinstance(index, HnswIndex):
                self._index = index.live
            return
        if self._build is not None:
            return
        if isinstance(index, ExactIndex):
            due, live = len(index) > self.hnsw_from, index
        else:
            due, live = index.tombstones > self.rebuild_at * (len(index) + index.tombstones), index.live
        if due and not HNSW_AVAILABLE:
            if not self._told_exact:
                log.warning("kvmem: %d vectors searched exactly; install faiss (kvmem[semantic])", len(index))
                self._told_exact = True
            return
        if due:
            self._build = _Build(live.copy(), self.m, self.ef_construction, self.ef_search)
            if not self.background:
                self.wait()

    def _adopt_if_done(self) -> None:
        """Replay the changes made during a finished build onto its graph, which then serves."""
        build = self._build
        if build is None or not build.wait(0):
            return
        self._build = None
        graph = build.graph
        if graph is None:
            return  # the build failed (logged); the next change that calls for one retries
        for ids, vectors in build.log:
            if vectors is None:
                graph.remove(ids)
            else:
                graph.add(ids, vectors)
        self._index = graph
        self.version += 1  # a new graph is worth saving though no entry changed

    def save(self, path: str | os.PathLike[str]) -> bool:
        """Save the serving graph as :meth:`HnswIndex.save` does; whether there was one.

        While exact there is nothing worth saving (rows are re-added in O(n)):
        files left at ``path`` by an earlier save are deleted.
        """
        self._adopt_if_done()
        if isinstance(self._index, HnswIndex):
            self._index.save(path)
            return True
        HnswIndex.delete_files(path)
        return False

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        ids: Sequence[str],
        vectors: np.ndarray,
        hnsw_from: int = 20_000,
        on_recovered: OnRecovered | None = None,
        **options: float,
    ) -> AutoIndex:
        """An index of ``ids``/``vectors``: the graph saved at ``path`` when it is current, else exact
        (with a graph build started when there are more than ``hnsw_from``).

        Args:
            path: what :meth:`save` was given.
            ids: unique ids the caller holds.
            vectors: float32 ``[len(ids), dim]``.
            hnsw_from: as in the constructor.
            on_recovered: told ``"hnsw"`` when a damaged graph was set aside (and rebuilt).
            options: the other constructor arguments.
        """
        vectors = np.asarray(vectors, dtype=np.float32)
        index = cls(vectors.shape[1], hnsw_from, **options)  # type: ignore[arg-type]
        big = len(ids) >= hnsw_from // 2 and HNSW_AVAILABLE
        saved = HnswIndex.load(path, ids, vectors, on_recovered) if big else None
        if saved is None:
            index.add(ids, vectors)
            return index
        saved.rebuild_at = None  # this owner rebuilds, off-thread
        index._index = saved
        index._plan()
        return index
