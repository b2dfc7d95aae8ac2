"""kvmem-vllm's chunk entries: files, catalog rows and load time per chunk, at vLLM block sizes 16 and 128.

The connector stores a chunk of a prompt (256 tokens by default) as one kvmem entry whose rows are the chunk's
vLLM blocks (of every layer), and loads each row straight into its block's view of vLLM's KV cache. Measured
here with the connector's worker alone (its ``WorkerSide`` on a KV cache laid out as vLLM-CPU's: one buffer,
``[num_blocks, kv_heads, block_size, 2 * head_dim]`` a layer; no engine: vLLM-CPU refuses block size 16,
"No common block size for 16 (CPU_ATTN: [MultipleOf(32)])", GPU backends use it), beside:

- one kvmem entry per vLLM block (what the connector stored before): ``Memory.store_many`` / ``load_many``
  of each block's view;
- the machine: ``copy_`` of the chunk's bytes, already in memory, into the same block views.

Loads are timed from the worker's CPU tier and from disk (a memory without a CPU tier on the same
directory; the files are in the page cache, so it is kvmem's read path, not the disk, that is measured),
into blocks at random places of the cache. Median of ``--repeat`` passes over every chunk.

Run it with the vLLM venv (``integrations/vllm/venv.sh``)::

    "$(integrations/vllm/venv.sh | tail -n 1)/bin/python" benchmarks/bench_connector_chunks.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import records  # noqa: E402  (sibling modules, not a package)

import kvmem  # noqa: E402
from kvmem_vllm.metadata import ChunkTransfer, KVMemMetadata  # noqa: E402
from kvmem_vllm.worker import BlockViews, WorkerSide  # noqa: E402

LAYERS, HEADS, WIDTH = 4, 2, 128  # the tests' tiny Llama: 4 layers, 2 KV heads, 2 * head_dim 64, fp32
NS = "vllm/bench"


def kv_cache(num_blocks: int, block_size: int) -> dict[str, torch.Tensor]:
    """vLLM-CPU's layout: one buffer, each layer a contiguous view ``[num_blocks, heads, block, width]``."""
    buf = torch.randn(LAYERS, num_blocks, HEADS, block_size, WIDTH)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}


def blob_files(path: Path) -> int:
    """The disk tier's entry files under a kvmem directory."""
    return sum(1 for _ in path.rglob("*.kvb"))


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(block_size: int, chunk_tokens: int, chunks: int, repeat: int, work: Path) -> dict[str, Any]:
    """Files, catalog rows and load seconds per chunk, chunk entries and block entries, at one block size."""
    cb = chunk_tokens // block_size
    num_blocks = 2 * chunks * cb + 1
    caches = kv_cache(num_blocks, block_size)
    rng = random.Random(block_size)
    src = [list(range(1 + c * cb, 1 + (c + 1) * cb)) for c in range(chunks)]  # the chunks' blocks when saved
    out: dict[str, Any] = {"block_size": block_size, "blocks_per_chunk": cb}
    for layout in ("chunk", "block"):
        path = work / f"{layout}-{block_size}"
        with kvmem.Memory(str(path), cpu_bytes="1GiB", disk_bytes="4GiB", fsync="never") as mem:
            worker = WorkerSide(mem, NS, num_blocks, "none")
            worker.register(caches)
            if layout == "chunk":
                worker.save(KVMemMetadata(saves=[ChunkTransfer("r", [f"c{c}" for c in range(chunks)], src)]))
                worker.saver.wait_for({"r"})
            else:
                items = [(f"c{c}/{j}", worker.views(b)) for c in range(chunks) for j, b in enumerate(src[c])]
                mem.store_many(items, namespace=NS)
            mem.flush()
            out[f"{layout}_files"] = blob_files(path) / chunks
            out[f"{layout}_rows"] = sum(1 for _ in mem.entries(namespace=NS)) / chunks
            out[f"{layout}_cpu_s"] = statistics.median(
                _load_pass(worker, mem, layout, chunks, cb, rng, num_blocks) for _ in range(repeat)
            )
            worker.close()
        with kvmem.Memory(str(path), cpu_bytes=0, disk_bytes="4GiB") as disk:
            reader = WorkerSide(disk, NS, num_blocks, "none")
            reader.register(caches)
            out[f"{layout}_disk_s"] = statistics.median(
                _load_pass(reader, disk, layout, chunks, cb, rng, num_blocks) for _ in range(repeat)
            )
            reader.close()
    views = BlockViews(caches, num_blocks)
    chunk_values = [torch.stack([views(b) for b in blocks]) for blocks in src]

    def copy_pass() -> float:
        dst = _random_blocks(rng, chunks, cb, num_blocks)
        total = 0.0
        for value, blocks in zip(chunk_values, dst):
            total += timed(lambda value=value, blocks=blocks: [views(b).copy_(r) for b, r in zip(blocks, value)])
        return total / chunks

    out["copy_s"] = statistics.median(copy_pass() for _ in range(repeat))
    return out


