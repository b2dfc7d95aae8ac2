"""Where the disk tier's blobs live: its active area, and the area a format migration fills.

An *area* is a directory of blob files under the disk tier's root (``blobs``,
``blobs.f2``...), all written in one blob format. ``areas.json`` in the root
records the active area and its format and, while ``kvmem migrate`` runs, the
target area and format. Every process sharing the root reads it; it is replaced
atomically (temporary file, fsync, rename, directory fsync), so a crash leaves
the old state or the new one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmem import blob as blobfmt
from kvmem.errors import ConfigError

__all__ = ["AreaState", "read_state", "write_state", "STATE_FILE"]

STATE_FILE = "areas.json"
_FIRST_AREA = "blobs"


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


def read_state(root: Path) -> AreaState:
    """The areas of the disk tier at ``root``; recorded on first use.

    NOTE: a root without ``areas.json`` but with blob files was written by a kvmem
    that knew one format only: format 1. A new root starts in the newest format.

    Raises:
        ConfigError: ``areas.json`` is not a state this kvmem can read.
    """
    path = root / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        state = AreaState(**data)
    except FileNotFoundError:
        legacy = any((root / _FIRST_AREA).glob("*/*.kvb"))
        state = AreaState(_FIRST_AREA, 1 if legacy else blobfmt.FORMAT_VERSION)
        write_state(root, state)
        return state
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a kvmem area state ({exc}); expected JSON with active, format, "
                          "target, target_format") from None
    for name in filter(None, (state.active, state.target)):
        if "/" in name or name.startswith(".") or not name.startswith(_FIRST_AREA):
            raise ConfigError(f"{path}: area name {name!r} is not one kvmem writes (blobs, blobs.fN)")
    for fmt in filter(lambda f: f is not None, (state.format, state.target_format)):
        if fmt not in blobfmt.FORMATS:
            raise ConfigError(f"{path}: blob format {fmt!r}; this kvmem reads {blobfmt.FORMATS}")
    return state


def write_state(root: Path, state: AreaState) -> None:
    """Replace ``root``'s area state atomically and durably."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{STATE_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(state), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / STATE_FILE)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
