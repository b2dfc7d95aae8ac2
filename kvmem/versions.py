"""Old import path of :mod:`kvmem.catalog.versions`, kept for one release; it goes in the next one.

Import from ``kvmem.catalog.versions`` instead.
"""

from kvmem.catalog.versions import Pin, Versions

__all__ = ["Pin", "Versions"]
