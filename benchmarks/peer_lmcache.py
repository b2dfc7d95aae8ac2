"""LMCache side of the kvmem-vs-LMCache storage benchmark: a long-lived worker.

Runs inside LMCache's own venv (CPU-only LMCache 0.5.6), made by
``shared/peers/lmcache_env.sh``. The kvmem-side harness, in another venv, starts it,
writes one JSON command per line on stdin and reads one JSON answer per line on
stdout, so LMCache and kvmem repetitions can alternate within one run. Only those
answers go to stdout: file descriptor 1 is pointed at stderr before LMCache is
imported, so its logs (and any stray print) can never corrupt the protocol.

Workload: one 4,096-token prompt of a Llama-3-8B layout, held in one bf16 tensor
``kv[2, 32, 4096, 1024]`` (K/V, layers, tokens, 8 heads x 128 head_dim; 537 MB),
16 chunks of 256 tokens, chunk i being the non-contiguous slice
``kv[:, :, 256*i:256*(i+1), :]``.

LMCache is driven through its real engine API: ``LMCacheEngineBuilder.get_or_create``
with an ``LMCacheEngineConfig`` (``chunk_size`` 256) and ``LMCacheMetadata``
(``kv_shape`` (32, 2, 256, 8, 128), bf16), then ``engine.post_init()`` (which builds
the StorageManager), ``engine.store(tokens, kv=src)`` and
``engine.retrieve(tokens, kv=dst)``. LMCache's memory objects for this layout are
``[2, layers, tokens, hidden]`` (format KV_2LTD), the same layout as the KV tensor;
the GPU connector below (LMCache's MockGPUConnector copies nothing) does one
``copy_`` per chunk between the slice and the memory object. Two engines:

* ``cpu``: ``local_cpu=True``, no disk. ``store_cpu`` times ``engine.store`` (16 chunk
  copies into LocalCPUBackend objects); ``load_cpu`` times ``engine.retrieve`` (the
  hot-cache hit, copied back into the destination tensor).
* ``disk``: ``local_cpu=False`` with ``local_disk=--dir``. In 0.5.6 ``local_cpu=False``
  keeps LocalCPUBackend only as the allocator (its hot cache stays empty: puts and
  the write-back after a disk hit are no-ops), the same as LMCache's own "local_disk"
  preset, so every retrieve reads the chunk files (LocalDiskBackend.batched_get_blocking,
  one ``readinto`` per file on its 4 read threads) and copies them into the destination.
  The prompt is stored there once, at setup; disk writes are asynchronous, so setup
  waits (untimed) until ``engine.lookup`` sees all 4,096 tokens on disk.

Each timed op measures ``time.perf_counter`` around exactly the LMCache call that does
the work; clearing, page-cache dropping and checks happen outside it.
"""

from __future__ import annotations

import os
import sys

os.environ.update(LMCACHE_LOG_LEVEL="ERROR", LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)  # answers only; fd 1 becomes stderr
os.dup2(2, 1)
sys.stdout = sys.stderr

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import lmcache  # noqa: E402
import torch  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: E402
from lmcache.v1.memory_management import MemoryObj  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
HIDDEN = HEADS * HEAD_DIM
DTYPE = torch.bfloat16
SEED = 1234
GB = 1024**3


class CopyConnector(GPUConnectorInterface):
    """Copies chunks between a ``[2, L, T, D]`` KV tensor (kwarg ``kv``) and memory objects."""

    def __init__(self, layers: int, hidden: int) -> None:
        self.layers, self.hidden = layers, hidden

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end, :])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kv"][:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:  # type: ignore[override]
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:  # type: ignore[override]
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])


def make_config(name: str, chunk: int, cpu_bytes: int, disk_dir: str | None, disk_bytes: int) -> LMCacheEngineConfig:
    """Engine config: CPU hot cache only, or disk with the CPU backend as allocator only."""
    return LMCacheEngineConfig.from_defaults(
        chunk_size=chunk,
        local_cpu=disk_dir is None,
        max_local_cpu_size=cpu_bytes / GB,
        local_disk=disk_dir,
        max_local_disk_size=disk_bytes / GB if disk_dir else 0.0,
        lmcache_instance_id=f"kvmem-peer-{name}",
    )


