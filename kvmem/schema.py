"""Old import path of :mod:`kvmem.catalog.schema`, kept for one release; it goes in the next one.

Import from ``kvmem.catalog.schema`` instead.
"""

from kvmem.catalog.schema import *  # noqa: F403  (the new module's public names, as before)
from kvmem.catalog.schema import __all__ as __all__
