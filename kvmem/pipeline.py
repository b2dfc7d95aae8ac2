"""Old import path of :mod:`kvmem.kv.background`, kept for one release; it goes in the next one.

Import from ``kvmem.kv.background`` instead.
"""

from kvmem.kv.background import Prefetcher, WriteBehind

__all__ = ["Prefetcher", "WriteBehind"]
