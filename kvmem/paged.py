"""Old import path of :mod:`kvmem.stores.paged`, kept for one release; it goes in the next one.

Import from ``kvmem.stores.paged`` instead.
"""

from kvmem.stores.paged import BlockError, BlockPool, BlockTable, FreeBlockQueue, PagedBuffer

__all__ = ["BlockError", "BlockPool", "BlockTable", "FreeBlockQueue", "PagedBuffer"]
