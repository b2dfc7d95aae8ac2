"""Semantic lookup: entry texts embedded, indexed per namespace, strictly verified.

``Memory.store(..., text=...)`` indexes a text; ``Memory.lookup_similar`` finds
entries whose text means the same. Importing this package is cheap: the
embedding model (sentence-transformers) loads when the first text is embedded.
"""

from kvmem.semantic.auto import AutoIndex
from kvmem.semantic.cache import SemanticCache
from kvmem.semantic.embedder import (
           CachedEmbedder,
           Embedder,
           SentenceTransformerEmbedder,
           text_hash,
)
from kvmem.semantic.hnsw import HnswIndex, content_digest
from kvmem.semantic.index import ExactIndex, VectorIndex
from kvmem.semantic.layer import Match, SemanticIndex
from kvmem.semantic.verify import RuleVerifier, Verifier, differs, reason

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
           "content_digest",
           "differs",
           "reason",
           "text_hash",
]
