"""Saves off the forward pass's critical path: blocks stored from vLLM's KV cache on a thread of its own.

A save reads its blocks straight out of vLLM's KV cache (no copy in between), so those blocks must stay
as they are until it is done: a finished request whose saves are in flight keeps its blocks
(``request_finished`` returns True) until :meth:`Saver.finished` reports it, and a preempted request's
saves are waited for (:meth:`Saver.wait_for`) before its freed blocks can be written again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from kvmem import Memory
from kvmem.errors import KVMemError
from kvmem.threads import yield_to_compute
from kvmem_vllm.log import logger

__all__ = ["Saver"]


class _Save(NamedTuple):
    """One step's chunks to store (a key and its rows each: views of its blocks, one view of a run of consecutive
    blocks, or a copy of them), and the requests they belong to."""

    req_ids: frozenset[str]
    items: list[tuple[str, list[torch.Tensor] | torch.Tensor]]


class Saver:
    """Stores blocks on a background thread and tracks which requests still have saves in flight.

    Args:
        memory: the worker's memory.
        namespace: the keys' namespace.
        compression: codec of the saved blocks.
    """

    def __init__(self, memory: Memory, namespace: str, compression: str) -> None:
        self.memory = memory
        self.namespace = namespace
        self.compression = compression
        self.saved_blocks = 0
        self.save_seconds = 0.0  # spent storing (on this thread)
        self.queued_blocks = 0  # blocks submitted and not stored (or skipped) yet
        self._queue: queue.SimpleQueue[_Save | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending: Counter[str] = Counter()  # request -> its saves not done yet
        self._known: set[str] = set()  # requests that had saves planned (the scheduler holds their blocks)
        self._finishing: set[str] = set()  # of those, the ones vLLM finished
        self._thread = threading.Thread(target=self._run, name="kvmem-vllm-saver", daemon=True)
        self._thread.start()

    def submit(self, req_ids: Collection[str], items: Sequence[tuple[str, list[torch.Tensor] | torch.Tensor]]) -> None:
        """Store ``items`` (a chunk's key, and the views of its blocks in vLLM's KV cache or a tensor of them: a
        view of consecutive blocks, or a copy) in the background, on behalf of ``req_ids``: each chunk is one
        entry, its blocks the rows of one tensor.

        Every request in ``req_ids`` is reported by :meth:`finished` once finished, even with no items (its
        saves dropped): the scheduler side holds the blocks of every request it planned a save for.
        """
        ids = frozenset(req_ids)
        with self._done:
            self._known |= ids
            if items:
                self._pending.update(ids)
        if items:
            with self._done:
                self.queued_blocks += sum(len(blocks) for _, blocks in items)
            self._queue.put(_Save(ids, list(items)))

    def finished(self, req_ids: Collection[str]) -> set[str]:
        """Of the requests vLLM finished (these and those of earlier calls), the ones whose saves are all done:
        vLLM may free their blocks."""
        with self._done:
            self._finishing |= self._known.intersection(req_ids)
            ready = {r for r in self._finishing if not self._pending[r]}
            self._finishing -= ready
            self._known -= ready
            for r in ready:
                del self._pending[r]
            return ready

    def waiting(self) -> bool:
        """Whether a finished request still waits for its saves."""
        with self._done:
            return any(self._pending[r] for r in self._finishing)

    def wait_for(self, req_ids: Collection[str], timeout: float | None = None) -> None:
        """Block until the saves of ``req_ids`` in flight are done (or ``timeout`` seconds have passed)."""
        with self._done:
            self._done.wait_for(lambda: not any(self._pending[r] for r in req_ids), timeout)

    def wait_any(self, timeout: float) -> None:
        """Block until a save finishes (or ``timeout`` seconds have passed)."""
        with self._done:
            self._done.wait(timeout)

    def close(self) -> None:
        """Finish every save in flight, then stop the thread (nothing queued is lost)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        yield_to_compute()
        while (save := self._queue.get()) is not None:
            start = time.perf_counter()
            try:
                self._store(save.items)
            except KVMemError as exc:  # NOTE: a save that fails costs a future hit, never the request
                logger.warning("kvmem: saving %d chunk(s) failed: %s", len(save.items), exc)
            except Exception:  # NOTE: the thread must go on: a request waiting for its saves would never be freed
                logger.exception("kvmem: saving %d chunk(s) failed", len(save.items))
            finally:
                with self._done:
                    self.save_seconds += time.perf_counter() - start
                    self.queued_blocks -= sum(len(blocks) for _, blocks in save.items)
                    self._pending.subtract(save.req_ids)
                    self._done.notify_all()

    def _store(self, items: list[tuple[str, list[torch.Tensor] | torch.Tensor]]) -> None:
        """Store the chunks not stored yet (a list of block views gathered into one tensor, here, off the
        forward pass's thread).

        NOTE: a request that came while another one's saves of the same chunks were in flight (or was
        computed in the same step) missed them, computed them and saves them too; the keys name the content,
        so what is stored, or twice in this batch, is skipped.
        """
        unique = dict(items)
        stored = self.memory.contains_many(list(unique), namespace=self.namespace)
        todo = [item for item, there in zip(unique.items(), stored) if not there]
        if todo:
            chunks = [
                (key, blocks if isinstance(blocks, torch.Tensor) else torch.stack(blocks)) for key, blocks in todo
            ]
            self.memory.store_many(chunks, namespace=self.namespace, compression=self.compression)
        self.saved_blocks += sum(len(blocks) for _, blocks in todo)
