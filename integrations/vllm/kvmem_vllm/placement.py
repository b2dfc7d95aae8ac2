"""Where kvmem's threads run in a vLLM-CPU worker: on the cores vLLM keeps free of compute, not beside it.

vLLM-CPU binds a worker's main thread and its OpenMP threads to the rank's cores (and, by default, keeps a
core of the machine for its frontend and scheduler). A thread inherits the cores of the thread that makes
it, so the saver, loaders and warmer of :mod:`kvmem_vllm.worker`, and kvmem's own pools, made from that
main thread, would take their time from the forward passes while the kept core idles. Measured on 2 vCPUs
(a tiny Llama, doc-QA and chat traces at concurrency 1 to 8): every thread of the worker process sat on
core 0, core 1 held the frontend only.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from kvmem.threads import set_background_cpus
from kvmem_vllm.log import logger

__all__ = ["background_cpus", "place_background_threads"]

BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM-CPU's cores per rank: "auto", "nobind", or lists such as "0-3|4-7"


def background_cpus(compute: Collection[int], bind: str, allowed: Collection[int]) -> set[int]:
    """The cores for kvmem's threads: those ``allowed`` on which no rank computes (this rank's ``compute`` cores,
    and every rank's of a hand-written ``bind``); empty when there are none (the threads then stay where made)."""
    busy = set(compute)
    if bind not in ("", "auto", "nobind"):
        for rank in bind.split("|"):
            for part in filter(None, rank.split(",")):
                first, _, last = part.partition("-")
                busy.update(range(int(first), int(last or first) + 1))
    return set(allowed) - busy


def place_background_threads() -> set[int]:
    """Run the kvmem threads made from now on in this worker on :func:`background_cpus` (the calling thread's
    cores are the compute's; the parent process's are the ones allowed); the cores chosen (none: nothing set)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:  # NOTE: a parent gone or not ours to read: the kernel keeps threads inside the cgroup anyway
        allowed = set(range(os.cpu_count() or 1))
    cpus = background_cpus(os.sched_getaffinity(0), os.environ.get(BIND, "auto"), allowed)
    if cpus:
        set_background_cpus(cpus)
        logger.info("kvmem: saves, loads and warming run on cores %s, beside vLLM's compute", sorted(cpus))
    return cpus
