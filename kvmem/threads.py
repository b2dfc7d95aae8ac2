"""The process's shared worker threads, made on first use and made again in a forked child.

NOTE: a forked child has none of its parent's threads, but a ``ThreadPoolExecutor``
copied into it still counts them as workers and would never run a task: the pools
are forgotten at fork, so the child makes its own.

Tasks on these pools never wait for other tasks on the same pool (no nested waits).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["copy_pool", "io_pool"]

_IO_THREADS = 4  # enough queue depth for a virtual disk's cold reads; file copies release the GIL
_COPY_THREADS = min(4, os.cpu_count() or 1)  # memory copies: a strided copy does not reach memory speed on one
_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pools.clear)
