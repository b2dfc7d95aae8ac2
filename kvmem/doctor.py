"""Old import path of :mod:`kvmem.cli.doctor`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.doctor`` instead.
"""

from kvmem.cli.doctor import (
    RULES,
    Finding,
    Severity,
    Snapshot,
    Thresholds,
    check,
    diagnose,
    format_number,
    render_findings,
    take_snapshot,
)

__all__ = [
    "RULES",
    "Finding",
    "Severity",
    "Snapshot",
    "Thresholds",
    "check",
    "diagnose",
    "format_number",
    "render_findings",
    "take_snapshot",
]
