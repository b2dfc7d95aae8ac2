"""Requests in flight on a Memory, so that background work can run between them.

Predictive prefetch copies guessed chunks on a background thread. On a host with few
cores that copy is work competing with a request for the interpreter lock and the
cores, and a request that arrives while a guess is being copied waits for it: such
requests made the tail of the latency distribution. So the request paths
(``Memory.load``, ``load_many``, ``fetch``, ``store``, ``store_many``, ``PrefixCache``'s
prefill and generate) count themselves in :class:`Activity`, which also learns how long
the idle spells between requests usually last; the prefetcher starts a copy only when
no request is in flight and the copy should end before the next request typically
arrives (:meth:`Activity.wait_for_room`), or once it waited its longest.

Background stores (:class:`~kvmem.kv.background.WriteBehind`: a ``PrefixCache``'s new
chunks, a ``VisualTokenCache``'s new tokens) wait the same way, for no request in flight
only (:meth:`Activity.wait_idle`), so a miss's store runs after its first token, not
beside its forward pass. A request made of several calls (encode an image, then prefill)
counts itself as one: ``with memory.activity:`` around all of them.

Nothing listens unless a prefetcher or a background writer does (:meth:`Activity.watch`):
until then a request path pays one attribute read. Once watched: a lock taken twice and a clock read per
request (the condition that wakes a waiting prefetcher is notified only when one waits:
its Python-level ``notify_all`` was most of a request's ~6 us here, right after its I/O).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["Activity", "serving"]

P = ParamSpec("P")
R = TypeVar("R")

_GAP_WEIGHT = 0.1  # weight of the latest idle spell in the running mean of their lengths


class Activity:
    """A count of requests in flight (``with activity:`` counts one for the block), and the usual idle spell."""

    __slots__ = ("watched", "_in_flight", "_lock", "_cv", "_waiting", "_idle_since", "_gap")

    def __init__(self) -> None:
        self.watched = False
        """Whether requests are counted (see :meth:`watch`)."""
        self._in_flight = 0
        self._lock = threading.Lock()  # NOTE: taken as it is by requests: a C-level context manager
        self._cv = threading.Condition(self._lock)  # for the waiters of wait_for_room
        self._waiting = 0  # threads in wait_for_room
        self._idle_since = time.perf_counter()
        self._gap: float | None = None  # running mean of the idle spells' lengths (seconds); None: none yet

    @property
    def in_flight(self) -> int:
        """Requests running now."""
        return self._in_flight

    def watch(self) -> None:
        """Count requests from now on (a prefetcher waits for room between them); until then none is counted.

        NOTE: a request that began before this call was not counted; its end is ignored when nothing is in
        flight, else it ends another's count early (once, at the moment watching starts).
        """
        with self._lock:
            if not self.watched:
                self._idle_since = time.perf_counter()
                self.watched = True

    def __enter__(self) -> None:
        if not self.watched:
            return
        with self._lock:
            if not self._in_flight:
                spell = time.perf_counter() - self._idle_since
                self._gap = spell if self._gap is None else self._gap + _GAP_WEIGHT * (spell - self._gap)
            self._in_flight += 1

    def __exit__(self, *exc: object) -> None:
        if not self.watched:
            return
        with self._lock:
            if not self._in_flight:  # it began before watch(): never counted
                return
            self._in_flight -= 1
            if not self._in_flight:
                self._idle_since = time.perf_counter()
                if self._waiting:
                    self._cv.notify_all()

    def wait_for_room(self, seconds: float, timeout: float) -> bool:
        """Wait until no request is in flight and ``seconds`` of work would end before the next request
        usually comes (or it is already later than usual: the stream paused); at most ``timeout`` seconds.

        Returns:
            Whether there is room now (``False``: the wait timed out).
        """
        deadline = time.perf_counter() + timeout
        with self._cv:
            while True:
                now = time.perf_counter()
                until = deadline
                if not self._in_flight:
                    idle = now - self._idle_since
                    if self._gap is None or idle + seconds <= self._gap or idle > self._gap:
                        return True
                    until = min(deadline, self._idle_since + self._gap)  # then later than usual: room
                if now >= deadline:
                    return False
                self._waiting += 1
                try:
                    self._cv.wait(max(0.0, until - now) + 1e-5)  # NOTE: or woken when the next request ends
                finally:
                    self._waiting -= 1

    def wait_idle(self, until: float, hurry: Callable[[], bool]) -> None:
        """Wait until no request is in flight, ``hurry()`` is true (see :meth:`wake`), or ``time.perf_counter()``
        reaches ``until``, whichever comes first."""
        with self._cv:
            while self._in_flight and not hurry():
                left = until - time.perf_counter()
                if left <= 0:
                    return
                self._waiting += 1
                try:
                    self._cv.wait(left)  # NOTE: or woken when the last request in flight ends
                finally:
                    self._waiting -= 1

    def wake(self) -> None:
        """Wake every waiter of :meth:`wait_idle` to check its ``hurry()`` again."""
        with self._cv:
            self._cv.notify_all()


class _Active(Protocol):
    activity: Activity


S = TypeVar("S", bound=_Active)


def serving(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Count each call of ``method`` (of an object with an ``activity``) as a request in flight."""

    @functools.wraps(method)
    def counted(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.activity:
            return method(self, *args, **kwargs)

    return counted
