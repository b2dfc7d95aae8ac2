"""What the benchmarks share about the machine: its filesystem, its load, its page cache."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

__all__ = ["filesystem_of", "load_average", "drop_page_cache"]


def filesystem_of(path: Path) -> str:
    """The filesystem type ``path`` lives on (from ``df``), or ``unknown``."""
    try:
        out = subprocess.run(
            ["df", "--output=fstype,source", str(path)], capture_output=True, text=True, check=True
        ).stdout.split("\n")[1]
        return " ".join(out.split())
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as printed beside every result."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def drop_page_cache(paths: Iterable[Path]) -> None:
    """Evict ``paths`` from the page cache (they must be clean: written and synced)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
