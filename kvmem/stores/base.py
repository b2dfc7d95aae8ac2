"""The storage-tier seam: a narrow core every tier implements, and small capabilities a tier opts into.

The core (:class:`StorageTier`) is what a tier must do: ``get/put/contains/delete/
keys/usage/close``, with ``name``, ``capacity`` and ``persistent``. Anything more
is a capability, a small ``Protocol`` (one or two methods) or a marker class,
which a tier opts into by implementing it (the tiers here also name it among
their bases). The tiered store checks capabilities by type, once per tier
(:class:`Capabilities`), and gives a tier that lacks one a plain fallback built on
the core:

==========================  ===================  ===============================================
capability                  tiers here           without it
==========================  ===================  ===============================================
:class:`VerifiedReads`      cpu, disk, redis     ``get``, its CRCs then checked (not if Trusted)
:class:`OpensBlobs`         cpu, disk, gpu,      the whole blob read as above, then read in
                            redis                parts from memory
:class:`AdvisesReads`       disk                 nothing (reads do not wait on a device)
:class:`Quarantine`         disk, redis          ``delete``; nothing to purge
:class:`Durable`            disk                 nothing to flush
:class:`LendsBlobs`         cpu                  tiers below are written from the caller's blob
:class:`BatchWrites`        disk                 one ``put`` per entry
:class:`BatchLookups`       redis                one ``contains`` per key
:class:`PinsFormat`         disk                 new blobs in the newest format
:class:`SharesBuffers`      cpu                  ``get`` returns a buffer the caller owns
:class:`SelfEvicting`       redis                the store evicts in the LRU order of ``keys()``
:class:`Trusted`            gpu                  loads and scrubs check CRCs
==========================  ===================  ===============================================
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob
from kvmem.stores.readers import BlobReader

__all__ = [
    "lru_keys",
    "StorageTier",
    "TierBase",
    "Capabilities",
    "VerifiedReads",
    "OpensBlobs",
    "AdvisesReads",
    "Quarantine",
    "Durable",
    "LendsBlobs",
    "BatchWrites",
    "BatchLookups",
    "PinsFormat",
    "SharesBuffers",
    "SelfEvicting",
    "Trusted",
]


@runtime_checkable
class StorageTier(Protocol):
    """Where blobs live: keyed by storage key (64 hex digits), valued by blob bytes.

    Attributes:
        name: the tier's name in metrics and the catalog (``cpu``, ``disk``...).
        capacity: bytes it may hold.
        persistent: entries survive the process (disk, remote): every new entry is written through to it.

    Tiers do not evict by themselves (unless :class:`SelfEvicting`);
    :class:`~kvmem.stores.tiered.TieredStore` demotes and evicts, in the LRU order ``keys()`` gives.
    """

    name: str
    capacity: int
    persistent: bool

    def get(self, key: str) -> torch.Tensor | None:
        """The blob stored under ``key`` as a contiguous uint8 tensor (not CRC-checked), or ``None``; marks it
        recently used."""
        ...

    def put(self, key: str, blob: EncodedBlob) -> None:
        """Store ``blob`` under ``key`` atomically, replacing any older version.

        ``blob`` may be unsealed (its CRCs not computed yet): a tier that writes its bytes
        out seals it (in the same pass as the write where it can); a memory tier copies it
        and keeps it unsealed, to be sealed when first needed.

        Raises:
            CapacityError: this value alone cannot be stored here (too large for one entry, or no pages free).
        """
        ...

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored here (no CRC check, no LRU update)."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        ...

    def keys(self) -> Iterator[str]:
        """Stored keys, least recently used first.

        Reading only the first few must cost only those: making room for a put reads keys
        until enough bytes are freed (see :func:`lru_keys`).
        """
        ...

    def usage(self) -> int:
        """Bytes held."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...


@runtime_checkable
class VerifiedReads(Protocol):
    """Loads checked in the same pass as the read (a file, a socket reply), or trusted where the tier says why."""

    def read_verified(self, key: str) -> blobfmt.Verified | None:
        """``key``'s blob, CRC-checked where this tier's bytes need it, with the header the check parsed.

        Raises:
            IntegrityError: the blob does not match its CRC.
        """
        ...


@runtime_checkable
class OpensBlobs(Protocol):
    """Partial reads: a blob opened once, its parts read straight into the caller's tensors."""

    def open_blob(self, key: str) -> BlobReader | None:
        """``key``'s blob, one version of it, for reading parts into tensors; ``None`` when absent.

        Raises:
            IntegrityError: its header is not intact.
        """
        ...


@runtime_checkable
class AdvisesReads(Protocol):
    """Reads that wait on a device, which a hint can start early."""

    def advise_range(self, key: str, start: int, stop: int) -> None:
        """A hint: bytes ``[start, stop)`` of ``key``'s blob will be read soon. Never fails."""
        ...


