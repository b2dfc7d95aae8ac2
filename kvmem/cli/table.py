"""Plain-text tables and number formats for the ``kvmem`` command line."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["format_percent", "format_rate", "render_table"]

_NUMBER_WITH_UNIT = re.compile(r"^(-|-?[0-9][0-9.,]*( ?[A-Za-z]+|%)?)$")  # "12", "4.0 MiB", "69.5%", "-"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, indent: str = "") -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned.

    Args:
        headers: column titles.
        rows: cells (anything ``str()`` can print); a column of numbers (or of strings such as
            ``"4.0 MiB"``, ``"69.5%"``, ``"-"``) aligns right.
        indent: prefix of every line.

    Returns:
        The table, header line, a rule, then one line per row (no trailing newline).
    """
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = [bool(rows) and all(_numeric(row[i]) for row in rows) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _numeric(value: object) -> bool:
    return isinstance(value, (int, float)) or _NUMBER_WITH_UNIT.match(str(value)) is not None


def format_rate(nbytes: float, seconds: float) -> str:
    """Throughput in decimal GB/s (``"-"`` when nothing was timed)."""
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "-"


def format_percent(part: float, whole: float) -> str:
    """``part / whole`` as a percentage with one decimal (``"-"`` when ``whole`` is 0)."""
    return f"{100 * part / whole:.1f}%" if whole else "-"
