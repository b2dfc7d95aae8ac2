"""Entries a memory tier holds on a guess (a predictive prefetch), until they are used or leave it.

A guess lives only in the room the tier would leave idle (less 1/16 of the tier,
kept for a request's misses): the tiered store counts guesses outside
``offload_threshold`` (real entries are shed to the threshold as if no guess were
there) and drops guesses, oldest first, before any real entry when a put needs
room, and when a newer guess does. So a guess never pushes out data a request used.

Each guess ends one way, counted in ``kvmem_predictive_prefetch_total{outcome}``
and ``kvmem_predictive_prefetch_bytes_total{outcome}``:

- ``used``: a load was served from the tier while it held the guess (it is an
  ordinary entry from then on);
- ``wasted``: it left the tier unused (dropped for room, deleted, overwritten,
  quarantined).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from kvmem.metrics import Metrics

__all__ = ["Guesses"]


class Guesses:
    """The guesses one tier holds, oldest first, with their sizes.

    Args:
        metrics: where outcomes are counted.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._held: OrderedDict[str, int] = OrderedDict()  # key -> blob bytes; order: oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.holds: Callable[[object], bool] = self._held.__contains__
        """``key in guesses`` as a C-level callable (for ``filter`` over a tier's keys)."""

    @property
    def nbytes(self) -> int:
        """Blob bytes the guesses hold."""
        return self._bytes

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def add(self, key: str, nbytes: int) -> None:
        """Record that ``key`` (``nbytes``) was just warmed into the tier on a guess."""
        with self._lock:
            self._bytes += nbytes - self._held.pop(key, 0)
            self._held[key] = nbytes
        self._metrics.count_guess("warmed", nbytes)

    def used(self, key: str) -> None:
        """A load was served from the tier's copy of ``key``: a guess of it counts as used and ends."""
        self._end(key, "used")

    def wasted(self, key: str) -> None:
        """``key`` left the tier (or was overwritten): a guess of it counts as wasted and ends."""
        self._end(key, "wasted")

    def oldest(self) -> list[str]:
        """The keys held on a guess, oldest first (a snapshot)."""
        with self._lock:
            return list(self._held)

    def _end(self, key: str, outcome: str) -> None:
        if key not in self._held:  # NOTE: the common case, read without the lock (a dict lookup is atomic)
            return
        with self._lock:
            nbytes = self._held.pop(key, None)
            if nbytes is None:
                return
            self._bytes -= nbytes
        self._metrics.count_guess(outcome, nbytes)
