"""Requests in flight on a Memory, so that background work can wait for a moment with none.

Predictive prefetch copies guessed chunks on a background thread. On a host with few
cores that copy is Python work competing with the request for the interpreter lock and
the cores, and a request that arrives while a guess is being copied can wait for it: the
tail of the latency distribution is made of such requests. So the request paths
(``Memory.load``, ``load_many``, ``fetch``, ``store``, ``store_many``, ``PrefixCache.prefill``)
count themselves in :class:`Activity`, and the prefetcher copies each guess only when none is
in flight (or once it waited its longest: a server that is never idle still gets its guesses,
later).

Cost on the request path: one lock taken twice per call (~0.3 us).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["Activity", "serving"]

P = ParamSpec("P")
R = TypeVar("R")


class Activity:
    """A count of requests in flight; ``with activity:`` counts one for the block."""

    __slots__ = ("_in_flight", "_cv")

    def __init__(self) -> None:
        self._in_flight = 0
        self._cv = threading.Condition(threading.Lock())

    @property
    def in_flight(self) -> int:
        """Requests running now."""
        return self._in_flight

    def __enter__(self) -> None:
        with self._cv:
            self._in_flight += 1

    def __exit__(self, *exc: object) -> None:
        with self._cv:
            self._in_flight -= 1
            if not self._in_flight:
                self._cv.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight, at most ``timeout`` seconds; whether none is."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._in_flight, timeout)


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
