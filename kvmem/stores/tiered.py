"""The tier hierarchy: read top -> down with promotion, write-through or write-back, offload.

Invariants:

- ``get`` returns a buffer the caller owns, whose CRC was checked unless it came
  from a tier that does not need it (GPU). Corrupt entries are quarantined and
  the search goes on in lower tiers: corrupt bytes are never returned.
- A new entry goes to the highest tier with room, and to every persistent
  tier below it (at once with ``write_policy="through"``, from a background
  thread with ``"back"``). With ``"around"`` it goes to the highest persistent
  tier with room (and those below): the memory tiers hold only what
  :meth:`TieredStore.warm` puts there (a hit is promoted into the persistent
  tiers above it only), so they can hold what a cache above kvmem does not
  (vLLM's KV cache: its evicted blocks, not a copy of its own).
- A tier above ``offload_threshold`` of its capacity moves its least recently
  used entries to the next tier down; the last tier drops them (an eviction).
- The last memory tier may also hold guesses (:meth:`TieredStore.speculate`, see
  :mod:`kvmem.stores.guesses`): only in room no entry uses, outside the threshold,
  and dropped before any real entry when a put needs room (or, oldest first, when
  a newer guess needs it).
- A tier whose operation raises ``OSError`` or ``TierUnavailable`` is skipped for
  ``retry_seconds`` and counted; the caller never sees that error (a reader from
  ``open_blob`` raises ``TierUnavailable`` instead: it was counted already).
- What a tier can do beyond the core protocol is looked up by type once, when the
  store opens (:class:`~kvmem.stores.base.Capabilities`); a tier without a capability
  gets the plain fallback (see :mod:`kvmem.stores.base`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, TypeVar, TypeVarTuple

import torch

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob
from kvmem.codecs.serialization import check_owner
from kvmem.errors import CapacityError, IntegrityError, TierUnavailable
from kvmem.metrics import Metrics
from kvmem.stores.base import Capabilities, StorageTier
from kvmem.stores.guesses import Guesses
from kvmem.stores.readers import BlobReader, GuardedReader, RangeReader
from kvmem.threads import yield_to_compute

__all__ = ["TieredStore", "Fetched", "Stored"]

log = logging.getLogger(__name__)
T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class Fetched(NamedTuple):
    """A verified blob buffer, the tier that served it, and its parsed header if the tier had it.

    ``owned``: the buffer is the caller's; otherwise it is a view of a memory tier's pages
    (never written while it lives), which a load copies out of (:func:`decode_value` ``copy=True``).
    """

    buf: torch.Tensor
    tier: str
    head: tuple[dict[str, Any], int] | None = None
    owned: bool = True


class Stored(NamedTuple):
    """What :meth:`TieredStore.put` did: the tiers written now, and the blob as the first of them holds it
    (whose :attr:`~kvmem.blob.EncodedBlob.crc` names the entry)."""

    tiers: list[str]
    blob: EncodedBlob
    refused: CapacityError | None = None


class _Health:
    def __init__(self) -> None:
        self.down_until = 0.0

    def usable(self) -> bool:
        return not self.down_until or time.monotonic() >= self.down_until  # NOTE: no clock read until a failure


_GUESS_HEADROOM = 16  # 1/16 of the guess tier's capacity is kept free of guesses (see _free_for_guesses)


class TieredStore:
    """Blobs on an ordered list of tiers, fastest first.

    Args:
        tiers: fastest first (e.g. gpu, cpu, disk, remote).
        metrics: where hits, errors, evictions... are counted.
        offload_threshold: fraction of capacity above which a tier demotes LRU entries.
        write_policy: ``through``, ``back`` or ``around``.
        queue_size: most entries waiting for write-back before ``put`` blocks.
        retry_seconds: how long a failing tier is skipped before it is tried again.
        on_removed: called with a key when it has left the last tier holding it.
    """

    def __init__(
        self,
        tiers: Sequence[StorageTier],
        metrics: Metrics,
        *,
        offload_threshold: float = 0.7,
        write_policy: str = "through",
        queue_size: int = 64,
        retry_seconds: float = 5.0,
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        self.tiers = list(tiers)
        self.metrics = metrics
        self.offload_threshold = offload_threshold
        self.write_back = write_policy == "back"
        self.write_around = write_policy == "around"
        self.persistent = frozenset(t.name for t in self.tiers if t.persistent)
        """Names of the tiers whose entries outlive the process."""
        self.largest = max((t.capacity for t in self.tiers), default=0)
        """The capacity of the largest tier: no entry can be larger."""
        self.retry_seconds = retry_seconds
        self.on_removed = on_removed
        memory_tiers = [t for t in self.tiers if not t.persistent]
        self.guess_tier = memory_tiers[-1] if memory_tiers else None
        """The tier :meth:`speculate` warms into: the last memory tier (the CPU tier, usually)."""
        self.guesses = Guesses(metrics)
        """The entries :attr:`guess_tier` holds on a guess."""
        self._health = {t.name: _Health() for t in self.tiers}
        self._persistent_below = [[t for t in self.tiers[i + 1 :] if t.persistent] for i in range(len(self.tiers))]
        self._caps = {t.name: Capabilities.of(t) for t in self.tiers}
        self._format_pins = [c.pins_format for c in self._caps.values() if c.pins_format is not None]
        self._room_lock = threading.RLock()
        # NOTE: write-back entries by key; a newer put replaces an older pending one,
        # and a delete drops it, so the writer never resurrects a deleted key.
        self._pending: OrderedDict[str, tuple[EncodedBlob, list[StorageTier]]] = OrderedDict()
        self._pending_cv = threading.Condition()
        self._writing: str | None = None  # the key the writer is putting now (still in _pending)
        self._queue_size = queue_size
        self._closed = False
        self._writer: threading.Thread | None = None
        if self.write_back:
            self._writer = threading.Thread(target=self._write_back_loop, name="kvmem-write-back", daemon=True)
            self._writer.start()
        for t in self.tiers:
            metrics.capacity.labels(tier=t.name).set(t.capacity)
            # read when scraped: usage changes on puts, evictions and (CPU pool) when a
            # loaded view is garbage-collected, which no hook sees; every tier's usage() is cheap
            metrics.memory_usage.labels(tier=t.name).set_function(t.usage)

    # -- fault isolation ----------------------------------------------------
    def _call_or_raise(self, tier: StorageTier, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """``fn(*args)``, an operation of ``tier``, under its failure handling.

        Raises:
            TierUnavailable: ``tier`` raised ``OSError`` or ``TierUnavailable`` (now marked down for
                ``retry_seconds``, counted and logged, once: the caller must not count it), or is skipped.
        """
        health = self._health[tier.name]
        if not health.usable():
            raise TierUnavailable(
                f"tier {tier.name} is skipped for up to {self.retry_seconds:.1f}s after a "
                "failure (see kvmem_tier_errors_total)"
            )
        try:
            return fn(*args)
        except (OSError, TierUnavailable) as exc:
            health.down_until = time.monotonic() + self.retry_seconds
            self.metrics.tier_errors.labels(tier=tier.name).inc()
            log.warning(
                "kvmem: tier %s failed (%s: %s); skipping it for %.1fs",
                tier.name,
                type(exc).__name__,
                exc,
                self.retry_seconds,
            )
            raise TierUnavailable(
                f"tier {tier.name} failed ({type(exc).__name__}: {exc}); skipped for "
                f"{self.retry_seconds:.1f}s (see kvmem_tier_errors_total)"
            ) from exc

    def _call(self, tier: StorageTier, fn: Callable[[*Ts], T | None], *args: *Ts) -> T | None:
        """:meth:`_call_or_raise` for a caller that goes on without ``tier``: ``None`` when it failed or is
        skipped (as when ``fn`` found nothing)."""
        try:
            return self._call_or_raise(tier, fn, *args)
        except TierUnavailable:
            return None

    def _ran(self, tier: StorageTier, fn: Callable[[*Ts], object], *args: *Ts) -> bool:
        """:meth:`_call` for an operation run for its effect: whether it ran (``False``: failed or skipped)."""
        try:
            self._call_or_raise(tier, fn, *args)
        except TierUnavailable:
            return False
        return True

    def capabilities(self, tier: StorageTier) -> Capabilities:
        """What ``tier`` does beyond the core protocol (looked up once, when this store opened)."""
        return self._caps[tier.name]

    def healthy(self, tier: StorageTier) -> bool:
        """Whether ``tier`` is currently used (not skipped after a failure)."""
        return self._health[tier.name].usable()

    @property
    def blob_format(self) -> int:
        """The blob format new entries are written in: the disk tier's (a migration may be under way), else
        the newest."""
        return self._format_pins[0].blob_format if self._format_pins else blobfmt.FORMAT_VERSION

    def holders(self, key: str) -> list[str]:
        """Names of the usable tiers that hold ``key`` (a failing tier is skipped and counted, never raised)."""
        return [t.name for t in self.tiers if self._call(t, t.contains, key)]

    def entry_count(self, tier: StorageTier) -> int:
        """Entries ``tier`` holds; 0 while it fails (skipped and counted, never raised)."""
        return self._call(tier, _count_keys, tier) or 0

    # -- reads --------------------------------------------------------------
    def get(self, key: str) -> tuple[Fetched | None, int]:
        """Find ``key``, verify it, promote it to the tiers above.

        Returns:
            ``(fetched or None, corrupt copies found on the way)``.
        """
        return self._get(key, warm=False)

    def _get(self, key: str, warm: bool) -> tuple[Fetched | None, int]:
        got, i, corrupt = self._find(key, 0)
        if got is None:
            return None, corrupt
        if upper := self.tiers[:i] if warm else self.promotion_targets(self.tiers[i].name):
            self._promote(key, EncodedBlob.from_buffer(got.buf, got.head), upper)
        tier = self.tiers[i]
        return Fetched(got.buf, tier.name, got.head, owned=not self._caps[tier.name].shares_buffers), corrupt

    def _find(self, key: str, first: int) -> tuple[blobfmt.Verified | None, int, int]:
        """``key``'s verified blob in the first tier from ``self.tiers[first]`` down holding an intact copy
        (corrupt copies on the way quarantined): ``(blob or None, that tier's index, corrupt copies found)``."""
        corrupt = 0
        for i, tier in enumerate(self.tiers[first:], first):
            try:
                got = self._call(tier, self._read_owned, tier, key)
            except IntegrityError as exc:
                corrupt += 1
                self._corrupt(tier, key, exc)
                continue
            if got is not None:
                return got, i, corrupt
        return None, len(self.tiers), corrupt

    def read(self, key: str, fill: Callable[[BlobReader], T]) -> tuple[T | None, BlobReader | None, int]:
        """``fill(reader)`` on ``key``'s blob in the first tier holding an intact copy.

        A copy whose header or read part fails its check is quarantined and the next tier
        tried (``fill`` may then run again: what it wrote from the bad copy is overwritten);
        a tier that raises ``OSError`` is skipped and counted. Errors ``fill`` raises for
        other reasons reach the caller. Nothing is promoted: the caller decides
        (:meth:`promote`), as only it knows whether it read the whole blob.

        Returns:
            ``(fill's result or None, the (closed) reader it read from or None, corrupt copies found)``.
        """
        corrupt = 0
        for tier in self.tiers:
            try:
                got = self._call(tier, self._fill_from, tier, key, fill)
            except IntegrityError as exc:
                corrupt += 1
                self._corrupt(tier, key, exc)
                continue
            if got is not None:
                return got[0], got[1], corrupt
        return None, None, corrupt

    def open_blob(self, key: str, tier: StorageTier) -> BlobReader | None:
        """``key``'s blob in ``tier`` (e.g. as :meth:`locate` found it), opened for partial reads.

        The open and every read of the reader go through ``tier``'s failure handling, as
        :meth:`read` does: a tier that raises ``OSError`` or ``TierUnavailable`` is counted in
        ``kvmem_tier_errors_total`` and skipped for ``retry_seconds``; a read from the reader
        then raises :class:`TierUnavailable` (already counted), as does one while it is skipped.

        Returns:
            The reader, or ``None``: ``tier`` does not hold ``key``, failed to open it, or is skipped.

        Raises:
            IntegrityError: the blob's header is not intact (the caller quarantines it).
        """
        reader = self._call(tier, self._open, tier, key)
        if reader is None:
            return None
        return GuardedReader(reader, functools.partial(self._call_or_raise, tier))

    def advise(self, key: str, tier: StorageTier, lo: int, hi: int) -> None:
        """A hint to ``tier``: bytes ``[lo, hi)`` of ``key``'s blob will be read soon (nothing while it is skipped,
        nothing where its reads do not wait on a device)."""
        advises = self._caps[tier.name].advises_reads
        if advises is not None:
            self._call(tier, advises.advise_range, key, lo, hi)

    def _corrupt(self, tier: StorageTier, key: str, reason: IntegrityError) -> None:
        """Count, log and quarantine ``tier``'s copy of ``key``, which failed its check."""
        self.metrics.crc_failures.labels(tier=tier.name).inc()
        log.warning("kvmem: entry %s in tier %s is corrupt (%s); quarantined", key, tier.name, reason)
        self.quarantine_copy(tier, key)

    def quarantine_copy(self, tier: StorageTier, key: str) -> None:
        """Take ``tier``'s copy of ``key`` out of service: moved aside where the tier keeps a quarantine, else
        deleted (a failing tier is skipped and counted, never raised)."""
        aside = self._caps[tier.name].quarantine
        self._ran(tier, aside.quarantine if aside is not None else tier.delete, key)
        if tier is self.guess_tier:
            self.guesses.wasted(key)

    def purge_quarantine(self, tier: StorageTier) -> int:
        """Delete the entries ``tier`` moved aside; bytes freed (0 while it fails: skipped and counted)."""
        aside = self._caps[tier.name].quarantine
        return (self._call(tier, aside.purge_quarantine) or 0) if aside is not None else 0

    def _open(self, tier: StorageTier, key: str) -> BlobReader | None:
        """``key``'s blob in ``tier`` opened for partial reads; a tier that cannot open blobs has the whole blob
        read (checked as :meth:`_read_owned` does) and its parts read from that buffer.

        Raises:
            IntegrityError: the blob's header (or, read whole, the blob) is not intact.
        """
        opens = self._caps[tier.name].opens_blobs
        if opens is not None:
            return opens.open_blob(key)
        got = self._read_owned(tier, key)
        return None if got is None else RangeReader(lambda lo, hi: got.buf[lo:hi], tier.name, False, got.buf)

    def _fill_from(self, tier: StorageTier, key: str, fill: Callable[[BlobReader], T]) -> tuple[T, BlobReader] | None:
        reader = self._open(tier, key)
        if reader is None:
            return None
        with reader:
            return fill(reader), reader

    def promotion_targets(self, served_by: str) -> list[StorageTier]:
        """The tiers a hit in tier ``served_by`` is promoted into: those above it (with ``write_around``, the
        persistent ones above it)."""
        upper = self.tiers[: next(i for i, t in enumerate(self.tiers) if t.name == served_by)]
        return [t for t in upper if t.persistent] if self.write_around else upper

    def promote(self, key: str, blob: EncodedBlob, served_by: str) -> None:
        """Copy ``blob`` (just read from tier ``served_by``) into the usable tiers it is promoted into
        (:meth:`promotion_targets`) that can take it."""
        if upper := self.promotion_targets(served_by):
            self._promote(key, blob, upper)

    def quarantine(self, key: str, tier: str, reason: Exception) -> None:
        """Take the copy of ``key`` that ``tier`` served out of service, with the copies a hit promoted.

        For a copy that passed its CRC but failed a later check (its header does not
        decode, or names another key); counted as an integrity failure of ``tier``.
        """
        self.metrics.crc_failures.labels(tier=tier).inc()
        log.warning("kvmem: entry %s from tier %s is unusable (%s); quarantined", key, tier, reason)
        upto = next(i for i, t in enumerate(self.tiers) if t.name == tier)
        for t in self.tiers[: upto + 1]:
            self.quarantine_copy(t, key)

    def _read_owned(self, tier: StorageTier, key: str) -> blobfmt.Verified | None:
        """``key``'s blob in ``tier``, CRC-checked where ``tier`` needs it, with its header if the tier had it.

        The check runs in the same pass as the read where the tier can (``read_verified``); a
        memory tier lends a view of its pages (``SharesBuffers``), which a load copies out of.

        Raises:
            IntegrityError: the blob does not match its CRC.
        """
        caps = self._caps[tier.name]
        if caps.verified_reads is not None:
            return caps.verified_reads.read_verified(key)
        buf = tier.get(key)
        if buf is None:
            return None
        if caps.trusted:
            return blobfmt.Verified(buf)
        return blobfmt.Verified(buf, blobfmt.verify(buf if buf.device.type == "cpu" else buf.cpu()))

    def _promote(self, key: str, encoded: EncodedBlob, upper: list[StorageTier]) -> None:
        for tier in upper:
            if encoded.nbytes <= tier.capacity * self.offload_threshold and self.healthy(tier):
                if self._put_one(tier, key, encoded) is True:
                    self.metrics.promotions.labels(tier=tier.name).inc()

    def warm(self, key: str) -> bool:
        """Make sure ``key`` sits in the top tier (promoting it from below into every tier above, whatever the
        write policy); whether it exists."""
        top = self.tiers[0] if self.tiers else None
        if top is not None and self._call(top, top.contains, key):
            return True
        fetched, _ = self._get(key, warm=True)
        return fetched is not None

    def release(self, key: str) -> bool:
        """Drop the memory tiers' copies of ``key`` that a persistent tier below them holds too (a cache above
        kvmem holds the value now: it needs no copy here until it evicts it); whether one was dropped."""
        dropped = False
        with self._room_lock:
            for i, tier in enumerate(self.tiers):
                below = self._persistent_below[i]
                if tier.persistent or not below or not self._call(tier, tier.contains, key):
                    continue
                if any(self._call(t, t.contains, key) for t in below if self.healthy(t)):
                    self._call(tier, tier.delete, key)
                    if tier is self.guess_tier:
                        self.guesses.wasted(key)
                    dropped = True
        return dropped

    def speculate(self, key: str, keep: Collection[str] = ()) -> tuple[str, int]:
        """Copy ``key`` into :attr:`guess_tier` on a guess, only into room no entry uses: no entry is evicted,
        demoted or shed for it (a guess is dropped first when a put needs the room later). Older guesses
        are, oldest first, when the room is short, except those in ``keep`` (the same request's other
        guesses, say): a guess made for the latest request is likelier to be used than one left unused since
        an earlier one, and a document warmed in part still reads the rest from below. Entries over the
        offload threshold (used guesses count as entries) are moved down first, as a put would.

        Returns:
            ``(outcome, bytes copied)``; the outcome is ``warmed``, ``resident`` (a memory tier holds it
            already), ``no_room`` or ``missing`` (no usable tier below holds an intact copy).
        """
        target = self.guess_tier
        if target is None:
            return "missing", 0
        below = self.tiers.index(target) + 1
        if any(self._call(t, t.contains, key) for t in self.tiers[:below]):
            return "resident", 0
        # NOTE: a used guess became an entry, over the threshold: move entries down here, between requests,
        # as the next put would on a request's path (it made misses slower by a demotion each)
        self._offload(target)
        if self._free_for_guesses(target) <= 0 and all(k in keep for k in self.guesses.oldest()):
            return "no_room", 0  # NOTE: checked before the read too, so a full tier costs no I/O
        got, _i, _corrupt = self._find(key, below)
        if got is None:
            return "missing", 0
        encoded = EncodedBlob.from_buffer(got.buf, got.head)
        with self._room_lock:
            for older in self.guesses.oldest():
                if encoded.nbytes <= self._free_for_guesses(target):
                    break
                if older not in keep:
                    self._demote(older, target, self.tiers[below:])  # below holds it: a drop
            if encoded.nbytes > self._free_for_guesses(target):
                return "no_room", 0
            try:
                if not self._ran(target, target.put, key, encoded):
                    return "missing", 0
            except CapacityError:  # the pool's free pages are fragmented or held by views
                return "no_room", 0
            self.guesses.add(key, encoded.nbytes)
        self.metrics.promotions.labels(tier=target.name).inc()
        return "warmed", encoded.nbytes

    def _free_for_guesses(self, tier: StorageTier) -> int:
        """Bytes of ``tier`` that neither its entries nor a put's headroom (1/16 of its capacity) would use: a
        guess may take them.

        NOTE: the headroom lets a request's misses land without dropping a guess on the request's path (a
        second removal besides the entry the threshold moves down): the prefetcher's next guess drops the
        oldest, between requests."""
        return tier.capacity - tier.capacity // _GUESS_HEADROOM - tier.usage() if self.healthy(tier) else 0

    def note_hits(self, keys: Sequence[str], tier: str) -> None:
        """Loads of ``keys`` were served by tier ``tier``: guesses among them count as used."""
        if self.guesses and self.guess_tier is not None and tier == self.guess_tier.name:
            for key in keys:
                self.guesses.used(key)

    def locate(self, key: str) -> StorageTier | None:
        """The fastest usable tier holding ``key`` (no CRC check), or ``None``."""
        return next((t for t in self.tiers if self._call(t, t.contains, key)), None)

    def drop_upper_copies(self, key: str) -> int:
        """Delete ``key`` from every tier above the lowest one holding it; how many copies went.

        For copies another process may have made stale: it rewrote the key in the lower
        (shared) tiers, while this process's upper tiers kept the old version.
        """
        with self._pending_cv:
            if key in self._pending:  # NOTE: the upper copy is newer than the lower ones until written back
                return 0
        held = [t for t in self.tiers if self._call(t, t.contains, key)]
        return sum(bool(self._call(t, t.delete, key)) for t in held[:-1])

    def contains(self, key: str) -> bool:
        """Whether any usable tier holds ``key`` (no CRC check)."""
        return self.locate(key) is not None

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` for several keys with one batched call per tier."""
        return [tier is not None for tier in self.locate_many(keys)]

    def locate_many(self, keys: Sequence[str]) -> list[str | None]:
        """The name of the fastest usable tier holding each key (no CRC check), or ``None``: one batched call per
        tier, each asked only for the keys the tiers above it do not hold."""
        found: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, f in enumerate(found) if f is None]
            if not todo:
                break
            res = self._call(tier, self._contains_each, tier, [keys[i] for i in todo])
            if res is not None:
                for i, hit in zip(todo, res):
                    if hit:
                        found[i] = tier.name
        return found

    def _contains_each(self, tier: StorageTier, keys: list[str]) -> list[bool]:
        """``tier.contains`` of each key: in one round trip where the tier batches lookups."""
        batch = self._caps[tier.name].batch_lookups
        return batch.contains_many(keys) if batch is not None else [tier.contains(k) for k in keys]

    # -- writes -------------------------------------------------------------
    def put(self, key: str, encoded: EncodedBlob) -> Stored:
        """Store ``encoded`` under ``key`` (see :meth:`put_many`).

        Raises:
            CapacityError: every target refused the value as too large for one entry.
        """
        stored = self.put_many([(key, encoded)])[0]
        if stored.refused is not None and not stored.tiers:
            raise stored.refused
        return stored

    def put_many(self, items: Sequence[tuple[str, EncodedBlob]]) -> list[Stored]:
        """Store each ``(key, blob)``: in the highest tier with room, and in every persistent tier below it.

        The first tier written copies the value's bytes; the persistent tiers below are
        written from that tier's copy when it lends one (``blob``), so the caller's tensors
        are read once and may change as soon as this returns. A persistent tier gets the
        whole batch in one ``put_many`` (parallel writes, one directory fsync each).

        Returns:
            Per item: the tiers written now (write-back targets not included), the blob as
            stored, and the refusal if every target refused it as too large.
        """
        plans = [self._targets(blob) for _key, blob in items]
        sources = [blob for _key, blob in items]
        written: list[list[str]] = [[] for _ in items]
        refused: list[CapacityError | None] = [None] * len(items)
        later: list[list[StorageTier]] = [[] for _ in items]
        # NOTE: one item (a plain store) visits its own targets only: the same tiers, in the same order
        for tier in plans[0] if len(plans) == 1 else self.tiers:
            now = []
            for i, targets in enumerate(plans):
                if tier not in targets:
                    continue
                if self.write_back and targets[0] is not tier:
                    later[i].append(tier)
                else:
                    now.append(i)
            if not now:
                continue
            lender = self._caps[tier.name].lends_blobs
            for i, done in zip(now, self._put_into(tier, [(items[i][0], sources[i]) for i in now])):
                if done is True:
                    written[i].append(tier.name)
                    if lender is not None and sources[i] is items[i][1]:
                        sources[i] = self._call(tier, lender.blob, items[i][0]) or sources[i]
                elif isinstance(done, CapacityError):
                    refused[i] = done
        if self.write_around:
            self._around_failed(items, written, refused)
        if self.write_back:
            for i, (key, blob) in enumerate(items):
                if later[i]:
                    # NOTE: the caller's tensors may change as soon as this returns (or raises): the writer
                    # gets a tier's copy, or a copy of its own
                    self._enqueue(key, sources[i] if sources[i] is not blob else _copied(blob), later[i])
        # NOTE: a value queued for the tiers below was not refused by every target: it is being stored
        return [Stored(w, src, None if q else r) for w, src, r, q in zip(written, sources, refused, later)]

    def _around_failed(
        self,
        items: Sequence[tuple[str, EncodedBlob]],
        written: list[list[str]],
        refused: list[CapacityError | None],
    ) -> None:
        """With ``write_around``: each item no tier took (its persistent tiers failed just now) into the highest
        memory tier that takes it, so it is not lost while they are skipped."""
        for i, (key, blob) in enumerate(items):
            for tier in () if written[i] else self.tiers:
                if not tier.persistent and blob.nbytes <= tier.capacity and self.healthy(tier):
                    if self._put_one(tier, key, blob) is True:
                        written[i].append(tier.name)
                        refused[i] = None
                        break

    def _targets(self, blob: EncodedBlob) -> list[StorageTier]:
        """Where a new entry goes: the highest usable tier it fits (with ``write_around``, the highest persistent
        one, unless none is usable), then every persistent tier below."""
        fits = [i for i, t in enumerate(self.tiers) if blob.nbytes <= t.capacity and self._health[t.name].usable()]
        if self.write_around:
            fits = [i for i in fits if self.tiers[i].persistent] or fits
        return [self.tiers[fits[0]], *self._persistent_below[fits[0]]] if fits else []

    def _put_into(self, tier: StorageTier, batch: list[tuple[str, EncodedBlob]]) -> list[bool | CapacityError]:
        """Put ``batch`` into ``tier``: per entry, whether it was written (or the refusal)."""
        batch_writes = self._caps[tier.name].batch_writes if len(batch) > 1 else None
        total = 0 if batch_writes is None else sum(blob.nbytes for _key, blob in batch)
        # NOTE: a batch larger than the tier goes one at a time: room made for all of it would empty the tier
        if batch_writes is not None and total <= tier.capacity:
            with self._filling(tier, [key for key, _blob in batch]):
                self._make_room(tier, total)
                try:
                    done = self._ran(tier, batch_writes.put_many, batch)
                except CapacityError:  # one of them is too large for this tier: one at a time, below
                    done = None
            if done is not None:
                if done:
                    self._offload(tier)
                return [done] * len(batch)
        return [self._put_one(tier, key, blob) for key, blob in batch]

    def _filling(self, tier: StorageTier, keys: list[str]) -> contextlib.AbstractContextManager[object]:
        """Before a put of ``keys`` into ``tier``: count guesses among them as wasted (overwritten, or promoted
        again after they left: either way unused); returns what the put runs under: the room lock for a memory
        tier, so that room made for a put is not taken by another thread's put before it lands.

        NOTE: the lock itself, not a generator-based context: a 64 KiB store is ~50 us, and one of those
        cost 2-3 us of it."""
        if tier is self.guess_tier:
            for key in keys:
                self.guesses.wasted(key)
        return self._room_lock if self._caps[tier.name].shares_buffers else contextlib.nullcontext()

    def _put_one(self, tier: StorageTier, key: str, blob: EncodedBlob) -> bool | CapacityError:
        with self._filling(tier, [key]):
            for attempt in range(2):
                self._make_room(tier, blob.nbytes)
                try:
                    done = self._ran(tier, tier.put, key, blob)
                    break
                except CapacityError as exc:
                    # a per-value limit (Redis's 512 MiB), or a memory tier whose pages views took
                    # meanwhile: room is made once more; then this value only is refused here
                    if attempt:
                        log.warning("kvmem: tier %s refused key %s: %s", tier.name, key, exc)
                        return exc
        if not done:
            return False
        self._offload(tier)
        return True

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier (and from the write-back queue)."""
        with self._pending_cv:
            pending = self._pending.pop(key, None) is not None
            while self._writing == key:  # NOTE: let an in-flight write-back land, then delete it too
                self._pending_cv.wait()
        found = [bool(self._call(t, t.delete, key)) for t in self.tiers]
        self.guesses.wasted(key)
        return pending or any(found)

    # -- offload ------------------------------------------------------------
    def _make_room(self, tier: StorageTier, incoming: int) -> None:
        """Before a put: drop guesses, then move LRU entries down, until ``incoming`` bytes fit under capacity."""
        with self._room_lock:
            self._shed(tier, tier.capacity - incoming)

    def enforce_threshold(self, tier: StorageTier) -> None:
        """Demote or evict until ``tier`` is at or below ``offload_threshold`` of its capacity."""
        self._offload(tier)

    def _offload(self, tier: StorageTier) -> None:
        """After a put: keep ``tier`` at or below ``offload_threshold`` of its capacity.

        The last tier has nowhere to offload to; it only evicts at capacity (``_make_room``).

        NOTE: guesses are not counted against the threshold (they hold room it leaves idle) and are not shed
        here: they go first when a put needs room (:meth:`_make_room`).
        """
        guessed = self.guesses.nbytes if tier is self.guess_tier else 0
        if tier is not self.tiers[-1] and tier.usage() - guessed > tier.capacity * self.offload_threshold:
            with self._room_lock:
                self._shed(tier, int(tier.capacity * self.offload_threshold) + guessed, spare_guesses=True)

    def _shed(self, tier: StorageTier, limit: int, spare_guesses: bool = False) -> None:
        """Move entries of ``tier`` down (or drop them) until its usage is at most ``limit``: its guesses first,
        oldest first, then its entries in LRU order (guesses spared with ``spare_guesses``)."""
        if self._caps[tier.name].self_evicting or tier.usage() <= limit:
            return
        lower = self.tiers[self.tiers.index(tier) + 1 :]
        victims = tier.keys()  # NOTE: read lazily
        if tier is self.guess_tier and spare_guesses:
            # NOTE: skipped by a C-level filter: unused guesses age to the front of the LRU order, and a
            # loop turn for each (usage read, membership test) made a promotion twice as slow
            victims = itertools.filterfalse(self.guesses.holds, victims)
        elif tier is self.guess_tier:
            victims = itertools.chain(self.guesses.oldest(), victims)
        for victim in victims:
            if tier.usage() <= limit:
                break
            if self._demote(victim, tier, lower):
                continue
            elsewhere = any(self._call(t, t.contains, victim) for t in self.tiers if t is not tier)
            if self._call(tier, tier.delete, victim):
                self.metrics.evictions.labels(tier=tier.name).inc()
                if not elsewhere and self.on_removed is not None:
                    self.on_removed(victim)

    def _demote(self, key: str, tier: StorageTier, lower: list[StorageTier]) -> bool:
        """Move ``key`` to the first usable lower tier (a drop if it is already there)."""
        with self._pending_cv:
            pending = key in self._pending
        encoded: EncodedBlob | None = None
        for target in lower:
            if not self.healthy(target):
                continue
            if not pending and self._call(target, target.contains, key):
                break
            if encoded is None:
                try:
                    encoded = self._call(tier, self._lend, tier, key)
                except IntegrityError as exc:  # never moved down: a corrupt copy is taken out of service
                    self._corrupt(tier, key, exc)
                    return False
                if encoded is None:
                    return False
            if encoded.nbytes > target.capacity:
                continue
            self._shed(target, target.capacity - encoded.nbytes)
            try:
                if self._ran(target, target.put, key, encoded):
                    break
            except CapacityError:  # no room below after all (its pages are held): try the next tier down
                continue
        else:
            return False
        self._call(tier, tier.delete, key)
        if tier is self.guess_tier:
            self.guesses.wasted(key)
        self.metrics.demotions.labels(tier=tier.name).inc()
        return True

    def _lend(self, tier: StorageTier, key: str) -> EncodedBlob | None:
        """``key``'s blob in ``tier``, to be written to another: lent without a copy where the tier can, else
        read and checked as a load is (:meth:`_read_owned`), so no tier ever takes in bytes that fail their CRC.

        Raises:
            IntegrityError: the copy in ``tier`` does not match its CRC, or names another key as its owner.
        """
        lender = self._caps[tier.name].lends_blobs
        lent = lender.blob(key) if lender is not None else None
        if lent is not None:
            return lent
        got = self._read_owned(tier, key)
        if got is None:
            return None
        if got.head is not None and "info" in got.head[0]:  # a blob of Memory's names its key: not another's
            check_owner(got.head[0], key)
        return EncodedBlob.from_buffer(got.buf, got.head)

    # -- write-back ---------------------------------------------------------
    def _enqueue(self, key: str, encoded: EncodedBlob, targets: list[StorageTier]) -> None:
        with self._pending_cv:
            while len(self._pending) >= self._queue_size and key not in self._pending and not self._closed:
                self._pending_cv.wait()
            self._pending[key] = (encoded, targets)
            self._pending.move_to_end(key)
            self._pending_cv.notify_all()

    def _write_back_loop(self) -> None:
        yield_to_compute()
        while True:
            with self._pending_cv:
                while not self._pending and not self._closed:
                    self._pending_cv.wait()
                if not self._pending:
                    return
                key, (encoded, targets) = next(iter(self._pending.items()))
                self._writing = key
            try:
                for tier in targets:
                    self._put_one(tier, key, encoded)  # a refusal (too large) is logged there, never raised
            finally:
                with self._pending_cv:
                    self._writing = None
                    if self._pending.get(key, (None,))[0] is encoded:
                        del self._pending[key]
                    self._pending_cv.notify_all()

    def flush(self) -> None:
        """Wait for queued write-backs, then make durable tiers durable."""
        with self._pending_cv:
            while self._pending and self._writer is not None and self._writer.is_alive():
                self._pending_cv.wait(timeout=0.1)
        for tier in self.tiers:
            durable = self._caps[tier.name].durable
            if durable is not None:
                self._ran(tier, durable.flush)

    def close(self) -> None:
        """Flush, stop the writer, close every tier."""
        self.flush()
        with self._pending_cv:
            self._closed = True
            self._pending_cv.notify_all()
        if self._writer is not None:
            self._writer.join()
        for tier in self.tiers:
            self._ran(tier, tier.close)


def _count_keys(tier: StorageTier) -> int:
    return sum(1 for _ in tier.keys())


def _copied(encoded: EncodedBlob) -> EncodedBlob:
    """``encoded`` copied into a buffer of its own (sealed), for a write-back that no tier's copy can serve."""
    buf = encoded.to_tensor()
    return EncodedBlob.from_buffer(buf, (encoded.header, encoded.start) if encoded.header is not None else None)
