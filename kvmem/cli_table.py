"""Old import path of :mod:`kvmem.cli.table`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.table`` instead.
"""

from kvmem.cli.table import *  # noqa: F403  (the new module's public names, as before)
from kvmem.cli.table import __all__ as __all__
