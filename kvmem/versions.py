"""Old import path of :mod:`kvmem.catalog.versions`, kept for one release; it goes in the next one.

Import from ``kvmem.catalog.versions`` instead.
"""

from kvmem.catalog.versions import *  # noqa: F403  (the new module's public names, as before)
from kvmem.catalog.versions import __all__ as __all__
