"""Old import path of :mod:`kvmem.catalog.records`, kept for one release; it goes in the next one.

Import from ``kvmem.catalog.records`` instead.
"""

from kvmem.catalog.records import *  # noqa: F403  (the new module's public names, as before)
from kvmem.catalog.records import __all__ as __all__