@runtime_checkable
class Quarantine(Protocol):
    """Corrupt entries moved aside for inspection rather than deleted."""

    def quarantine(self, key: str) -> None:
        """Take a corrupt entry out of service, kept aside."""
        ...

    def purge_quarantine(self) -> int:
        """Delete entries moved aside by :meth:`quarantine`; bytes freed."""
        ...


@runtime_checkable
class Durable(Protocol):
    """Writes made durable in batches (``fsync="batch"``)."""

    def flush(self) -> None:
        """Make every write so far durable."""
        ...


@runtime_checkable
class LendsBlobs(Protocol):
    """Entries lent as blobs, so that the tiers below are written from this tier's copy, not the caller's."""

    def blob(self, key: str) -> EncodedBlob | None:
        """``key``'s blob as this tier holds it (views of its memory), or ``None``."""
        ...


@runtime_checkable
class BatchWrites(Protocol):
    """Several entries written together (in parallel, made durable together)."""

    def put_many(self, items: Sequence[tuple[str, EncodedBlob]]) -> None:
        """``put`` for every ``(key, blob)``."""
        ...


@runtime_checkable
class BatchLookups(Protocol):
    """Several keys looked up in one round trip."""

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` for every key."""
        ...


@runtime_checkable
class PinsFormat(Protocol):
    """A tier whose blobs must be in one format (the disk tier while a format migration runs)."""

    @property
    def blob_format(self) -> int:
        """The blob format new entries are written in."""
        ...


class SharesBuffers:
    """Marker: ``get`` and ``read_verified`` return views of the tier's own memory, which a load copies out of
    (never written while they live); puts into it are serialized with the room made for them."""


class SelfEvicting:
    """Marker: the tier makes room by itself (Redis's ``maxmemory-policy``): the tiered store never sheds it,
    and its ``keys()`` are in no LRU order."""


class Trusted:
    """Marker: the tier's bytes never leave the memory they were copied into (device memory), so loads from it
    and scrubs of it skip the CRC check."""


class TierBase:
    """What the tiers here share by default: not persistent, nothing to release on close."""

    name: str
    persistent = False

    def close(self) -> None:
        return None


def lru_keys(entries: Collection[str], lock: AbstractContextManager[object]) -> Iterator[str]:
    """The keys of ``entries`` (an ordered mapping guarded by ``lock``, least recently used first), as a
    snapshot taken in two steps: the oldest :data:`_FIRST_KEYS` when reading starts, every other key only
    if the reader goes past them. A key removed meanwhile may still be yielded (as from any snapshot).

    NOTE: a full tier makes room on every put, reading keys until enough bytes are freed (one or two,
    usually); one snapshot of every key made that O(entries): 2.4 ms a put with 20,000 entries here.
    """
    with lock:
        head = list(itertools.islice(entries, _FIRST_KEYS))
        more = len(entries) > len(head)
    yield from head
    if more:
        with lock:
            rest = list(entries)
        seen = set(head)
        yield from (key for key in rest if key not in seen)


_FIRST_KEYS = 64


@dataclass(frozen=True)
class Capabilities:
    """One tier's capabilities, checked by type once (an ``isinstance`` against a protocol costs microseconds,
    and the data path asks per call). Each protocol field is the tier itself, typed as that capability, or
    ``None``; methods are looked up on it when called, so a method replaced on the tier is the one called."""

    verified_reads: VerifiedReads | None
    opens_blobs: OpensBlobs | None
    advises_reads: AdvisesReads | None
    quarantine: Quarantine | None
    durable: Durable | None
    lends_blobs: LendsBlobs | None
    batch_writes: BatchWrites | None
    batch_lookups: BatchLookups | None
    pins_format: PinsFormat | None
    shares_buffers: bool
    self_evicting: bool
    trusted: bool

    @classmethod
    def of(cls, tier: StorageTier) -> Capabilities:
        """The capabilities ``tier`` implements."""
        return cls(
            verified_reads=tier if isinstance(tier, VerifiedReads) else None,
            opens_blobs=tier if isinstance(tier, OpensBlobs) else None,
            advises_reads=tier if isinstance(tier, AdvisesReads) else None,
            quarantine=tier if isinstance(tier, Quarantine) else None,
            durable=tier if isinstance(tier, Durable) else None,
            lends_blobs=tier if isinstance(tier, LendsBlobs) else None,
            batch_writes=tier if isinstance(tier, BatchWrites) else None,
            batch_lookups=tier if isinstance(tier, BatchLookups) else None,
            pins_format=tier if isinstance(tier, PinsFormat) else None,
            shares_buffers=isinstance(tier, SharesBuffers),
            self_evicting=isinstance(tier, SelfEvicting),
            trusted=isinstance(tier, Trusted),
        )
