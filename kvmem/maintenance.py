"""Old import path of :mod:`kvmem.ops.maintenance`, kept for one release; it goes in the next one.

Import from ``kvmem.ops.maintenance`` instead.
"""

from kvmem.ops.maintenance import GcReport, VerifyReport, collect_garbage, register_orphans, verify_entries

__all__ = ["GcReport", "VerifyReport", "collect_garbage", "register_orphans", "verify_entries"]
