"""A working process for the metrics tests: a ``Memory`` serving its own ``/metrics`` while it works.

Run as ``python -m tests.metrics_worker PATH`` from the repository root. It opens a
``Memory`` on PATH with ``metrics_port=0``, prints ``URL <url>``, then does one step per
line read from stdin and prints ``DONE <step>`` after it; it closes at the end of input.

Steps:
    values   store ``VALUES`` values, load each back, then load one key never stored
    kv       prefill one prompt through a ``PrefixCache`` on a tiny Llama, cold then warm
             (``KV_CHUNKS`` chunks of ``BLOCK`` tokens), then prefetch it
"""

from __future__ import annotations

import sys

import torch

import kvmem
from kvmem.kv import PrefixCache
from tests.kv.workers import BLOCK, build_model, prompt

VALUES = 3
KV_CHUNKS = 3


def store_and_load(memory: kvmem.Memory, step: int) -> None:
    """Store ``VALUES`` values (100 KB each), load them back, miss one key."""
    for i in range(VALUES):
        memory.store(f"step{step}/value{i}", torch.full((25_000,), float(i)))
    for i in range(VALUES):
        assert memory.load(f"step{step}/value{i}") is not None
    assert memory.load(f"step{step}/never stored") is None


def prefill_twice(memory: kvmem.Memory) -> None:
    """One cold and one warm prefill of a ``KV_CHUNKS``-chunk prompt, then a prefetch of it."""
    pc = PrefixCache(build_model("llama"), memory, block_size=BLOCK, compression="none")
    ids = prompt(30, KV_CHUNKS * BLOCK + 3)
    pc.prefill(ids)
    pc.flush()
    assert pc.prefill(ids).reused_tokens == KV_CHUNKS * BLOCK
    assert pc.prefetch(ids).result(timeout=60) == KV_CHUNKS
    pc.close()


def main(path: str) -> None:
    torch.set_num_threads(1)
    with kvmem.Memory(path, cpu_bytes="64MiB", disk_bytes="256MiB", fsync="never", metrics_port=0) as memory:
        print(f"URL {memory.metrics_url}", flush=True)
        for step, line in enumerate(sys.stdin):
            if line.strip() == "values":
                store_and_load(memory, step)
            elif line.strip() == "kv":
                prefill_twice(memory)
            else:
                raise SystemExit(f"unknown step {line.strip()!r}: expected values | kv")
            print(f"DONE {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
