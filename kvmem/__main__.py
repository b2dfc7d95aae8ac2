"""``python -m kvmem``: the ``kvmem`` command line."""

import sys

from kvmem.cli.main import main

sys.exit(main())
