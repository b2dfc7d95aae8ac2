"""The one exception hierarchy of kvmem.

Every error kvmem raises on purpose is a :class:`KVMemError`. Messages name the
bad value and what would have been accepted.
"""

from __future__ import annotations

__all__ = [
    "KVMemError",
    "IntegrityError",
    "CodecError",
    "UnsupportedValueError",
    "InvalidKeyError",
    "CapacityError",
    "TierUnavailable",
    "SchemaError",
    "ConfigError",
    "UnsupportedModelError",
    "SessionConflict",
    "SessionNotFound",
    "PinExpired",
    "VersionConflict",
    "BlockError",
    "OutputMismatch",
]


class KVMemError(Exception):
    """Base class of every error raised by kvmem."""


class IntegrityError(KVMemError):
    """Stored bytes are not what was written: bad magic, truncation, CRC mismatch."""


class CodecError(KVMemError):
    """A codec cannot encode or decode a value (unknown codec, non-finite input...)."""


class UnsupportedValueError(CodecError, TypeError):
    """A value (or metadata) of a type kvmem cannot store."""


class InvalidKeyError(KVMemError, TypeError):
    """A key that is not ``str`` or ``bytes``."""


class CapacityError(KVMemError):
    """A value larger than every tier that could hold it."""


class TierUnavailable(KVMemError):
    """A storage tier or the catalog cannot be reached."""


class SchemaError(KVMemError):
    """The catalog database's schema cannot be brought to this kvmem's revision (newer, or a migration failed)."""


class ConfigError(KVMemError, ValueError):
    """A configuration value outside its accepted range."""


class UnsupportedModelError(KVMemError, TypeError):
    """A model whose KV cache kvmem cannot split into chunks (e.g. linear-attention layers)."""


class SessionConflict(KVMemError):
    """An agent session moved on under this writer: another one appended first."""


class SessionNotFound(KVMemError, KeyError):
    """No agent session of that name."""


class PinExpired(KVMemError):
    """A pinned version is gone: the pin was released, or its lease ran out and the version was reclaimed."""


class VersionConflict(KVMemError):
    """A key was rewritten under every attempt to pin one of its versions."""


class BlockError(KVMemError, ValueError):
    """A paged-pool block id out of range, freed more often than it was referenced, or hashed while free."""


class OutputMismatch(KVMemError, ValueError):
    """An ``out=`` tensor that cannot receive the stored value: another shape or dtype, or a value that is not
    one tensor."""
