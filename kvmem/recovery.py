"""Metadata files that fail their check: moved aside (never deleted), logged and counted; the caller rebuilds.

The blobs in the tiers are self-describing (each carries its header and CRCs), so every
file kvmem keeps *about* them can be rebuilt: the disk tier's ``areas.json`` from its
directories, the SQLite catalog's entry rows from the blob headers
(:func:`kvmem.ops.maintenance.register_orphans`) and its rows of primary data (agent sessions,
LangGraph items and checkpoints) from their row records (:mod:`kvmem.catalog.mirror`), a
journal's lost lines the same way, an HNSW graph from the vectors in the catalog. A damaged one is renamed
``<name>.corrupt-<unix ns>`` in its own directory (with its companions: a database's
``-wal``/``-shm``, a graph's sidecar) so it can be inspected; ``kvmem doctor`` lists them
(:func:`set_aside_files`) and ``kvmem_recovered_files_total{file=...}`` counts them.

``file`` labels: ``areas`` (``disk/areas.json``), ``catalog`` (the SQLite catalog),
``journal`` (``catalog-pending/pending.*``), ``hnsw`` (``semantic/*.hnsw`` and sidecar).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from filelock import FileLock

__all__ = ["Damaged", "OnRecovered", "check_sqlite", "recover_sqlite", "set_aside", "set_aside_files"]

log = logging.getLogger(__name__)

OnRecovered = Callable[[str], None]  # told the label of each file set aside (``areas``, ``catalog``...)
MARK = ".corrupt-"
SQLITE_CHECK_SECONDS = 2.0  # quick_check is O(database); past this the file is taken as intact
_SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")
_CORRUPT_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})


class Damaged(Exception):
    """A metadata file's content fails its check (raised and caught inside kvmem, never by a public call)."""


def set_aside(
    path: Path,
    file: str,
    reason: str,
    on_recovered: OnRecovered | None = None,
    *,
    companions: Sequence[str] = (),
    still_damaged: Callable[[Path], str | None] | None = None,
) -> bool:
    """Rename the damaged ``path`` (and ``path`` + each of ``companions``) to ``<name>.corrupt-<ns>``.

    Args:
        path: the damaged file.
        file: its label in logs and in ``kvmem_recovered_files_total``.
        reason: what its check found.
        on_recovered: told ``file`` once the file is set aside.
        companions: suffixes of files that go with it (a database's ``-wal``).
        still_damaged: the check, run again holding a lock beside ``path``: another process may have
            set the file aside and rebuilt it meanwhile, and its rebuilt file must stay.

    Returns:
        Whether this call set the file aside (the caller rebuilds it either way when it is gone).
    """
    stamp = time.time_ns()
    with FileLock(path.with_name(f".{path.name}.lock")):
        if still_damaged is not None and still_damaged(path) is None:
            return False
        try:
            os.rename(path, path.with_name(f"{path.name}{MARK}{stamp}"))
        except FileNotFoundError:  # set aside by another process first
            return False
        for suffix in companions:
            try:
                os.rename(f"{path}{suffix}", f"{path}{suffix}{MARK}{stamp}")
            except FileNotFoundError:
                continue
    log.warning(
        "kvmem: %s file %s is damaged (%s); moved aside to %s%s%d and rebuilt",
        file,
        path,
        reason,
        path.name,
        MARK,
        stamp,
    )
    if on_recovered is not None:
        on_recovered(file)
    return True


def set_aside_files(root: Path) -> list[Path]:
    """Files set aside in ``root`` and its subdirectories one level down (where metadata lives), sorted."""
    pattern = f"*{MARK}*"
    return sorted([*root.glob(pattern), *root.glob(f"*/{pattern}")])


def check_sqlite(path: Path, seconds: float = SQLITE_CHECK_SECONDS) -> str | None:
    """What ``PRAGMA quick_check`` finds wrong with the SQLite database at ``path``; ``None``: intact.

    ``None`` also when the check cannot give a verdict: no file yet, an empty one, a check cut
    short after ``seconds``, a database locked or unreadable (an I/O error is the tier's failure,
    not damage: the engine reports it).
    """
    try:
        if path.stat().st_size == 0:
            return None
    except FileNotFoundError:
        return None
    try:
        conn = sqlite3.connect(path, timeout=seconds)
    except sqlite3.Error:  # cannot be opened (a directory, permissions): the engine reports it
        return None
    deadline = time.monotonic() + seconds
    try:
        conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        rows = conn.execute("PRAGMA quick_check(3)").fetchall()
    except sqlite3.Error as exc:
        return f"{exc.sqlite_errorname}: {exc}" if getattr(exc, "sqlite_errorcode", None) in _CORRUPT_CODES else None
    except ValueError as exc:  # text that is not UTF-8 (UnicodeDecodeError)
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return None if rows == [("ok",)] else "; ".join(str(row[0]) for row in rows)


def recover_sqlite(path: Path, on_recovered: OnRecovered | None = None) -> bool:
    """Set the SQLite database at ``path`` aside when :func:`check_sqlite` finds it damaged.

    Called before an engine opens it; the engine then creates a fresh database, whose rows the
    caller rebuilds. Whether it was set aside.
    """
    reason = check_sqlite(path)
    if reason is None:
        return False
    return set_aside(path, "catalog", reason, on_recovered, companions=_SQLITE_COMPANIONS, still_damaged=check_sqlite)
