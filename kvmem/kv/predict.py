"""Predictive prefetch: after each request, warm the chunks of the prefixes likely to come next.

:class:`PredictivePrefetcher` feeds every request it is told about to a
:class:`~kvmem.kv.patterns.RequestPatterns` model and copies the chunks of the
heads it predicts from disk or the remote tier into the last memory tier (the
CPU tier), on one background thread: :meth:`PredictivePrefetcher.observe` only
queues, so the caller's request never waits on the model or the I/O. Each guess
is copied while no request is in flight (``Memory.activity``, see
:mod:`kvmem.activity`): on a host with few cores a copy running beside a request
slows it, and such requests made the latency tail.

A guess only takes room no entry uses and is dropped first when a put needs the
room (:mod:`kvmem.stores.guesses`): it never evicts data a request used. Every
decision is counted in ``kvmem_predictive_prefetch_total{outcome}`` (``predicted``,
``warmed``, ``resident``, ``no_room``, ``missing``, ``used``, ``wasted``) and
``kvmem_predictive_prefetch_bytes_total{outcome}``; ``kvmem doctor`` reads them.

``PrefixCache`` runs one when ``config.predictive_prefetch`` is set; a server that
keys its own chunks calls :meth:`~PredictivePrefetcher.observe` after each request.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvmem.api import Memory
from kvmem.errors import ConfigError, KVMemError
from kvmem.kv.patterns import Prediction, RequestPatterns

__all__ = ["PredictivePrefetcher"]

log = logging.getLogger(__name__)


class PredictivePrefetcher:
    """Learns which prefixes follow which, per namespace, and warms the likely next ones in the background.

    Args:
        memory: where the chunks are stored and warmed.
        patterns: the model (a default :class:`~kvmem.kv.patterns.RequestPatterns` when ``None``).
        budget: bytes warmed after one request before it stops (default ``config.predictive_prefetch_budget``;
            the entry that reaches it is warmed whole).
        limit: most heads warmed after one request.
        max_pending: requests queued for the worker at most; past it the oldest is dropped unlearnt
            (the caller never blocks).
        max_wait: seconds a guess waits for a moment with no request in flight before it is copied
            anyway (a server that is never idle still gets its guesses, later).

    Raises:
        ConfigError: ``budget``, ``limit`` or ``max_pending`` below 1, or ``max_wait`` below 0.
    """

    def __init__(
        self,
        memory: Memory,
        *,
        patterns: RequestPatterns | None = None,
        budget: int | None = None,
        limit: int = 4,
        max_pending: int = 1024,
        max_wait: float = 0.05,
    ) -> None:
        self.memory = memory
        self.patterns = patterns if patterns is not None else RequestPatterns()
        self.budget = memory.config.predictive_prefetch_budget if budget is None else budget
        for name, value in (("budget", self.budget), ("limit", limit), ("max_pending", max_pending)):
            if value < 1:
                raise ConfigError(f"{name}={value!r}: accepted an integer >= 1")
        if not max_wait >= 0:
            raise ConfigError(f"max_wait={max_wait!r}: accepted a number of seconds >= 0")
        self.limit = limit
        self.max_wait = max_wait
        self._max_pending = max_pending
        self._queue: list[tuple[str, str, tuple[str, ...]]] = []  # (namespace, stream, keys), oldest first
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._worker = threading.Thread(target=self._loop, name="kvmem-predictive-prefetch", daemon=True)
        self._worker.start()

    def observe(self, keys: Sequence[str], *, namespace: str = "", stream: str = "") -> None:
        """Queue one request for learning, and the warming of what should follow it; returns at once.

        Args:
            keys: the request's chunk keys, first chunk first (as given to ``Memory.store``).
            namespace: their namespace (patterns are learnt per namespace).
            stream: what orders requests within it: a session or user id (``""``: one stream).
        """
        if not keys:
            return
        with self._cv:
            if self._closed:
                return
            if len(self._queue) >= self._max_pending:
                del self._queue[0]
            self._queue.append((namespace, stream, tuple(keys)))
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait until every queued request was learnt from and its warming is done."""
        with self._cv:
            while (self._queue or self._busy) and self._worker.is_alive():
                self._cv.wait(timeout=0.1)

    def close(self) -> None:
        """Finish the queued work and stop the worker."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join()

    # -- worker --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
                self._busy = True
            try:
                self._run(batch)
            except KVMemError as exc:  # a failed guess must never stop the learning
                log.warning("kvmem: predictive prefetch failed: %s", exc)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _run(self, batch: list[tuple[str, str, tuple[str, ...]]]) -> None:
        """Learn from ``batch``; then warm for the newest request of each of its streams (older ones are stale)."""
        for namespace, stream, keys in batch:
            self.patterns.observe(namespace, keys, stream)
        newest = OrderedDict(((namespace, stream), None) for namespace, stream, _keys in reversed(batch))
        for namespace, stream in newest:
            self._warm(namespace, self.patterns.predict(namespace, stream, self.limit))

    def _warm(self, namespace: str, predictions: list[Prediction]) -> None:
        """Warm the predicted heads' chunks in order, within :attr:`budget`, until the tier has no room.

        A head's chunks are warmed first to last and stop at the first missing one: a prefix
        is reused up to its first gap, so chunks past it would be wasted. Each waits for a moment
        with no request in flight (at most :attr:`max_wait`).
        """
        if not predictions:  # NOTE: the common case where nothing can be learnt: no port made, no metric touched
            return
        store = self.memory.chunk_store()
        count = self.memory.metrics.count_guess
        moved = 0
        for prediction in predictions:
            for key in prediction.keys:
                if moved >= self.budget:
                    return
                count("predicted")
                self.memory.activity.wait_idle(self.max_wait)
                outcome, nbytes = store.speculate(self.memory.storage_key(key, namespace))
                moved += nbytes
                if outcome != "warmed":  # warmed is counted, with its bytes, where the guess is recorded
                    count(outcome)
                if outcome == "no_room":
                    return
                if outcome == "missing":
                    break
