"""Old import path of :mod:`kvmem.codecs.serialization`, kept for one release; it goes in the next one.

Import from ``kvmem.codecs.serialization`` instead.
"""

from kvmem.codecs.serialization import *  # noqa: F403  (the new module's public names, as before)
from kvmem.codecs.serialization import __all__ as __all__
