"""Catalog writes the database missed, kept in a file until it takes them: a crash during an outage loses none.

Each catalog (one per ``Memory``) appends the upserts the database could not take
to ``<directory>/pending.<pid>.<id>.jsonl``, one line per store (its own version
count of 1): the row as JSON, a tab, and the CRC32 of the JSON in 8 hex digits.
It rewrites the file with what is still queued after each flush that reached the
database. A catalog that opens claims the files of
processes that are gone (renamed to its own name first, so two claimants never
both replay one file) and queues their rows again. A line that fails its CRC (or
is not JSON, or not UTF-8) is skipped; a file holding one is set aside, not
removed (see :mod:`kvmem.recovery`); the stores it records are registered again
from their blobs' headers. A last line without its newline is a write a crash cut
short (its store never returned): skipped, not damage.

NOTE: lines are written and flushed to the OS, not fsynced: a killed process
loses nothing, a power cut may lose the last lines (the blobs themselves are in
the tiers; ``kvmem verify --fix`` registers entries the catalog lacks).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
import zlib
from pathlib import Path
from typing import Any

from kvmem.fsutil import write_atomic
from kvmem.recovery import OnRecovered, set_aside
from kvmem.stores.files import pid_alive

__all__ = ["Journal"]

log = logging.getLogger(__name__)

Row = dict[str, Any]
_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)  # made once: a store appends a line


class Journal:
    """One catalog's file of upserts the database missed.

    Args:
        directory: where journals live (created on first write).
        on_recovered: told ``"journal"`` when a claimed journal with damaged lines is set aside.
    """

    def __init__(self, directory: Path, on_recovered: OnRecovered | None = None) -> None:
        self.directory = directory
        self._on_recovered = on_recovered
        self.path = directory / f"pending.{os.getpid()}.{uuid.uuid4().hex[:12]}.jsonl"
        self._fd = -1  # kept open for appends (a store appends a line); reopened after a rewrite

    def append(self, rows: list[Row]) -> None:
        """Add ``rows`` (each one store) to the file; a file that cannot be written is logged, never raised."""
        data = "".join(map(_line, rows)).encode()
        try:
            if self._fd < 0:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(self._fd, data)
        except OSError as exc:  # the rows stay queued in memory; only a crash now would lose them
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
            write_atomic(self.path, "".join(map(_line, rows)), durable=False)
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
                found, damaged = _read(claimed)
            except OSError:  # claimed by another process first, or unreadable: left for a later claimant
                continue
            self.append(found)  # NOTE: in this journal before the claimed file goes: a crash here loses nothing
            if damaged:
                set_aside(claimed, "journal", damaged, self._on_recovered)
            else:
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


def _line(row: Row) -> str:
    """``row`` as one journal line: JSON, a tab, the JSON's CRC32 (the JSON never holds a raw tab)."""
    text = _ENCODER.encode(row)
    return f"{text}\t{zlib.crc32(text.encode()):08x}\n"


def _read(path: Path) -> tuple[list[Row], str]:
    """The rows of the journal at ``path``, and what was damaged in it (empty: nothing).

    NOTE: lines without a tab were written before lines carried a CRC: taken if they parse.
    """
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines[-1]:  # NOTE: a line cut short by a crash mid-write: the store it records never returned
        log.warning("kvmem: %s ends in a line that is not a whole record; skipped", path)
    rows, bad = [], []
    for n, raw in enumerate(lines[:-1], 1):
        row = _row(raw)
        if row is None:
            bad.append(n)
        else:
            rows.append(row)
    return rows, f"line(s) {', '.join(map(str, bad[:5]))} fail their CRC or are not records" if bad else ""


def _row(raw: bytes) -> Row | None:
    """The row on one journal line, or ``None`` when the line is damaged."""
    text, tab, crc = raw.partition(b"\t")
    if tab and crc != b"%08x" % zlib.crc32(text):
        return None
    try:
        row = json.loads(text)
    except ValueError:  # also text that is not UTF-8
        return None
    return row if isinstance(row, dict) and isinstance(row.get("key"), str) else None
