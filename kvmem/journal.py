"""Old import path of :mod:`kvmem.catalog.journal`, kept for one release; it goes in the next one.

Import from ``kvmem.catalog.journal`` instead.
"""

from kvmem.catalog.journal import Journal

__all__ = ["Journal"]
