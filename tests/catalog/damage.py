"""Damage made for real to a closed SQLite catalog file: what the tests of a rebuilt catalog start from."""

from __future__ import annotations

import random
from pathlib import Path

from kvmem.recovery import check_sqlite

FAULTS = ("magic", "pages", "halved", "emptied")
"""``magic``: its first 16 bytes overwritten; ``pages``: 64 bytes past its header flipped; ``halved``: cut to
half its size; ``emptied``: cut to nothing (a new database to SQLite, not damage: no check can tell)."""


def damage_sqlite(path: Path, fault: str) -> None:
    """Damage the closed SQLite database ``path`` with ``fault`` (one of :data:`FAULTS`), and check that the
    check a catalog runs before opening it finds the damage (``emptied``: finds nothing, as SQLite sees none)."""
    assert not Path(f"{path}-wal").exists()  # closed: every row is in the file itself
    data = bytearray(path.read_bytes())
    if fault == "magic":
        data[:16] = b"\xff" * 16
    elif fault == "pages":
        rng = random.Random(3)
        for _ in range(64):
            data[rng.randrange(100, len(data))] ^= 0xFF
    elif fault == "halved":
        del data[len(data) // 2 :]
    elif fault == "emptied":
        data.clear()
    else:
        raise ValueError(f"fault {fault!r}: expected one of {FAULTS}")
    path.write_bytes(bytes(data))
    assert (check_sqlite(path) is None) == (fault == "emptied"), fault