def _no_broadcast(*_: Any) -> None:
    """Broadcast callbacks: unused with world_size 1."""


def build_engine(config: LMCacheEngineConfig, chunk: int) -> LMCacheEngine:
    metadata = LMCacheMetadata(
        model_name="llama-3-8b-layout",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, chunk, HEADS, HEAD_DIM),
        chunk_size=chunk,
    )
    connector = CopyConnector(LAYERS, HIDDEN)
    engine = LMCacheEngineBuilder.get_or_create(
        config.lmcache_instance_id, config, metadata, connector, _no_broadcast, _no_broadcast
    )
    engine.post_init()  # creates the StorageManager and its backends
    return engine


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = call()
    return time.perf_counter() - t0, result


def drop_page_cache(root: str) -> None:
    """Write back, then evict from the page cache, every file under ``root``."""
    os.sync()
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Fatal(Exception):
    """A failure after which the worker must not go on (answered, then exit 2)."""


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.shape = (2, LAYERS, args.tokens, HIDDEN)
        self.prompt_bytes = 2 * LAYERS * args.tokens * HIDDEN * DTYPE.itemsize
        self.cpu_bytes = args.cpu_bytes or 2 * self.prompt_bytes
        # 0.5.6 never gives disk budget back on remove/clear: size it for every store
        # of the run (one) plus one chunk of slack.
        self.disk_bytes = self.prompt_bytes + self.prompt_bytes // (args.tokens // args.chunk)
        self.cpu: LMCacheEngine | None = None
        self.disk: LMCacheEngine | None = None

    # -- helpers ---------------------------------------------------------------
    def _retrieve(self, engine: LMCacheEngine) -> tuple[float, int]:
        seconds, mask = timed(lambda: engine.retrieve(self.tokens, kv=self.dst))
        n = int(mask.sum())
        if n != self.args.tokens:
            raise RuntimeError(f"retrieved {n} of {self.args.tokens} tokens")
        return seconds, n

    def _check(self, engine: LMCacheEngine, what: str) -> None:
        self.dst.zero_()
        self._retrieve(engine)
        if not torch.equal(self.dst, self.src):
            raise Fatal(f"LMCache {what} retrieve is not bit-identical to the source KV")

    def _clear_cpu(self) -> None:
        self.cpu.clear(self.tokens)
        if self.cpu.lookup(self.tokens) != 0:
            raise RuntimeError("prompt still in the CPU engine after clear()")

    def _wait_disk_writes(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.disk.lookup(self.tokens, search_range=["LocalDiskBackend"]) < self.args.tokens:
            if time.monotonic() > deadline:
                raise Fatal("LMCache disk writes did not finish in time")
            time.sleep(0.01)

    # -- ops -------------------------------------------------------------------
    def setup(self, _: dict) -> dict:
        if self.cpu is not None:
            raise RuntimeError("already set up")
        try:
            return self._setup()
        except Fatal:
            raise
        except Exception as exc:  # a half-built worker must not serve timed ops
            raise Fatal(f"setup failed: {type(exc).__name__}: {exc}") from exc

    def _setup(self) -> dict:
        a = self.args
        gen = torch.Generator().manual_seed(SEED)
        self.tokens = torch.randint(0, 128256, (a.tokens,), generator=gen)
        self.src = torch.randn(self.shape, generator=gen, dtype=DTYPE)
        self.dst = torch.zeros(self.shape, dtype=DTYPE)
        cpu_cfg = make_config("cpu", a.chunk, self.cpu_bytes, None, 0)
        disk_cfg = make_config("disk", a.chunk, self.cpu_bytes, a.dir, self.disk_bytes)
        self.cpu, self.disk = build_engine(cpu_cfg, a.chunk), build_engine(disk_cfg, a.chunk)
        # warm-up: one store + retrieve per engine, each retrieve checked bit for bit
        self.cpu.store(self.tokens, kv=self.src)
        self._check(self.cpu, "CPU")
        self.disk.store(self.tokens, kv=self.src)
        self._wait_disk_writes()
        self._check(self.disk, "disk")
        if self.disk.lookup(self.tokens, search_range=["LocalCPUBackend"]) != 0:
            raise Fatal("the disk engine's CPU backend holds the prompt; disk loads would not read disk")
        return {"ok": True, "versions": self._versions(cpu_cfg, disk_cfg)}

    def _versions(self, cpu_cfg: LMCacheEngineConfig, disk_cfg: LMCacheEngineConfig) -> dict:
        def engine(cfg: LMCacheEngineConfig) -> dict:
            keys = ("local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "chunk_size")
            return {key: getattr(cfg, key) for key in keys}

        versions = {"lmcache": lmcache.__version__, "torch": torch.__version__, "python": platform.python_version()}
        workload = {"tokens": self.args.tokens, "kv_shape": list(self.shape), "dtype": "bfloat16"}
        return versions | {
            "torch_threads": torch.get_num_threads(),
            "workload": workload | {"prompt_bytes": self.prompt_bytes},
            "config": {"cpu_engine": engine(cpu_cfg), "disk_engine": engine(disk_cfg)},
        }

    def store_cpu(self, _: dict) -> dict:
        self._clear_cpu()
        seconds, _ = timed(lambda: self.cpu.store(self.tokens, kv=self.src))
        return {"seconds": seconds}

    def load_cpu(self, _: dict) -> dict:
        if self.cpu.lookup(self.tokens) != self.args.tokens:
            self.cpu.store(self.tokens, kv=self.src)  # untimed refill
        seconds, n = self._retrieve(self.cpu)
        return {"seconds": seconds, "tokens": n}

    def load_disk(self, cmd: dict) -> dict:
        if cmd.get("cold"):
            drop_page_cache(self.args.dir)
        seconds, n = self._retrieve(self.disk)
        return {"seconds": seconds, "tokens": n}

    def files(self, _: dict) -> dict:
        backend = self.disk.storage_manager.storage_backends["LocalDiskBackend"]
        keys = [key for _, _, key in self.disk.token_database.process_tokens(tokens=self.tokens)]
        return {"paths": [backend.dict[key].path for key in keys]}

    def close(self) -> None:
        for engine in (self.cpu, self.disk):
            if engine is not None:
                LMCacheEngineBuilder.destroy(engine.config.lmcache_instance_id)


def answer(obj: dict) -> None:
    _PROTOCOL.write(json.dumps(obj) + "\n")
    _PROTOCOL.flush()


def serve(worker: Worker) -> int:
    needs_setup = {"store_cpu", "load_cpu", "load_disk", "files"}
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "quit":
                break
            if op not in needs_setup | {"setup"}:
                raise ValueError(f"unknown op {op!r}")
            if op in needs_setup and worker.cpu is None:
                raise RuntimeError("send setup first")
            answer(getattr(worker, op)(cmd))
        except Fatal as exc:
            answer({"error": str(exc), "fatal": True})
            return 2
        except Exception as exc:  # the protocol answers every command
            answer({"error": f"{type(exc).__name__}: {exc}"})
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="LMCache local disk directory (fresh)")
    p.add_argument("--cpu-bytes", type=int, default=0, help="each engine's CPU pool (default: 2 prompts)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    args = p.parse_args()
    if args.tokens % args.chunk:
        p.error("--tokens must be a multiple of --chunk")
    worker = Worker(args)
    if worker.cpu_bytes < worker.prompt_bytes:  # the disk engine's retrieve would busy-wait forever
        p.error(f"--cpu-bytes must hold one prompt ({worker.prompt_bytes} B)")
    os.makedirs(args.dir, exist_ok=True)
    rc = serve(worker)
    try:
        worker.close()
    finally:
        _PROTOCOL.flush()
        os._exit(rc)  # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    main()
