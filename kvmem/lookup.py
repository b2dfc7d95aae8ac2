"""``SemanticLookup``: :class:`~kvmem.api.Memory`'s side of the semantic layer, mixed into it.

The texts given to ``store(text=...)`` are indexed by :class:`~kvmem.semantic.SemanticIndex`;
these operations find entries by meaning, drop the hits no tier holds any more, and hand back
each hit's key, metadata and storage key. NOTE: it lives beside the core, not in
:mod:`kvmem.semantic`: it reads the memory's tiers and catalog rows, which that feature layer
never reaches (``tests/test_ports.py``), and ``import kvmem`` does not load that package (faiss).
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from kvmem.core import MemoryCore

if TYPE_CHECKING:  # kvmem.semantic loads only when a text is stored or looked up
    from kvmem.semantic import Embedder, Match, SemanticIndex

__all__ = ["SemanticLookup"]


class SemanticLookup(MemoryCore):
    """Semantic lookup over a memory's indexed texts (a part of :class:`~kvmem.api.Memory`)."""

    def semantic_index(self, embedder: Embedder | None = None) -> SemanticIndex:
        """A semantic index, built (embedder loaded, index read back) on first use.

        Args:
            embedder: None: the text layer (``store(text=)``, :meth:`lookup_similar`) with this
                memory's embedder. Another embedder (e.g. an image encoder's, see
                :mod:`kvmem.multimodal`) gets its own index, one per embedder name; each
                follows the store's deletes and evictions.
        """
        slot = "" if embedder is None else embedder.name
        with self._semantic_lock:
            index = self._semantics.get(slot)
            if index is None:
                from kvmem.semantic import SemanticIndex

                index = self._semantics[slot] = SemanticIndex(
                    self._catalog,
                    self._embedder if embedder is None else embedder,
                    live=self._tiers.contains_many if self._sees_every_entry else None,
                    directory=Path(self.config.path) / "semantic",
                    hnsw_from=self.config.semantic_hnsw_from,
                    on_recovered=self._file_recovered,
                )
            return index

    def lookup_similar(
        self,
        query: str,
        k: int = 3,
        *,
        namespace: str | None = None,
        threshold: float | None = None,
        verify: bool = True,
    ) -> list[Match]:
        """Entries of ``namespace`` whose indexed text means the same as ``query``, best first.

        Only ``namespace`` is searched, never another. A candidate counts when its cosine
        score is at least ``threshold`` and, with ``verify``, the strict verifier finds no
        differing number, unit, negation, opposite, name, argument order, direction or
        swapped word (see :mod:`kvmem.semantic.verify`). Entries no tier holds any more are
        dropped from the index.

        Args:
            query: the text to match.
            k: most matches returned.
            namespace: the namespace given to :meth:`~kvmem.Memory.store`.
            threshold: cosine floor (inclusive); default: the embedder's calibrated one.
            verify: apply the strict verifier (on by default).

        Returns:
            ``Match(key, score, text, metadata, namespace, storage_key)`` list; ``key`` is the key given
            to :meth:`~kvmem.Memory.store`, and :meth:`~kvmem.Memory.load_match` loads a match's value.
        """
        from kvmem.semantic import Match

        index = self.semantic_index()
        matches: list[Match] = []
        self._catalog_write(self._catalog.flush_all)  # rows of stores still queued (write-behind) are read
        ns = namespace or ""
        for skey, score, text in index.search(query, ns, k, threshold, verify):
            if not self._tiers.contains(skey):  # NOTE: evicted from every tier: never a dangling hit
                if self._sees_every_entry:  # else another node may hold it: its row stays
                    index.remove(skey)
                continue
            row = self._catalog_write(functools.partial(self._catalog.get, skey))
            matches.append(
                Match(
                    index.user_key(skey),
                    score,
                    text,
                    row.metadata if row is not None else {},
                    namespace=ns,
                    storage_key=skey,
                )
            )
        return matches

    async def alookup_similar(
        self,
        query: str,
        k: int = 3,
        *,
        namespace: str | None = None,
        threshold: float | None = None,
        verify: bool = True,
    ) -> list[Match]:
        """:meth:`lookup_similar` in a worker thread: the event loop goes on while the query is embedded."""
        return await asyncio.to_thread(
            self.lookup_similar, query, k, namespace=namespace, threshold=threshold, verify=verify
        )
