"""Old import path of :mod:`kvmem.ops.maintenance`, kept for one release; it goes in the next one.

Import from ``kvmem.ops.maintenance`` instead.
"""

from kvmem.ops.maintenance import *  # noqa: F403  (the new module's public names, as before)
from kvmem.ops.maintenance import __all__ as __all__
