"""Predictive prefetch: after each request, warm the chunks of the prefixes likely to come next.

:class:`PredictivePrefetcher` feeds every request it is told about to a
:class:`~kvmem.kv.patterns.RequestPatterns` model and copies the chunks of the
heads it predicts from disk or the remote tier into the last memory tier (the
CPU tier). :meth:`PredictivePrefetcher.observe` updates the model and predicts on
the caller's thread (bounded work: ~10 microseconds), and hands the copies,
when there are any, to one background thread: a request stream with nothing to
learn costs no thread wake-up (that hand-off cost more CPU than the model).
Once ``_QUIET_AFTER`` requests in a row predicted nothing, the model learns in
batches of ``_QUIET_BATCH`` requests (and predicts after each batch's last one)
until a prediction comes again: right after a request's I/O little of the model
is in the CPU's caches, and one request alone cost it ~12 us where one in a
batch cost ~6 us (``benchmarks/bench_prefetch.py``'s trace with no structure);
where a pattern starts it is seen a batch late at most. Each
guess is copied while no request is in flight, and only if the copy (its usual
time) should end before the next request usually comes (``Memory.activity``, see
:mod:`kvmem.activity`): on a host with few cores a copy running beside a request
slows it, and such requests made the latency tail.

A guess only takes room no entry uses and is dropped first when a put needs the
room (:mod:`kvmem.stores.guesses`): it never evicts data a request used. It may take
the room of older guesses (oldest first), not of the same request's: a guess left
unused since an earlier request is less likely to be used than one for the latest,
and a document warmed in part is read from below for the rest anyway. Every
decision is counted in ``kvmem_predictive_prefetch_total{outcome}`` (``predicted``,
``warmed``, ``resident``, ``no_room``, ``missing``, ``used``, ``wasted``) and
``kvmem_predictive_prefetch_bytes_total{outcome}``; ``kvmem doctor`` reads them. What
it costs is counted too: the time of its model on the callers' threads (a millisecond at
a time) and the CPU time of its own thread, ``kvmem_predictive_prefetch_cpu_seconds_total``.

``PrefixCache`` runs one when ``config.predictive_prefetch`` is set; a server that
keys its own chunks calls :meth:`~PredictivePrefetcher.observe` after each request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvmem.api import Memory
from kvmem.errors import ConfigError, KVMemError
from kvmem.kv.patterns import Prediction, RequestPatterns
from kvmem.threads import yield_to_compute

__all__ = ["PredictivePrefetcher"]

log = logging.getLogger(__name__)

_QUIET_AFTER = 64
_QUIET_BATCH = 16
_PUBLISH_SECONDS = 0.001
# NOTE: the model's time is added to kvmem_predictive_prefetch_cpu_seconds_total once a millisecond of it
# has gathered (and by flush and close), not per request: the counter's lock and update cost ~2 us a call
# right after a request's I/O here, a tenth of what they counted.


class PredictivePrefetcher:
    """Learns which prefixes follow which, per namespace, and warms the likely next ones in the background.

    Args:
        memory: where the chunks are stored and warmed.
        patterns: the model (a default :class:`~kvmem.kv.patterns.RequestPatterns` when ``None``).
        budget: bytes warmed after one request before it stops (default ``config.predictive_prefetch_budget``;
            the entry that reaches it is warmed whole).
        limit: most heads warmed after one request.
        max_pending: streams whose warming waits for the worker at most; past it the oldest is dropped
            (the caller never blocks; a stream's newer request replaces its older one, now stale).
        max_wait: seconds a guess waits for room between requests before it is copied anyway (a server
            that is never idle still gets its guesses, later).

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
        self._copy_seconds = 0.0  # running mean of one guess's copy time (0: none seen yet)
        self._unpublished = 0.0  # the model's seconds not yet added to its counter (see _PUBLISH_SECONDS)
        self._max_pending = max_pending
        self._model = threading.Lock()  # the model is not thread-safe; requests may come from many threads
        self._unlearnt: list[tuple[str, tuple[str, ...], str]] = []  # (namespace, keys, stream), oldest first
        self._quiet = 0  # requests in a row after which nothing was predicted
        self._queue: OrderedDict[tuple[str, str], list[Prediction]] = OrderedDict()  # (namespace, stream): oldest first
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        memory.activity.watch()  # guesses wait for room between requests: count them
        self._worker = threading.Thread(target=self._loop, name="kvmem-predictive-prefetch", daemon=True)
        self._worker.start()

    def observe(self, keys: Sequence[str], *, namespace: str = "", stream: str = "") -> None:
        """Learn from one request and predict what follows it (on this thread), and queue the warming.

        Call it once the request is served: it takes about ten microseconds (a few while quiet), and never waits
        on I/O.

        Args:
            keys: the request's chunk keys, first chunk first (as given to ``Memory.store``).
            namespace: their namespace (patterns are learnt per namespace).
            stream: what orders requests within it: a session or user id (``""``: one stream).
        """
        if not keys or self._closed:
            return
        self._step((namespace, tuple(keys), stream))

    def _step(self, request: tuple[str, tuple[str, ...], str] | None = None) -> None:
        """Learn what is due and queue the warming of what it predicts; count the model's time.

        With ``request`` (``observe``): queue it, learn at once unless quiet (then once a batch is full), and
        count the model's time a millisecond at a time. Without (``flush``, ``close``): learn every request
        waiting, and count all the time not counted yet.
        """
        start = time.perf_counter()  # NOTE: not thread_time: a system call, ~4 us after a request's I/O here
        with self._model:
            if request is not None:
                self._unlearnt.append(request)
            due = request is None or self._quiet < _QUIET_AFTER or len(self._unlearnt) >= _QUIET_BATCH
            learnt = self._learn() if due and self._unlearnt else None
            if request is not None or learnt is not None:
                self._unpublished += time.perf_counter() - start
            spent = self._unpublished if request is None or self._unpublished >= _PUBLISH_SECONDS else 0.0
            self._unpublished -= spent
        if learnt is not None and learnt[2]:
            self._enqueue(*learnt)
        if spent:
            self.memory.metrics.predictive_cpu.inc(spent)

    def _learn(self) -> tuple[str, str, list[Prediction]]:
        """Feed the requests not learnt yet (at least one) to the model; what follows the last of them:
        its namespace, its stream and the predictions."""
        for namespace, keys, stream in self._unlearnt:
            self.patterns.observe(namespace, keys, stream)
        predictions = self.patterns.predict(namespace, stream, self.limit)
        self._quiet = 0 if predictions else self._quiet + len(self._unlearnt)
        self._unlearnt.clear()
        return namespace, stream, predictions

    def _enqueue(self, namespace: str, stream: str, predictions: list[Prediction]) -> None:
        """Queue the warming of a stream's predictions (replacing its older ones, now stale)."""
        with self._cv:
            self._queue.pop((namespace, stream), None)
            if len(self._queue) >= self._max_pending:
                self._queue.popitem(last=False)
            self._queue[namespace, stream] = predictions
            self._cv.notify_all()

    def flush(self) -> None:
        """Learn every request observed so far, wait until the warming queued is done, count the model's time."""
        self._step()
        with self._cv:
            while (self._queue or self._busy) and self._worker.is_alive():
                self._cv.wait(timeout=0.1)

    def close(self) -> None:
        """Learn what waits in a batch, finish the queued work and stop the worker."""
        self._step()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join()

    # -- worker --------------------------------------------------------------------
    def _loop(self) -> None:
        yield_to_compute()
        cpu = time.thread_time()
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, OrderedDict()
                self._busy = True
            try:
                self._run(batch)
            except KVMemError as exc:  # a failed guess must never stop the learning
                log.warning("kvmem: predictive prefetch failed: %s", exc)
            finally:
                now = time.thread_time()  # the batch's CPU, and waking up for it
                self.memory.metrics.predictive_cpu.inc(now - cpu)
                cpu = now
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _run(self, batch: OrderedDict[tuple[str, str], list[Prediction]]) -> None:
        """Warm each queued stream's predictions, the newest request's first."""
        for (namespace, _stream), predictions in reversed(batch.items()):
            self._warm(namespace, predictions)

    def _warm(self, namespace: str, predictions: list[Prediction]) -> None:
        """Warm the predicted heads' chunks in order, within :attr:`budget`, until the tier has no room.

        A head's chunks are warmed first to last and stop at the first missing one: a prefix
        is reused up to its first gap, so chunks past it would be wasted. Each waits for a moment
        between requests (at most :attr:`max_wait`).
        """
        store = self.memory.chunk_store()
        count = self.memory.metrics.count_guess
        moved = 0
        keep: set[str] = set()  # this request's guesses: a later one of them does not take their room
        for prediction in predictions:
            for key in prediction.keys:
                if moved >= self.budget:
                    return
                count("predicted")
                self.memory.activity.wait_for_room(self._copy_seconds, self.max_wait)
                start = time.perf_counter()
                skey = self.memory.storage_key(key, namespace)
                outcome, nbytes = store.speculate(skey, keep)
                keep.add(skey)
                if outcome == "warmed":
                    took = time.perf_counter() - start
                    self._copy_seconds += 0.1 * (took - self._copy_seconds) if self._copy_seconds else took
                moved += nbytes
                if outcome != "warmed":  # warmed is counted, with its bytes, where the guess is recorded
                    count(outcome)
                if outcome == "no_room":
                    return
                if outcome == "missing":
                    break
