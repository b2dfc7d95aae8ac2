"""Semantic lookup: entry texts embedded, indexed per namespace, strictly verified.

``Memory.store(..., text=...)`` indexes a text; ``Memory.lookup_similar`` finds
entries whose text means the same. Importing this package is cheap: the
embedding model (sentence-transformers) loads when the first text is embedded.

The names here are the ones a user composes; helpers such as ``text_hash`` or the verifier's
``differs`` stay in their modules (:mod:`kvmem.semantic.embedder`, :mod:`kvmem.semantic.verify`).
"""

from kvmem.semantic.auto import AutoIndex
from kvmem.semantic.cache import SemanticCache
from kvmem.semantic.embedder import CachedEmbedder, Embedder, SentenceTransformerEmbedder
from kvmem.semantic.hnsw import HnswIndex
from kvmem.semantic.index import ExactIndex, VectorIndex
from kvmem.semantic.layer import Match, SemanticIndex
from kvmem.semantic.verify import RuleVerifier, Verifier

__all__ = [
    "AutoIndex",
    "CachedEmbedder",
    "Embedder",
    "ExactIndex",
    "HnswIndex",
    "Match",
    "RuleVerifier",
    "SemanticCache",
    "SemanticIndex",
    "SentenceTransformerEmbedder",
    "VectorIndex",
    "Verifier",
]
