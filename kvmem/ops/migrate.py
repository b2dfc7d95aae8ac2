"""Online blob-format migration of the disk tier (``kvmem migrate --to-format N``).

While entries are served, every entry of the disk tier's active area is rewritten
in the new format into a second area (the target), hottest first (catalog hits);
then the target becomes the active area, atomically (``areas.json``), and the old
area is removed. Throughout, readers look in the target first and then in the
active area, so no entry that exists in either is missed; writers put new entries
into the target, already in the new format.

Resumable: the migration is recorded in ``areas.json`` before the first copy, each
copy is committed by an atomic ``link``, and a run that finds a migration under way
carries on with it, skipping what is already in the target.

Races, and what settles them:

- an entry written while it is copied: the writer's file is in the target (or is
  moved there by the writer, see :meth:`DiskTier.put`); the copy is committed only if
  the target has no file of that name, so the newer entry wins;
- an entry deleted while it is copied: a delete removes the active area's file
  first; the migration checks, after committing its copy, that the source is still
  there, and takes its copy back if not;
- an entry written into the old area by a process that had not yet seen the
  migration begin, or switch: passes over the old area after the switch carry it.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvmem import blob as blobfmt
from kvmem.catalog.catalog import Catalog
from kvmem.codecs.serialization import reframe
from kvmem.errors import ConfigError, IntegrityError
from kvmem.stores.areas import AreaState, DiskAreas
from kvmem.stores.disk import DiskTier

__all__ = ["MigrationReport", "migrate_disk"]

log = logging.getLogger(__name__)

_SWITCH_GRACE = 1.0  # seconds between the switch and the old area's removal: writes that began before it land
_CRC_BATCH = 256  # catalog CRC updates written per transaction


@dataclass
class MigrationReport:
    """What ``migrate`` did.

    Attributes:
        to_format: the blob format of the disk tier now.
        area: the active area now (e.g. ``blobs.f2``).
        migrated: entries rewritten into the new area by this run.
        present: entries already there (written meanwhile, or by an earlier, interrupted run).
        vanished: entries deleted while they were being copied.
        corrupt: entries that failed their CRC; not carried over (a load of them misses, as before).
        resumed: whether this run finished a migration an earlier run had begun.
    """

    to_format: int
    area: str
    migrated: int = 0
    present: int = 0
    vanished: int = 0
    corrupt: int = 0
    resumed: bool = False


def migrate_disk(disk: DiskTier, catalog: Catalog, to_format: int, progress: bool = True) -> MigrationReport:
    """Rewrite ``disk``'s entries in blob format ``to_format`` while they are served; see the module docs.

    Args:
        disk: the disk tier (any process may share its root meanwhile).
        catalog: where hit counts order the work (hottest first) and entry CRCs are updated.
        to_format: one of :data:`kvmem.blob.FORMATS`.
        progress: show a progress bar.

    Raises:
        ConfigError: ``to_format`` is unknown, or a migration to another format is under way.
    """
    if to_format not in blobfmt.FORMATS:
        raise ConfigError(f"to_format={to_format!r}: accepted {', '.join(map(str, blobfmt.FORMATS))}")
    disk.rescan()
    areas = DiskAreas(disk)
    state = areas.state
    report = MigrationReport(to_format, state.active, resumed=state.target is not None)
    if state.target is None:
        if state.format == to_format:
            return report
        state = state.migrating_to(to_format)
        assert state.target is not None
        shutil.rmtree(disk.root / state.target, ignore_errors=True)  # never active: an abandoned area
        areas.set_state(state)
    elif state.target_format != to_format:
        raise ConfigError(
            f"to_format={to_format}: a migration to format {state.target_format} is under way in "
            f"{disk.root}; finish it first (kvmem migrate --to-format {state.target_format})"
        )
    copier = _Copier(areas, catalog, state, report)
    copier.carry(_hottest_first(areas, catalog, state.active), progress)
    while copier.carry(copier.left_behind(), progress=False):
        pass  # entries a process put into the old area before it saw the migration begin
    areas.set_state(state.switched())
    time.sleep(_SWITCH_GRACE)
    copier.carry(copier.left_behind(), progress=False)  # written before the switch, seen after it
    copier.flush()
    shutil.rmtree(disk.root / state.active, ignore_errors=True)
    report.area = areas.state.active
    return report


def _hottest_first(areas: DiskAreas, catalog: Catalog, area: str) -> list[str]:
    """Keys of ``area``: by catalog hits, most first; then those the catalog does not know, most recent first."""
    held = areas.keys(area)
    known = set(held)
    order = [key for key in catalog.keys(hottest_first=True) if key in known]  # keys only, no row bodies
    listed = set(order)
    return order + [key for key in reversed(held) if key not in listed]


class _Copier:
    """Carries entries from the active area into the target, one verified, reframed copy each."""

    def __init__(self, areas: DiskAreas, catalog: Catalog, state: AreaState, report: MigrationReport) -> None:
        assert state.target is not None and state.target_format is not None
        self.areas, self.catalog, self.report = areas, catalog, report
        self.source, self.target, self.format = state.active, state.target, state.target_format
        self._crcs: list[tuple[str, int, int]] = []

    def left_behind(self) -> list[str]:
        """Keys with a file in the old area and none in the target."""
        return [key for key in self.areas.keys(self.source) if not self.areas.path(self.target, key).exists()]

    def carry(self, keys: list[str], progress: bool) -> int:
        """Copy each of ``keys`` the target lacks; how many were copied."""
        done = 0
        for key in tqdm(keys, desc=f"kvmem migrate -> format {self.format}", unit="entry", disable=not progress):
            if self.areas.path(self.target, key).exists():
                self.report.present += 1
                continue
            done += self._carry_one(key)
            if len(self._crcs) >= _CRC_BATCH:
                self.flush()
        return done

    def _carry_one(self, key: str) -> int:
        source = self.areas.path(self.source, key)
        try:
            buf = torch.frombuffer(bytearray(source.read_bytes()), dtype=torch.uint8)
        except FileNotFoundError:
            self.report.vanished += 1
            return 0
        try:
            fresh = reframe(buf, self.format, blobfmt.verify(buf))
        except IntegrityError as exc:
            log.warning("kvmem: migrate: entry %s is corrupt (%s); not carried over", key, exc)
            self.report.corrupt += 1
            return 0
        inode = self.areas.put_new(self.target, key, fresh)
        if inode is None:
            self.report.present += 1  # NOTE: a writer put a newer entry there meanwhile: it wins
            return 0
        if not source.exists():
            _take_back(self.areas.path(self.target, key), inode)  # deleted while copied: never resurrect it
            self.report.vanished += 1
            return 0
        self._crcs.append((key, blobfmt.stored_crc(buf), fresh.crc))
        self.report.migrated += 1
        return 1

    def flush(self) -> None:
        """Record the new blobs' CRCs in the catalog (rows still naming the old blob only)."""
        if self._crcs:
            self.catalog.replace_crcs(self._crcs)
            self._crcs = []


def _take_back(path: Path, inode: int) -> None:
    """Remove the copy at ``path`` if it is still ours (inode ``inode``), not a writer's newer entry."""
    try:
        if path.stat().st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass  # deleted by the same delete (it removes the target's file after the source's)
