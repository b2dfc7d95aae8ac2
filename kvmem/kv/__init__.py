"""Text KV reuse for transformers causal LMs: chunked, prefix-chained, fingerprinted."""

from kvmem.kv.fingerprint import model_fingerprint
from kvmem.kv.prefix import PrefillResult, PrefixCache

__all__ = ["PrefixCache", "PrefillResult", "model_fingerprint"]
