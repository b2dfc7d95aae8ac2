"""The ``kvmem`` command line (:mod:`~kvmem.cli.main`), its demos, tables and ``kvmem doctor``."""
