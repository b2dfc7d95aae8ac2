"""Catalog writes the database missed, kept in a file until it takes them: a crash during an outage loses none.

Each catalog (one per ``Memory``) appends the upserts the database could not take
to ``<directory>/pending.<pid>.<id>.jsonl``, one JSON line per store (its own
version count of 1), and rewrites the file with what is still queued after each
flush that reached the database. A catalog that opens claims the files of
processes that are gone (renamed to its own name first, so two claimants never
both replay one file) and queues their rows again.

NOTE: lines are written and flushed to the OS, not fsynced: a killed process
loses nothing, a power cut may lose the last lines (the blobs themselves are in
the tiers; ``kvmem verify --fix`` registers entries the catalog lacks).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from kvmem.stores.files import pid_alive

__all__ = ["Journal"]

log = logging.getLogger(__name__)

Row = dict[str, Any]
_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)  # NOTE: made once: a store appends a line


class Journal:
    """One catalog's file of upserts the database missed.

    Args:
        directory: where journals live (created on first write).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / f"pending.{os.getpid()}.{uuid.uuid4().hex[:12]}.jsonl"
        self._fd = -1  # NOTE: kept open for appends (a store appends a line); reopened after a rewrite

    def append(self, rows: list[Row]) -> None:
        """Add ``rows`` (each one store) to the file; a file that cannot be written is logged, never raised."""
        data = "".join(_ENCODER.encode(row) + "\n" for row in rows).encode()
        try:
            if self._fd < 0:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(self._fd, data)
        except OSError as exc:  # NOTE: the rows stay queued in memory; only a crash now would lose them
            log.warning("kvmem: catalog journal %s cannot be written (%s)", self.path, exc)

    def rewrite(self, rows: list[Row]) -> None:
        """Replace the file with ``rows`` (what is still queued), atomically; remove it when there are none.

        NOTE: a crash between the database taking rows and this rewrite replays them once more: their
        stores are counted twice in ``version``, never lost.
        """
        self.close()
        try:
            if not rows:
                self.path.unlink(missing_ok=True)
                return
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(_ENCODER.encode(row) + "\n" for row in rows)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("kvmem: catalog journal %s cannot be rewritten (%s)", self.path, exc)

    def close(self) -> None:
        """Close the file (appends reopen it)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def claim_orphans(self) -> list[Row]:
        """Rows of journals whose process is gone, now appended to this one (their files removed)."""
        rows: list[Row] = []
        for path in sorted(self.directory.glob("pending.*")) if self.directory.is_dir() else []:
            owner = _owner(path.name)
            if path == self.path or owner is None or pid_alive(owner):
                continue
            claimed = path.with_name(f"{path.name.partition('.claimed.')[0]}.claimed.{os.getpid()}")
            try:
                os.rename(path, claimed)  # NOTE: atomic: of two processes opening at once, one gets the file
                found = _read(claimed)
            except OSError:  # NOTE: claimed by another process first, or unreadable: left for a later claimant
                continue
            self.append(found)  # NOTE: in this journal before the claimed file goes: a crash here loses nothing
            claimed.unlink()
            rows += found
        return rows


def _owner(name: str) -> int | None:
    """The pid whose journal ``name`` is: its claimant's (``….claimed.<pid>``), else its writer's; ``None``:
    not a journal (a temporary file)."""
    base, _, claimant = name.partition(".claimed.")
    writer = base.split(".")[1] if base.endswith(".jsonl") and base.count(".") == 3 else ""
    owner = claimant or writer
    return int(owner) if owner.isdigit() else None


def _read(path: Path) -> list[Row]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:  # NOTE: a line cut short by a crash mid-write: the store it records never returned
            log.warning("kvmem: %s line %d is not a whole record; skipped", path, n)
            continue
        if isinstance(row, dict) and isinstance(row.get("key"), str):
            rows.append(row)
    return rows
