"""Old import path of :mod:`kvmem.cli.table`, kept for one release; it goes in the next one.

Import from ``kvmem.cli.table`` instead.
"""

from kvmem.cli.table import format_percent, format_rate, render_table

__all__ = ["format_percent", "format_rate", "render_table"]
