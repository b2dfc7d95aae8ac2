"""Old import path of :mod:`kvmem.cli.doctor_snapshot`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.doctor_snapshot`` instead.
"""

from kvmem.cli.doctor_snapshot import *  # noqa: F403  (the new module's public names, as before)
from kvmem.cli.doctor_snapshot import __all__ as __all__
