"""Old import path of :mod:`kvmem.cli.demo`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.demo`` instead.
"""

from kvmem.cli.demo import *  # noqa: F403  (the new module's public names, as before)
from kvmem.cli.demo import __all__ as __all__
