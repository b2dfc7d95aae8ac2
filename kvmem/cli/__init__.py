"""The ``kvmem`` command line (:mod:`~kvmem.cli.main`), its demos, tables and ``kvmem doctor``.

The names below are the old ``kvmem.cli`` module's, kept for one release; they go in the next
one. Import from :mod:`kvmem.cli.main` instead.
"""

from kvmem.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
