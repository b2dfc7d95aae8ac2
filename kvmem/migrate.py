"""Old import path of :mod:`kvmem.ops.migrate`, kept for one release; it goes in the next one.

Import from ``kvmem.ops.migrate`` instead.
"""

from kvmem.ops.migrate import MigrationReport, migrate_disk

__all__ = ["MigrationReport", "migrate_disk"]
