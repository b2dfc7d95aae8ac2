"""Overlap kvmem's I/O with the model's compute.

- :class:`WriteBehind`: stores run on a background thread after the forward
  pass, so a miss costs the caller (almost) nothing.
- :class:`Prefetcher`: while a request waits in a queue, its chunks move from
  disk / remote into the CPU tier, at most ``depth`` at a time.
- Layer-wise loading lives in :mod:`kvmem.kv.stream` (a cache whose layer ``i``
  waits only for layer ``i``'s bytes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvmem.errors import KVMemError

__all__ = ["WriteBehind", "Prefetcher"]

log = logging.getLogger(__name__)


def _nothing() -> None:
    """A job that does nothing (starts a pool's thread)."""


class WriteBehind:
    """Runs store jobs in order on one background thread, at most ``max_pending`` queued.

    A job that raises a :class:`KVMemError` is logged and dropped: a failed cache
    write must never fail the request that produced the data.
    """

    def __init__(self, max_pending: int = 64) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-write-behind")
        self._slots = threading.BoundedSemaphore(max_pending)
        self._last: Future[None] | None = None
        # NOTE: the thread starts now, not at the first store: starting a thread waits until it runs, which
        # beside a model's busy compute threads takes milliseconds of the request that stores first
        self._pool.submit(_nothing).result()

    def submit(self, job: Callable[[], None]) -> Future[None]:
        """Queue ``job``; blocks while ``max_pending`` jobs are already queued (backpressure)."""
        self._slots.acquire()
        future = self._pool.submit(self._run, job)
        self._last = future
        return future

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except KVMemError as exc:
            log.warning("kvmem: background store failed: %s", exc)
        finally:
            self._slots.release()

    def flush(self) -> None:
        """Wait until every job submitted so far has run."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
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
