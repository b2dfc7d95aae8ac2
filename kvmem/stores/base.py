"""The storage-tier seam: one narrow protocol, and a base with the batched defaults."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob
from kvmem.stores.readers import BlobReader, RangeReader

__all__ = ["StorageTier", "TierBase"]


@runtime_checkable
class StorageTier(Protocol):
    """Where blobs live: keyed by storage key (64 hex digits), valued by blob bytes.

    Capabilities are class flags, not methods:

    - ``shares_buffers``: ``get`` returns the tier's own buffer, which callers copy
      before handing it out (memory tiers); otherwise ``get`` returns a fresh buffer.
    - ``checks_crc``: loads from this tier are CRC-checked (every tier below the GPU).
    - ``persistent``: entries survive the process (disk, remote): write-through targets.
    - ``self_evicting``: the tier makes room by itself (Redis's ``maxmemory-policy``);
      the tiered store never sheds it.

    Tiers do not evict by themselves; :class:`~kvmem.stores.tiered.TieredStore`
    demotes and evicts, in the LRU order ``keys()`` gives.
    """

    name: str
    capacity: int
    shares_buffers: bool
    checks_crc: bool
    persistent: bool
    self_evicting: bool

    def get(self, key: str) -> torch.Tensor | None:
        """The blob stored under ``key`` as a contiguous uint8 tensor, or ``None``; marks it recently used."""
        ...

    def get_verified(self, key: str) -> torch.Tensor | None:
        """``get``, its CRC32C checked when ``checks_crc`` (in the same pass as the read where the tier can).

        Raises:
            IntegrityError: the blob does not match its CRC.
        """
        ...

    def read_verified(self, key: str) -> blobfmt.Verified | None:
        """``get_verified``, with the header its check parsed where it parsed one (a load then parses it once).

        Raises:
            IntegrityError: the blob does not match its CRC.
        """
        ...

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        """Bytes ``[start, stop)`` of ``key``'s blob (fewer past its end; not CRC-checked), or ``None``.

        For partial reads such as one layer of a KV chunk; the caller checks the
        segment CRCs of what it uses. The returned bytes must not be modified.
        """
        ...

    def advise_range(self, key: str, start: int, stop: int) -> None:
        """A hint: bytes ``[start, stop)`` of ``key``'s blob will be read soon; start fetching them.

        Where reads do not wait on a device this does nothing; it never fails.
        """
        ...

    def put(self, key: str, blob: EncodedBlob) -> None:
        """Store ``blob`` under ``key`` atomically, replacing any older version.

        ``blob`` may be unsealed (its CRCs not computed yet): a tier that writes its bytes
        out seals it (in the same pass as the write where it can); a memory tier copies it
        and keeps it unsealed, to be sealed when first needed.
        """
        ...

    def blob(self, key: str) -> EncodedBlob | None:
        """``key``'s blob as this tier holds it, to be written to another tier without a copy, or ``None``
        (not held, or the tier cannot lend its bytes)."""
        ...

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored here (no CRC check, no LRU update)."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        ...

    def quarantine(self, key: str) -> None:
        """Take a corrupt entry out of service (moved aside where the tier can keep it)."""
        ...

    def keys(self) -> Iterator[str]:
        """Stored keys, least recently used first."""
        ...

    def usage(self) -> int:
        """Bytes held."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """``get`` for several keys (one round trip where the tier can)."""
        ...

    def open_blob(self, key: str) -> BlobReader | None:
        """``key``'s blob, one version of it, for reading parts straight into tensors; ``None`` when absent.

        Raises:
            IntegrityError: its header is not intact.
        """
        ...

    def put_many(self, items: Sequence[tuple[str, EncodedBlob]]) -> None:
        """``put`` for several entries (written in parallel, made durable together where the tier can)."""
        ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` for several keys (one round trip where the tier can)."""
        ...

    def purge_quarantine(self) -> int:
        """Delete entries moved aside by :meth:`quarantine`; bytes freed."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...


class TierBase:
    """Defaults shared by tiers: batched calls loop over single calls; quarantine deletes."""

    name: str
    shares_buffers = False
    checks_crc = True
    persistent = False
    self_evicting = False

    def get(self, key: str) -> torch.Tensor | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def contains(self, key: str) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def delete(self, key: str) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def get_verified(self, key: str) -> torch.Tensor | None:
        buf = self.get(key)
        if buf is not None and self.checks_crc:
            blobfmt.verify(buf if buf.device.type == "cpu" else buf.cpu())
        return buf

    def read_verified(self, key: str) -> blobfmt.Verified | None:
        buf = self.get_verified(key)
        return None if buf is None else blobfmt.Verified(buf)

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        buf = self.get(key)
        return None if buf is None else buf[start:stop]

    def blob(self, key: str) -> EncodedBlob | None:
        return None

    def advise_range(self, key: str, start: int, stop: int) -> None:
        return None

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        return [self.get(k) for k in keys]

    def open_blob(self, key: str) -> BlobReader | None:
        head = self.read_range(key, 0, blobfmt.HEAD_PROBE)
        if head is None:
            return None
        return RangeReader(lambda lo, hi: self.read_range(key, lo, hi), self.name, self.checks_crc, head)

    def put_many(self, items: Sequence[tuple[str, EncodedBlob]]) -> None:
        for key, blob in items:
            self.put(key, blob)  # type: ignore[attr-defined]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def quarantine(self, key: str) -> None:
        self.delete(key)

    def purge_quarantine(self) -> int:
        return 0

    def close(self) -> None:
        return None
