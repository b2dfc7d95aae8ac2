"""Old import path of :mod:`kvmem.catalog.journal`, kept for one release; it goes in the next one.

Import from ``kvmem.catalog.journal`` instead.
"""

from kvmem.catalog.journal import *  # noqa: F403  (the new module's public names, as before)
from kvmem.catalog.journal import __all__ as __all__
