"""The order in which an in-memory tier gives up its entries: LRU, or ARC (scan-resistant).

A memory tier (:class:`~kvmem.stores.memory.MemoryTier`) tells its order about every entry that comes in
(:meth:`added`), is read (:meth:`hit`) or leaves (:meth:`removed`), all under the tier's lock; the tiered
store reads :meth:`victims` lazily when it makes room, demoting or dropping each key it is given until
enough bytes are free.

- ``lru``: least recently used first. One-time reads (a scan of documents read once, a conversation
  that never comes back) push out entries that are read again.
- ``arc``: Adaptive Replacement Cache (Megiddo and Modha, FAST '03), in bytes. Entries read once
  (``T1``) and entries read again (``T2``) are kept apart; the keys of entries that left each list are
  remembered (ghosts ``B1``, ``B2``; keys only, no data) and an entry that comes back while its key is
  remembered joins ``T2``, moving the target size of ``T1`` toward the list that would have kept it.
  Chosen over S3-FIFO by measurement (``benchmarks/sim_eviction.py`` on the traces of
  ``benchmarks/traces.py``): both beat LRU by 4-13 points on chat and RAG traces, but S3-FIFO's small
  FIFO lost 2-3 points on agent traces whose step chunks are read again only after dozens of other
  sessions' steps; ARC lost under 1.

In a tiered store an entry that leaves the CPU tier is usually demoted, not gone: when it is read again it
is promoted back, which is exactly ARC's ghost hit.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from kvmem.config import EVICTIONS
from kvmem.errors import ConfigError
from kvmem.stores.base import lru_keys

__all__ = ["EVICTIONS", "Order", "Lru", "Arc", "order_for"]

_LAZY_VICTIMS = 64  # keys an ARC tier chooses one at a time before the rest is read as a snapshot


class Order(Protocol):
    """An eviction order over a tier's keys; every call but :meth:`victims` is made under the tier's lock."""

    def added(self, key: str, nbytes: int) -> None:
        """``key`` came in (a put, or a promotion), holding ``nbytes``; or was replaced (a put of a key held)."""
        ...

    def hit(self, key: str) -> None:
        """``key`` was read."""
        ...

    def removed(self, key: str) -> None:
        """``key`` left the tier (demoted, evicted, deleted or replaced)."""
        ...

    def victims(self, lock: threading.Lock) -> Iterator[str]:
        """Keys to give up, the first to go first, read lazily (``lock`` taken for each step)."""
        ...


class Lru:
    """Least recently used first: the order of the tier's entries mapping itself (reads move a key to its end)."""

    def __init__(self, entries: OrderedDict[str, object]) -> None:
        self._entries = entries
        self.hit = entries.move_to_end  # NOTE: the read path's one call, as cheap as before policies existed

    def added(self, key: str, nbytes: int) -> None:
        return None  # a new key is at the end of the mapping already

    def removed(self, key: str) -> None:
        return None

    def victims(self, lock: threading.Lock) -> Iterator[str]:
        return lru_keys(self._entries, lock)


