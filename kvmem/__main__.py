"""``python -m kvmem``: the ``kvmem`` command line."""

import sys

from kvmem.cli import main

sys.exit(main())
