"""Old import path of :mod:`kvmem.stores.paged`, kept for one release; it goes in the next one.

Import from ``kvmem.stores.paged`` instead.
"""

from kvmem.stores.paged import *  # noqa: F403  (the new module's public names, as before)
from kvmem.stores.paged import __all__ as __all__