class Arc:
    """Adaptive Replacement Cache in bytes (see the module's docstring).

    The cache size ARC reasons about (``c`` in the paper) is :attr:`size`, the most bytes the tier has held:
    a tier that offloads above ``offload_threshold`` holds that share of its capacity, not all of it, and
    ARC sized to the whole capacity aimed its target and its ghosts past what the tier keeps (on the chat
    trace it then kept 3.7 of LRU's points missing of the 7.8 it kept at ``offload_threshold: 1``).
    """

    def __init__(self) -> None:
        self.size = 1  # bytes the tier held at most: T1 + T2's high-water mark
        self.target = 0  # bytes of T1 aimed at ("p" in the paper)
        self._once: OrderedDict[str, int] = OrderedDict()  # T1: read once since it came in; LRU first
        self._again: OrderedDict[str, int] = OrderedDict()  # T2: read again
        self._gone_once: OrderedDict[str, int] = OrderedDict()  # B1: keys that left T1 (ghosts)
        self._gone_again: OrderedDict[str, int] = OrderedDict()  # B2: keys that left T2
        self._bytes = [0, 0, 0, 0]  # T1, T2, B1, B2

    def added(self, key: str, nbytes: int) -> None:
        for live, at in ((self._once, 0), (self._again, 1)):
            old = live.pop(key, None)
            if old is not None:  # replaced: it keeps its place among entries read once or again
                self._bytes[at] -= old
                self._put(live, at, key, nbytes)
                return
        if key in self._gone_once:  # T1 was too small for it: let T1 grow
            ratio = self._bytes[3] / max(1, self._bytes[2])
            self.target = min(self.size, self.target + max(nbytes, int(nbytes * ratio)))
            self._forget_ghost(key)
            self._put(self._again, 1, key, nbytes)
        elif key in self._gone_again:  # T2 was too small for it: let T2 grow
            ratio = self._bytes[2] / max(1, self._bytes[3])
            self.target = max(0, self.target - max(nbytes, int(nbytes * ratio)))
            self._forget_ghost(key)
            self._put(self._again, 1, key, nbytes)
        else:
            self._put(self._once, 0, key, nbytes)
        self._trim_ghosts()

    def hit(self, key: str) -> None:
        nbytes = self._once.pop(key, None)
        if nbytes is not None:
            self._bytes[0] -= nbytes
            self._put(self._again, 1, key, nbytes)
        elif key in self._again:
            self._again.move_to_end(key)

    def removed(self, key: str) -> None:
        for live, ghosts, at in ((self._once, self._gone_once, 0), (self._again, self._gone_again, 1)):
            nbytes = live.pop(key, None)
            if nbytes is not None:
                self._bytes[at] -= nbytes
                self._put(ghosts, at + 2, key, nbytes)
                self._trim_ghosts()
                return

    def victims(self, lock: threading.Lock) -> Iterator[str]:
        """T1's oldest while T1 is over its target (or T2 is empty), else T2's oldest; one key at a time, for
        the first :data:`_LAZY_VICTIMS` keys, then the rest as one snapshot in the order of that moment.

        A key yielded and not removed by the caller (it could not be moved) is not yielded again.

        NOTE: making room takes a key or two; a reader that goes on is listing the tier (``entry_count``,
        maintenance), for which choosing each key anew would cost O(entries) a key.
        """
        offered: set[str] = set()
        for _ in range(_LAZY_VICTIMS):
            with lock:
                key = self._next(offered)
            if key is None:
                return
            offered.add(key)
            yield key
        with lock:
            rest = [key for key in itertools.chain(*self._lists()) if key not in offered]
        yield from rest

    def _lists(self) -> tuple[OrderedDict[str, int], OrderedDict[str, int]]:
        """The list to take victims from first, then the other (ARC's REPLACE)."""
        if self._bytes[0] > self.target or not self._again:
            return self._once, self._again
        return self._again, self._once

    def _next(self, offered: set[str]) -> str | None:
        for entries in self._lists():
            for key in entries:
                if key not in offered:
                    return key
        return None

    def _put(self, into: OrderedDict[str, int], at: int, key: str, nbytes: int) -> None:
        into[key] = nbytes
        self._bytes[at] += nbytes
        if at < 2:
            self.size = max(self.size, self._bytes[0] + self._bytes[1])

    def _forget_ghost(self, key: str) -> None:
        for ghosts, at in ((self._gone_once, 2), (self._gone_again, 3)):
            nbytes = ghosts.pop(key, None)
            if nbytes is not None:
                self._bytes[at] -= nbytes

    def _trim_ghosts(self) -> None:
        """Remember no more than the paper's directory: T1 + B1 <= size, all four lists <= 2 x size."""
        t1, t2, b1, b2 = self._bytes
        while self._gone_once and t1 + b1 > self.size:
            b1 -= self._gone_once.popitem(last=False)[1]
        while self._gone_again and t1 + t2 + b1 + b2 > 2 * self.size:
            b2 -= self._gone_again.popitem(last=False)[1]
        self._bytes[2], self._bytes[3] = b1, b2


def order_for(eviction: str, entries: OrderedDict[str, object]) -> Order:
    """The order named ``eviction`` (one of :data:`EVICTIONS`) for a tier holding ``entries``.

    Raises:
        ConfigError: ``eviction`` is not one of :data:`EVICTIONS` (a tier built directly, not from a
            checked :class:`~kvmem.config.Config`).
    """
    if eviction == "arc":
        return Arc()
    if eviction == "lru":
        return Lru(entries)
    raise ConfigError(f"eviction={eviction!r}: accepted {' | '.join(EVICTIONS)}")
