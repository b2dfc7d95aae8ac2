"""Old import path of :mod:`kvmem.ops.migrate`, kept for one release; it goes in the next one.

Import from ``kvmem.ops.migrate`` instead.
"""

from kvmem.ops.migrate import *  # noqa: F403  (the new module's public names, as before)
from kvmem.ops.migrate import __all__ as __all__
