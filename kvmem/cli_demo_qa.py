"""Old import path of :mod:`kvmem.cli.demo_qa`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.demo_qa`` instead.
"""

from kvmem.cli.demo_qa import *  # noqa: F403  (the new module's public names, as before)
from kvmem.cli.demo_qa import __all__ as __all__
