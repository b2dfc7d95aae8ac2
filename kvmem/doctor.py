"""Old import path of :mod:`kvmem.cli.doctor`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.doctor`` instead.
"""

from kvmem.cli.doctor import *  # noqa: F403  (the new module's public names, as before)
from kvmem.cli.doctor import __all__ as __all__
