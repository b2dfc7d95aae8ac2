"""Old import path of :mod:`kvmem.kv.background`, kept for one release; it goes in the next one.

Import from ``kvmem.kv.background`` instead.
"""

from kvmem.kv.background import *  # noqa: F403  (the new module's public names, as before)
from kvmem.kv.background import __all__ as __all__
