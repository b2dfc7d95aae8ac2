"""Where the disk tier's blobs live: its active area, and the area a format migration fills.

An *area* is a directory of blob files under the disk tier's root (``blobs``,
``blobs.f2``...), all written in one blob format. ``areas.json`` in the root
records the active area and its format and, while ``kvmem migrate`` runs, the
target area and format, with a sha256 of them. Every process sharing the root
reads it; it is replaced atomically (temporary file, fsync, rename, directory
fsync), so a crash leaves the old state or the new one. A file that fails its
checksum is set aside and rebuilt from the directories (see :mod:`kvmem.recovery`).

:class:`DiskAreas` is what a format migration (:mod:`kvmem.ops.migrate`) does with a
disk tier's areas beyond serving entries: list one, write into one without
overwriting, switch the state.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob
from kvmem.errors import ConfigError, IntegrityError
from kvmem.fsutil import write_atomic
from kvmem.keys import is_storage_key
from kvmem.recovery import Damaged, OnRecovered, set_aside
from kvmem.stores import files

if TYPE_CHECKING:
    from kvmem.stores.disk import DiskTier

__all__ = [
    "AreaState",
    "DiskAreas",
    "entry_file",
    "read_state",
    "scan_area",
    "state_from_directories",
    "write_state",
    "STATE_FILE",
    "SUFFIX",
]

STATE_FILE = "areas.json"
_FIRST_AREA = "blobs"
_AREA_NAME = re.compile(r"blobs(\.f[0-9]+)?")
SUFFIX = ".kvb"
_CHECKSUM = "sha256"  # of the other fields, as sorted JSON: a flipped byte is found, not trusted


@dataclass(frozen=True)
class AreaState:
    """The disk tier's areas.

    Attributes:
        active: the area readers trust, e.g. ``blobs``.
        format: the blob format of ``active``.
        target: during a migration, the area being filled (read first, written to); else ``None``.
        target_format: the blob format of ``target``.
    """

    active: str
    format: int
    target: str | None = None
    target_format: int | None = None

    @property
    def write_area(self) -> str:
        """Where new entries go: the target during a migration, else the active area."""
        return self.target or self.active

    @property
    def write_format(self) -> int:
        """The blob format new entries are written in."""
        return self.target_format if self.target_format is not None else self.format

    @property
    def reading_order(self) -> tuple[str, ...]:
        """Areas to look in, newest first."""
        return (self.target, self.active) if self.target else (self.active,)

    def migrating_to(self, blob_format: int) -> AreaState:
        """This state with a migration to ``blob_format`` begun (into a fresh area name)."""
        return AreaState(self.active, self.format, f"{_FIRST_AREA}.f{blob_format}", blob_format)

    def switched(self) -> AreaState:
        """This state with its migration finished: the target becomes the active area."""
        assert self.target is not None and self.target_format is not None
        return AreaState(self.target, self.target_format)


_FIELDS = ("active", "format", "target", "target_format")


def read_state(root: Path, on_recovered: OnRecovered | None = None) -> AreaState:
    """The areas of the disk tier at ``root``; recorded on first use, rebuilt when damaged.

    A root without ``areas.json`` (or whose ``areas.json`` fails its checksum and is
    set aside, see :mod:`kvmem.recovery`) is described from its directories
    (:func:`state_from_directories`).

    Args:
        root: the disk tier's root.
        on_recovered: told ``"areas"`` when a damaged ``areas.json`` was set aside.

    Raises:
        ConfigError: ``areas.json`` is intact but names a blob format this kvmem cannot read (a newer kvmem's).
    """
    path = root / STATE_FILE
    try:
        return _load(path)
    except FileNotFoundError:
        pass
    except Damaged as exc:
        set_aside(path, "areas", str(exc), on_recovered, still_damaged=_damage)
        try:
            return _load(path)  # rebuilt by another process meanwhile
        except (FileNotFoundError, Damaged):
            pass
    state = state_from_directories(root)
    write_state(root, state)
    return state


def _load(path: Path) -> AreaState:
    """The state in ``path``.

    Raises:
        FileNotFoundError: no such file.
        Damaged: not JSON, another shape, a checksum that does not match, an area kvmem never names.
        ConfigError: intact, but in a blob format this kvmem does not read.
    """
    try:
        data = json.loads(path.read_bytes())
        fields = {name: data[name] for name in _FIELDS}
        state = AreaState(**fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise Damaged(f"not an area state: {exc}") from None
    checksum = data.get(_CHECKSUM)  # NOTE: absent in files written before it was added
    if checksum is not None and checksum != _checksum(fields):
        raise Damaged(f"{_CHECKSUM} {str(checksum)[:16]!r} does not match its content")
    if (state.target is None) != (state.target_format is None):
        raise Damaged(f"target {state.target!r} with target_format {state.target_format!r}")
    for name in (state.active, state.target) if state.target is not None else (state.active,):
        if not isinstance(name, str) or not _AREA_NAME.fullmatch(name):
            raise Damaged(f"area name {name!r} is not one kvmem writes (blobs, blobs.fN)")
    for fmt in (state.format, state.target_format) if state.target is not None else (state.format,):
        if fmt not in blobfmt.FORMATS:
            if checksum is None:
                raise Damaged(f"blob format {fmt!r}")
            raise ConfigError(f"{path}: blob format {fmt!r}; this kvmem reads {blobfmt.FORMATS}")
    return state


def _damage(path: Path) -> str | None:
    """Why ``path`` is damaged, or ``None`` (intact, or gone)."""
    try:
        _load(path)
    except Damaged as exc:
        return str(exc)
    except (FileNotFoundError, ConfigError):
        return None
    return None


def state_from_directories(root: Path) -> AreaState:
    """The areas ``root``'s directories show: those holding entries, each in the format its blobs are in.

    One area: the active one. Two or more: a migration was under way; the one written
    last is taken as its target (both are read, newest first, so every entry stays served),
    and the one written before it as the active area. None: a fresh ``blobs`` in the newest format.
    """
    found = sorted((newest, name) for name, newest in _areas(root).items())
    if not found:
        return AreaState(_FIRST_AREA, blobfmt.FORMAT_VERSION)
    active = found[-2][1] if len(found) > 1 else found[-1][1]
    target = found[-1][1] if len(found) > 1 else None
    return AreaState(
        active, _area_format(root / active), target, _area_format(root / target) if target is not None else None
    )


def _areas(root: Path) -> dict[str, int]:
    """Area name -> mtime (ns) of its newest entry file, for the areas under ``root`` holding one."""
    areas: dict[str, int] = {}
    for area in root.iterdir() if root.is_dir() else []:
        if _AREA_NAME.fullmatch(area.name) and area.is_dir():
            times = [f.stat().st_mtime_ns for f in area.glob(f"*/*{SUFFIX}")]
            if times:
                areas[area.name] = max(times)
    return areas


def _area_format(area: Path) -> int:
    """The blob format of ``area``: named in it (``blobs.f2``), else read off one of its blobs' prefix.

    NOTE: a ``blobs`` area none of whose blobs has a readable prefix was written by a kvmem that
    knew one format only (before ``areas.json``): format 1.
    """
    if area.name != _FIRST_AREA:
        return int(area.name.removeprefix(f"{_FIRST_AREA}.f"))
    for blob in area.glob(f"*/*{SUFFIX}"):
        try:
            with open(blob, "rb") as f:
                return blobfmt.format_of(np.frombuffer(f.read(blobfmt.HEAD_PROBE), dtype=np.uint8))[0]
        except (OSError, IntegrityError):  # a damaged blob says nothing; the next one may
            continue
    return 1


def _checksum(fields: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def write_state(root: Path, state: AreaState) -> None:
    """Replace ``root``'s area state atomically and durably."""
    fields = asdict(state)
    write_atomic(root / STATE_FILE, json.dumps({**fields, _CHECKSUM: _checksum(fields)}), durable=True)


def entry_file(directory: str, key: str) -> str:
    """``key``'s file in the area ``directory`` (ending in a separator; a string join costs less than pathlib
    on the read path). Only storage keys map to a file.

    Raises:
        ValueError: ``key`` is not a storage key (64 hex digits).
    """
    if not is_storage_key(key):
        raise ValueError(f"DiskTier key {key[:80]!r}: expected a storage key of 64 hex digits")
    return f"{directory}{key[:2]}{os.sep}{key}{SUFFIX}"


def scan_area(area: Path, clean_tmp: bool) -> list[tuple[int, str, int]]:
    """``(mtime, key, size)`` of every entry file in ``area``, oldest first; with ``clean_tmp``, temporary files
    left by crashed writers are removed on the way."""
    found: list[tuple[int, str, int]] = []
    if not area.is_dir():
        return found
    for shard in area.iterdir():
        if not shard.is_dir():
            continue
        for entry in os.scandir(shard):
            if entry.name.endswith(".tmp"):
                if clean_tmp:
                    files.remove_stray_tmp(entry)
            elif entry.name.endswith(SUFFIX) and is_storage_key(entry.name[: -len(SUFFIX)]):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # deleted by another process while we scanned
                found.append((st.st_mtime_ns, entry.name[: -len(SUFFIX)], st.st_size))
    return sorted(found)


class DiskAreas:
    """A disk tier's areas as a format migration works on them (the tier itself serves entries from them).

    Args:
        disk: the disk tier; other processes may share its root.
    """

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self.root = disk.root

    @property
    def state(self) -> AreaState:
        """The areas as the disk tier last read them."""
        return self.disk.areas

    def set_state(self, state: AreaState) -> None:
        """Record ``state`` for every process sharing the root (atomically), and make the disk tier follow it."""
        write_state(self.root, state)
        self.disk.refresh_areas()

    def keys(self, area: str) -> list[str]:
        """Keys with a file in ``area``, least recently used first."""
        return [key for _mtime, key, _size in scan_area(self.root / area, clean_tmp=False)]

    def path(self, area: str, key: str) -> Path:
        """Where ``key``'s file lives in ``area``."""
        return Path(entry_file(os.fspath(self.root / area) + os.sep, key))

    def put_new(self, area: str, key: str, blob: EncodedBlob) -> int | None:
        """Write ``blob`` as ``key``'s file in ``area`` unless it has one; the new file's inode, or ``None``.

        NOTE: ``link`` commits the file only if the name is free, atomically: a migration
        never overwrites an entry a writer put into the target area meanwhile.
        """
        path = self.path(area, key)
        tmp = files.write_tmp(path, key, blob, fsync=self.disk.fsync == "always")
        try:
            os.link(tmp, path)
            return os.stat(tmp).st_ino
        except FileExistsError:
            return None
        finally:
            tmp.unlink(missing_ok=True)
