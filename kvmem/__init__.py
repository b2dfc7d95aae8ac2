"""kvmem: content-addressed memory for LLM inference and agents.

>>> import kvmem, torch
>>> key = kvmem.store("visual_abc", torch.ones(4), metadata={"dim": 4})
>>> kvmem.load("visual_abc")
tensor([1., 1., 1., 1.])

Module-level functions use a lazily created default :class:`Memory` (CPU and
disk tiers under the user cache directory, a SQLite catalog);
:func:`configure` replaces it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvmem.api import EntryInfo, Memory, Stats, configure, default_memory
from kvmem.config import Config, load_config
from kvmem.errors import (
    CapacityError,
    CodecError,
    ConfigError,
    IntegrityError,
    InvalidKeyError,
    KVMemError,
    PinExpired,
    TierUnavailable,
    UnsupportedValueError,
    VersionConflict,
)
from kvmem.keys import chunk_hashes, content_hash

__version__ = "0.1.0"

__all__ = [
    "store",
    "load",
    "lookup_similar",
    "contains",
    "delete",
    "compress",
    "decompress",
    "content_hash",
    "chunk_hashes",
    "configure",
    "default_memory",
    "Memory",
    "Config",
    "load_config",
    "EntryInfo",
    "Stats",
    "KVMemError",
    "IntegrityError",
    "CodecError",
    "UnsupportedValueError",
    "InvalidKeyError",
    "CapacityError",
    "TierUnavailable",
    "ConfigError",
    "PinExpired",
    "VersionConflict",
]


def store(
    key: str | bytes,
    value: object,
    *,
    metadata: dict[str, Any] | None = None,
    namespace: str | None = None,
    compression: str | None = None,
    text: str | None = None,
) -> str:
    """Store ``value`` under ``key`` in the default memory (``text``: index it for :func:`lookup_similar`)."""
    return default_memory().store(
        key, value, metadata=metadata, namespace=namespace, compression=compression, text=text
    )


def lookup_similar(
    query: str, k: int = 3, *, namespace: str | None = None, threshold: float | None = None, verify: bool = True
) -> list[Any]:
    """Entries of the default memory whose text means the same as ``query``; see :meth:`Memory.lookup_similar`."""
    return default_memory().lookup_similar(query, k, namespace=namespace, threshold=threshold, verify=verify)


def load(
    key: str | bytes,
    default: Any = None,
    *,
    namespace: str | None = None,
    device: torch.device | str | None = None,
    regenerate: Callable[[], Any] | None = None,
) -> Any:
    """The value under ``key`` in the default memory, or ``default``; see :meth:`Memory.load`."""
    return default_memory().load(key, default, namespace=namespace, device=device, regenerate=regenerate)


def contains(key: str | bytes, *, namespace: str | None = None) -> bool:
    """Whether the default memory holds ``key``."""
    return default_memory().contains(key, namespace=namespace)


def delete(key: str | bytes, *, namespace: str | None = None) -> bool:
    """Remove ``key`` from the default memory; whether it was there."""
    return default_memory().delete(key, namespace=namespace)


def compress(value: object, codec: str | None = None) -> bytes:
    """Encode ``value`` as a self-describing, CRC-protected blob (``codec`` e.g. ``"int8+lz4"``)."""
    return default_memory().compress(value, codec)


def decompress(data: bytes | bytearray | memoryview) -> Any:
    """Decode a blob made by :func:`compress`."""
    return Memory.decompress(data)
