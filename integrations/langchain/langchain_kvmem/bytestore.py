"""``KVMemByteStore``: a LangChain ``ByteStore`` whose values are kvmem entries.

Each value is stored as a bytes entry under its key in one kvmem namespace, so it
is CRC-checked on every load, lives on kvmem's tiers (and survives restarts on
the disk tier), and is seen by every process that opens the same data directory.

kvmem hashes keys into storage keys and its catalog keeps only a 256-character
preview of the key given, so the full key also travels in the entry's metadata:
:meth:`KVMemByteStore.yield_keys` lists the namespace's catalog entries and reads
it back from there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from langchain_core.stores import ByteStore

import kvmem

__all__ = ["KVMemByteStore"]

_KEY = "langchain_key"  # metadata field holding the full str key of an entry


class KVMemByteStore(ByteStore):
    """A LangChain ``ByteStore`` over a :class:`kvmem.Memory`.

    The async methods are ``BaseStore``'s defaults, which run the sync ones in the
    event loop's executor: disk reads and writes never block the loop.

    Args:
        memory: where the values are stored (default: :func:`kvmem.default_memory`).
        namespace: kvmem namespace of the entries; two stores on different
            namespaces never see each other's keys.
    """

    def __init__(self, memory: kvmem.Memory | None = None, namespace: str = "langchain/bytes") -> None:
        self.memory = memory if memory is not None else kvmem.default_memory()
        self.namespace = namespace

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys``, ``None`` for each missing one (a corrupt copy is a miss)."""
        values: list[bytes | None] = []
        for key in keys:
            loaded = self.memory.fetch(key, namespace=self.namespace)
            values.append(loaded.value if loaded is not None and isinstance(loaded.value, bytes) else None)
        return values

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        """Store each ``(key, value)``; an existing key is overwritten.

        Raises:
            TypeError: a key that is not ``str`` or a value that is not bytes-like.
        """
        pairs = [(key, _as_bytes(key, value)) for key, value in key_value_pairs]  # NOTE: check all before writing
        for key, value in pairs:
            self.memory.store(key, value, namespace=self.namespace, metadata={_KEY: key})

    def mdelete(self, keys: Sequence[str]) -> None:
        """Remove ``keys``; missing keys are ignored."""
        for key in keys:
            self.memory.delete(key, namespace=self.namespace)

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        """The stored keys (most recently used first) that start with ``prefix``.

        Entries of the namespace written by something other than this class (no key in
        their metadata) are not listed.
        """
        for entry in self.memory.entries(self.namespace):
            key = entry.metadata.get(_KEY)
            if isinstance(key, str) and (prefix is None or key.startswith(prefix)):
                yield key

    def __repr__(self) -> str:
        return f"KVMemByteStore(path={self.memory.config.path!r}, namespace={self.namespace!r})"


def _as_bytes(key: object, value: object) -> bytes:
    """``value`` as ``bytes`` (bytearray and memoryview are copied)."""
    if not isinstance(key, str):
        raise TypeError(f"key {key!r:.80}: KVMemByteStore keys are str")
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(
        f"value of key {key[:80]!r} is {type(value).__name__}: KVMemByteStore values are bytes "
        "(bytearray and memoryview are accepted)"
    )