def _random_blocks(rng: random.Random, chunks: int, cb: int, num_blocks: int) -> list[list[int]]:
    """Blocks at random places of the cache (vLLM hands out free blocks in no order), one list a chunk."""
    picked = rng.sample(range(1, num_blocks), chunks * cb)
    return [picked[c * cb : (c + 1) * cb] for c in range(chunks)]


def _load_pass(
    worker: WorkerSide, mem: kvmem.Memory, layout: str, chunks: int, cb: int, rng: random.Random, num_blocks: int
) -> float:
    """Seconds per chunk to load every chunk into random blocks."""
    dst = _random_blocks(rng, chunks, cb, num_blocks)
    if layout == "chunk":
        meta = KVMemMetadata(loads=[ChunkTransfer("r", [f"c{c}"], [dst[c]]) for c in range(chunks)])
        seconds = timed(lambda: worker.load(meta))
        assert worker.take_failed() == set(), "a chunk failed to load"
    else:
        views = worker.views
        assert views is not None
        keys = [[f"c{c}/{j}" for j in range(cb)] for c in range(chunks)]
        seconds = sum(
            timed(lambda c=c: mem.load_many(keys[c], namespace=NS, out=[views(b) for b in dst[c]]))
            for c in range(chunks)
        )
    return seconds / chunks


def main() -> None:
    run = records.start("bench_connector_chunks", python='"$VENV/bin/python"')
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=32, help="chunks stored and loaded (default 32)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="kvmem's chunk, in tokens (default 256)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="8 chunks, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.chunks, args.repeat = 8, 3
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-chunks-") as work:
        for block_size in (16, 128):
            rows.append(measure(block_size, args.chunk_tokens, args.chunks, args.repeat, Path(work)))
    figs = []
    print(
        f"{args.chunk_tokens}-token chunks, {LAYERS} layers x {HEADS} KV heads x {WIDTH} fp32, median of {args.repeat}"
    )
    print(
        "block  blocks/chunk  files/chunk (chunk|block)  rows/chunk (chunk|block)  "
        "load ms/chunk CPU (chunk|block|copy)  disk (chunk|block)"
    )
    for r in rows:
        bs = r["block_size"]
        print(
            f"{bs:5d}  {r['blocks_per_chunk']:12d}  {r['chunk_files']:10.1f} | {r['block_files']:5.1f}  "
            f"{r['chunk_rows']:10.1f} | {r['block_rows']:5.1f}  {r['chunk_cpu_s'] * 1e3:13.3f} | "
            f"{r['block_cpu_s'] * 1e3:6.3f} | {r['copy_s'] * 1e3:6.3f}  {r['chunk_disk_s'] * 1e3:8.3f} | "
            f"{r['block_disk_s'] * 1e3:6.3f}"
        )
        group = f"vLLM block size {bs} ({r['blocks_per_chunk']} blocks a chunk)"
        before = "one entry per vLLM block"
        figs += [
            records.figure(
                f"files-{bs}",
                "files per chunk",
                "files",
                r["chunk_files"],
                records.ref(before, r["block_files"], r["block_files"] / r["chunk_files"]),
                ratio="reference / kvmem",
                group=group,
                decimals=1,
            ),
            records.figure(
                f"rows-{bs}",
                "catalog rows per chunk",
                "rows",
                r["chunk_rows"],
                records.ref(before, r["block_rows"], r["block_rows"] / r["chunk_rows"]),
                ratio="reference / kvmem",
                group=group,
                decimals=1,
            ),
            records.figure(
                f"cpu-load-{bs}",
                "load a chunk from the CPU tier into its blocks",
                "ms",
                r["chunk_cpu_s"] * 1e3,
                records.ref(before, r["block_cpu_s"] * 1e3, r["block_cpu_s"] / r["chunk_cpu_s"]),
                records.ref(
                    "copy_ of the chunk's bytes into the blocks", r["copy_s"] * 1e3, r["copy_s"] / r["chunk_cpu_s"]
                ),
                ratio="reference time / kvmem time",
                group=group,
                decimals=3,
            ),
            records.figure(
                f"disk-load-{bs}",
                "load a chunk from disk (page cache warm) into its blocks",
                "ms",
                r["chunk_disk_s"] * 1e3,
                records.ref(before, r["block_disk_s"] * 1e3, r["block_disk_s"] / r["chunk_disk_s"]),
                ratio="reference time / kvmem time",
                group=group,
                decimals=3,
            ),
        ]
    records.write(
        run,
        figs,
        headline=["cpu-load-16"],
        machine={"threads": "torch.set_num_threads(1)", "page cache": "warm: the files were just written"},
        quick=args.quick,
        data={"rows": rows},
    )


if __name__ == "__main__":
    main()
