"""Where kvmem's threads run in a vLLM-CPU worker: on the cores vLLM keeps free of compute, not beside it.

vLLM-CPU binds a worker's main thread and its OpenMP threads to the rank's cores and, binding them itself,
keeps a core of the machine for its frontend and scheduler. A thread inherits the cores of the thread that
makes it, so the saver, loaders and warmer of :mod:`kvmem_vllm.worker`, made from that main thread, would
take their time from the forward passes while the kept core idles (seen on 2 vCPUs: every thread of the
worker process on core 0, core 1 holding the frontend only).
"""

from __future__ import annotations

import os
from collections.abc import Collection

from kvmem.threads import set_background_cpus
from kvmem_vllm.log import logger

__all__ = ["background_cpus", "place_background_threads"]

BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM-CPU's cores per rank: "auto" (its own choice), "nobind", or lists


def background_cpus(compute: Collection[int], bind: str, ranks: int, allowed: Collection[int]) -> set[int]:
    """The cores for kvmem's threads: those ``allowed`` that this rank does not compute on, when vLLM-CPU chose
    the binding itself for one rank (``ranks``) and so kept them. Empty otherwise, and the threads stay where
    made: with several ranks the other cores are theirs; with a hand-written ``bind`` they may be another
    server's (a prefill/decode pair on one machine)."""
    if bind not in ("", "auto") or ranks != 1:
        return set()
    return set(allowed) - set(compute)


def place_background_threads(ranks: int) -> set[int]:
    """Run the kvmem threads made from now on in this worker (one of ``ranks``) on :func:`background_cpus` (the
    calling thread's cores are the compute's; the parent process's are the ones allowed); the cores chosen
    (none: nothing set)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:  # NOTE: a parent gone or not ours to read: the kernel keeps threads inside the cgroup anyway
        allowed = set(range(os.cpu_count() or 1))
    cpus = background_cpus(os.sched_getaffinity(0), os.environ.get(BIND, "auto"), ranks, allowed)
    if cpus:
        set_background_cpus(cpus)
        logger.info("kvmem: saves, loads and warming run on cores %s, beside vLLM's compute", sorted(cpus))
    return cpus
