"""Overlap kvmem's I/O with the model's compute.

- :class:`WriteBehind`: stores run on a background thread once no request is in
  flight (after the first token of the request that queued them), so a miss costs
  the caller (almost) nothing.
- :class:`Prefetcher`: while a request waits in a queue, its chunks move from
  disk / remote into the CPU tier, at most ``depth`` at a time.
- Layer-wise loading lives in :mod:`kvmem.kv.stream` (a cache whose layer ``i``
  waits only for layer ``i``'s bytes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvmem.errors import KVMemError
from kvmem.threads import yield_to_compute

if TYPE_CHECKING:
    from kvmem.activity import Activity

__all__ = ["WriteBehind", "Prefetcher"]

log = logging.getLogger(__name__)


def _nothing() -> None:
    """A job that does nothing (starts a pool's thread)."""


class WriteBehind:
    """Runs store jobs in order on one background thread, at most ``max_pending`` queued.

    Given a memory's ``activity``, a job waits until no request is in flight on it (on a
    host with few cores a store beside a forward pass slows the pass: the store's copy,
    CRC and file write compete for the cores), at most ``max_wait`` seconds after it was
    queued (a server that is never idle still stores), and not at all once :meth:`flush`
    or :meth:`close` waits for it.

    A job that raises a :class:`KVMemError` is logged and dropped: a failed cache
    write must never fail the request that produced the data.
    """

    def __init__(self, max_pending: int = 64, *, activity: Activity | None = None, max_wait: float = 0.05) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvmem-write-behind", initializer=yield_to_compute
        )
        self._slots = threading.BoundedSemaphore(max_pending)
        self._last: Future[None] | None = None
        self._activity = activity
        self._max_wait = max_wait
        self._hurry = 0  # flushes and closes waiting: queued jobs wait for no request
        self._hurry_lock = threading.Lock()
        if activity is not None:
            activity.watch()  # NOTE: requests are counted from now on
        # NOTE: the thread starts now, not at the first store: starting a thread waits until it runs, which
        # beside a model's busy compute threads takes milliseconds of the request that stores first
        self._pool.submit(_nothing).result()

    def submit(self, job: Callable[[], None]) -> Future[None]:
        """Queue ``job``; blocks while ``max_pending`` jobs are already queued (backpressure)."""
        self._slots.acquire()
        future = self._pool.submit(self._run, job, time.perf_counter() + self._max_wait)
        self._last = future
        return future

    def _run(self, job: Callable[[], None], until: float) -> None:
        try:
            if self._activity is not None:
                self._activity.wait_idle(until, self._hurried)
            job()
        except KVMemError as exc:
            log.warning("kvmem: background store failed: %s", exc)
        finally:
            self._slots.release()

    def _hurried(self) -> bool:
        return self._hurry > 0

    @contextmanager
    def _hurrying(self) -> Iterator[None]:
        """Queued jobs run without waiting for the requests in flight while the block runs."""
        with self._hurry_lock:
            self._hurry += 1
        if self._activity is not None:
            self._activity.wake()
        try:
            yield
        finally:
            with self._hurry_lock:
                self._hurry -= 1

    def flush(self) -> None:
        """Wait until every job submitted so far has run."""
        last = self._last
        if last is not None:
            with self._hurrying():
                last.result()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._hurrying():
            self._pool.shutdown(wait=True)


class Prefetcher:
    """Warms entries into the upper tiers in the background, ``depth`` loads at a time.

    Args:
        warm: loads one entry (promoting it on the way); returns whether it was found.
        depth: loads in flight at once (``config.prefetch_depth``).
        observe: called with the seconds each prefetch batch took.
    """

    def __init__(self, warm: Callable[[str], bool], depth: int, observe: Callable[[float], None]) -> None:
        self._warm = warm
        self._observe = observe
        self._pool = ThreadPoolExecutor(max_workers=max(1, depth), thread_name_prefix="kvmem-prefetch")

    def prefetch(self, keys: list[str]) -> Future[int]:
        """Warm ``keys`` in order, stopping at the first miss; the future gives how many were found."""
        return self._pool.submit(self._run, keys)

    def _run(self, keys: list[str]) -> int:
        start = time.perf_counter()
        found = 0
        for key in keys:
            if not self._warm(key):
                break
            found += 1
        self._observe(time.perf_counter() - start)
        return found

    def close(self) -> None:
        self._pool.shutdown(wait=True)
