"""Text KV reuse for transformers causal LMs: chunked, prefix-chained, fingerprinted; documents in any order."""

from kvmem.kv.blend import SUPPORTED_ROPE_TYPES, BlendCache, BlendResult, Segment
from kvmem.kv.fingerprint import model_fingerprint
from kvmem.kv.patterns import Prediction, RequestPatterns
from kvmem.kv.predict import PredictivePrefetcher
from kvmem.kv.prefix import PrefillResult, PrefixCache

__all__ = [
    "BlendCache",
    "BlendResult",
    "Prediction",
    "PredictivePrefetcher",
    "PrefixCache",
    "RequestPatterns",
    "PrefillResult",
    "SUPPORTED_ROPE_TYPES",
    "Segment",
    "model_fingerprint",
]
