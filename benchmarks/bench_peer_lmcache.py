"""kvmem and LMCache 0.5.6 side by side on one prompt's KV, against the machine's own limits.

Not a test: a measurement. One invocation runs LMCache (in its own venv, as a worker
process: ``benchmarks/peer_lmcache.py``) and kvmem (here) on the same workload, the
same disk and the same machine, alternating repetitions, and prints one table.

Workload: one 4,096-token prompt of a Llama-3-8B layout held in one bf16 tensor
``kv[2, 32, 4096, 1024]`` (537 MB), 16 chunks of 256 tokens, chunk ``i`` the
non-contiguous slice ``kv[:, :, 256*i:256*(i+1), :]`` (33,554,432 B); a load writes
every chunk back into the slices of a destination tensor of the same shape. kvmem keys
the chunks as a user would: prefix-chained hashes of the prompt's token ids.

Rows (each repetition runs kvmem, LMCache and the references back to back; the table
shows medians and ratios of medians; ``x memcpy`` = memcpy time / that time):

=======================  =========================================  ==============================
row                      kvmem                                      references
=======================  =========================================  ==============================
store -> return          ``store_many`` into a CPU-only memory      LMCache ``store`` (CPU engine);
                                                                    ``np.copyto`` of 537 MB into a
                                                                    preallocated buffer (memcpy)
store, CRCs computed     the same + ``flush()``: the CRCs kvmem    memcpy (LMCache computes none)
                         computes in the background, and the
                         catalog rows
load, CPU tier           ``load_many(out=slices)``                  LMCache ``retrieve``; memcpy
(cpu_verify)             the same, every segment's CRC re-checked   memcpy
load() without out=,     ``load(key)`` of each chunk, every value   memcpy
CPU tier                 kept until the row is timed
load, disk, warm         disk-only memory, ``load_many(out=)``      LMCache disk engine ``retrieve``;
                                                                    raw ``readinto`` of kvmem's 16
                                                                    files into preallocated buffers
                                                                    on 4 threads; memcpy
load, disk, cold         the same after ``POSIX_FADV_DONTNEED``     the same, cold
durable store            disk-only, ``fsync="always"``              raw write + fsync of the same
                         ``store_many``; each contender starts      16 files + one directory fsync,
                         with its previous files removed and        on 1 and on 4 threads from
                         synced, in an order rotating per           whole buffers; on 4 threads
                         trial, two trials per repetition           from the KV tensor's slices
                                                                    (one ``writev`` per file); on 4
                                                                    threads with kvmem's early
                                                                    writeback (8 MiB pieces, each
                                                                    to ``sync_file_range``); the
                                                                    fastest is the reference
small items (64 KiB)     ``store`` (then with the catalog's        ``np.copyto`` of 64 KiB
                         flush of its rows), ``load``,
                         ``load(out=)`` on the CPU tier, us/call
=======================  =========================================  ==============================

Usage (from the repository root)::

    python benchmarks/bench_peer_lmcache.py                  # full run, median of 5 (~3 min)
    python benchmarks/bench_peer_lmcache.py --repeat 3 --no-peer   # kvmem and references only
    python benchmarks/bench_peer_lmcache.py --json out.json

The LMCache venv comes from ``../shared/peers/lmcache_env.sh`` (built on first use, ~1 GB);
``--peer-python`` points at another one.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import records
import torch
from machine import drop_page_cache, filesystem_of, load_average

import kvmem
from kvmem import Memory
from kvmem.keys import chunk_hashes
from kvmem.stores import DiskTier

LAYERS, TOKENS, HIDDEN, CHUNK = 32, 4096, 1024, 256
T = TypeVar("T")
SMALL = 64 * 1024
DURABLE_TRIALS = 2  # durable stores per contender and repetition: their times swing most on this disk
ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parent.parent / "shared"


@dataclass
class Row:
    """One line of the table: seconds per repetition of each contender."""

    name: str
    nbytes: int
    times: dict[str, list[float]] = field(default_factory=dict)

    def add(self, who: str, seconds: float) -> None:
        self.times.setdefault(who, []).append(seconds)

    def median(self, who: str) -> float | None:
        xs = self.times.get(who)
        return statistics.median(xs) if xs else None


# -- the workload --------------------------------------------------------------------------------
class Workload:
    """The prompt's KV, its destination, its chunk slices and keys."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.src = torch.randn((2, LAYERS, TOKENS, HIDDEN), generator=gen, dtype=torch.bfloat16)
        self.dst = torch.zeros_like(self.src)
        self.tokens = torch.randint(0, 128256, (TOKENS,), generator=gen)
        self.keys = chunk_hashes(self.tokens, CHUNK, "bench/llama-3-8b/bf16")
        self.chunks = [self.src[:, :, i * CHUNK : (i + 1) * CHUNK] for i in range(TOKENS // CHUNK)]
        self.outs = [self.dst[:, :, i * CHUNK : (i + 1) * CHUNK] for i in range(TOKENS // CHUNK)]
        self.nbytes = self.src.numel() * self.src.element_size()

    def check(self, what: str) -> None:
        if not torch.equal(self.dst, self.src):
            raise SystemExit(f"kvmem {what}: the destination is not bit-identical to the source")
        self.dst.zero_()


class Peer:
    """The LMCache worker process (``peer_lmcache.py`` in LMCache's venv)."""

    def __init__(self, python: str, scratch: Path) -> None:
        self.dir = scratch / "lmcache"
        self.proc = subprocess.Popen(
            [python, str(ROOT / "peer_lmcache.py"), "--dir", str(self.dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self.call("setup")

    def call(self, op: str, **args: object) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or '{"error": "LMCache worker died"}')
        if "error" in reply:
            raise SystemExit(f"LMCache worker: {op}: {reply['error']}")
        return reply

    def seconds(self, op: str, **args: object) -> float:
        return float(self.call(op, **args)["seconds"])

    def close(self) -> None:
        """Ask the worker to quit (it answers nothing) and wait for it."""
        assert self.proc.stdin is not None
        if self.proc.poll() is None:
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def peer_python(explicit: str | None) -> str:
    if explicit:
        return explicit
    script = SHARED / "peers" / "lmcache_env.sh"
    return subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True).stdout.strip()


# -- references ------------------------------------------------------------------------------------
def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_kept(fn: Callable[[], object]) -> float:
    """:func:`timed`, with what ``fn`` returns kept until the clock is read (as a caller keeps what it loads:
    each load's buffer is then new memory, never one just freed)."""
    start = time.perf_counter()
    kept = fn()
    seconds = time.perf_counter() - start
    del kept
    return seconds


def raw_read(paths: list[Path], buffers: list[np.ndarray], pool: ThreadPoolExecutor) -> None:
    """``readinto`` every file into its preallocated buffer, on the pool's threads."""

    def one(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(memoryview(buffers[i])[: os.fstat(f.fileno()).st_size])

    list(pool.map(one, range(len(paths))))


def raw_durable(
    directory: Path, files: list[list[np.ndarray]], pool: ThreadPoolExecutor | None, writeback: int = 0
) -> None:
    """Write + fsync each file (its parts in one ``writev``) as a new file, rename it, then fsync the directory
    once. ``writeback``: write in pieces of this many bytes instead, starting the writeback of each as it is
    written (``sync_file_range``), as kvmem's durable writes do."""

    def one(i: int) -> None:
        tmp = directory / f"{i}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if writeback:
                (whole,) = files[i]
                for at in range(0, whole.nbytes, writeback):
                    os.pwrite(fd, whole[at : at + writeback], at)
                    _sync_file_range(fd, at, min(writeback, whole.nbytes - at), 2)  # SYNC_FILE_RANGE_WRITE
            elif os.writev(fd, files[i]) != sum(part.nbytes for part in files[i]):
                raise SystemExit(f"raw write: a short write to {tmp}")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / f"{i}.bin")

    list(pool.map(one, range(len(files)))) if pool else [one(i) for i in range(len(files))]
    fd = os.open(directory, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


_sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
_sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def from_slices(payloads: list[np.ndarray], chunks: list[torch.Tensor]) -> list[list[np.ndarray]]:
    """Each file's bytes as kvmem writes them: its head (from the file), then its chunk's contiguous runs
    read straight from the strided slice of the KV tensor (checked equal to the file's payload)."""
    files = []
    for payload, chunk in zip(payloads, chunks):
        runs = [chunk[k, layer].view(torch.uint8).numpy().reshape(-1) for k in range(2) for layer in range(LAYERS)]
        head = payload[: payload.size - sum(run.size for run in runs)]
        if not np.array_equal(np.concatenate(runs), payload[head.size :]):
            raise SystemExit("raw reference: a file's payload is not its chunk's bytes in order")
        files.append([head, *runs])
    return files


def quiet_then_timed(clear: Callable[[], None], store: Callable[[], object]) -> float:
    """``store`` timed from a quiet disk: what it wrote before removed by ``clear``, all of it committed first."""
    clear()
    os.sync()
    return timed(store)


def clear_files(directory: Path) -> None:
    for old in directory.iterdir():
        old.unlink()


def clear_entries(mem: Memory, keys: list[str]) -> None:
    for key in keys:
        mem.delete(key)
    mem.flush()


def rotated(seq: list[T], n: int) -> list[T]:
    """``seq`` rotated left by ``n``: who goes first changes from one repetition to the next."""
    n %= len(seq)
    return seq[n:] + seq[:n]


# -- the run -----------------------------------------------------------------------------------------
def run(args: argparse.Namespace, scratch: Path) -> list[Row]:
    w = Workload()
    peer = None if args.no_peer else Peer(peer_python(args.peer_python), scratch)
    memcpy_dst = np.empty(w.nbytes, np.uint8)
    memcpy_src = w.src.view(torch.uint8).reshape(-1).numpy()
    np.copyto(memcpy_dst, memcpy_src)  # NOTE: warm: its pages are faulted in once, before any timing
    io = ThreadPoolExecutor(4)
    rows = {
        name: Row(name, w.nbytes)
        for name in (
            "store -> return",
            "store, CRCs computed",
            "load, CPU tier",
            "load, CPU tier, cpu_verify",
            "load() without out=, CPU tier",
            "load, disk, warm",
            "load, disk, cold",
            "durable store",
        )
    }

    cpu = Memory(str(scratch / "cpu"), cpu_bytes=2 * w.nbytes + (256 << 20), disk_bytes=0)
    verified = Memory(str(scratch / "verified"), cpu_bytes=2 * w.nbytes + (256 << 20), disk_bytes=0, cpu_verify=True)
    disk = Memory(str(scratch / "disk"), cpu_bytes=0, disk_bytes=3 * w.nbytes, fsync="always")
    items = list(zip(w.keys, w.chunks))
    for mem in (cpu, verified):
        mem.store_many(items)  # warm-up: pool pages faulted in, code paths loaded
        mem.load_many(w.keys, out=w.outs)
        w.check("CPU load")
    disk.store_many(items)
    disk_tier = next(t for t in disk._tiers.tiers if isinstance(t, DiskTier))
    paths = [disk_tier.path(disk.storage_key(k)) for k in w.keys]
    disk.load_many(w.keys, out=w.outs)
    w.check("disk load")
    buffers = [np.empty(p.stat().st_size, np.uint8) for p in paths]
    payloads = [np.frombuffer(p.read_bytes(), np.uint8) for p in paths]
    whole, sliced = [[p] for p in payloads], from_slices(payloads, w.chunks)
    raw_dir = scratch / "raw"
    raw_dir.mkdir()

    for rep in range(args.repeat):
        print(f"  repetition {rep + 1}/{args.repeat} (load {load_average()})", flush=True)
        memcpy = timed(lambda: np.copyto(memcpy_dst, memcpy_src))
        for row in rows.values():
            if row.name != "durable store":
                row.add("memcpy", memcpy)
        # store -> return
        for k in w.keys:
            cpu.delete(k)
        cpu.flush()
        stored = timed(lambda: cpu.store_many(items))
        rows["store -> return"].add("kvmem", stored)
        # NOTE: the CRCs of stored values are computed when first needed, here by the catalog's flush (in the
        # background within a second otherwise): timed here, so that it overlaps nothing measured after it
        rows["store, CRCs computed"].add("kvmem", stored + timed(cpu.flush))
        if peer:
            rows["store -> return"].add("LMCache", peer.seconds("store_cpu"))
        # load from the CPU tier
        rows["load, CPU tier"].add("kvmem", timed(lambda: cpu.load_many(w.keys, out=w.outs)))
        w.check("CPU load")
        if peer:
            rows["load, CPU tier"].add("LMCache", peer.seconds("load_cpu"))
        rows["load, CPU tier, cpu_verify"].add("kvmem", timed(lambda: verified.load_many(w.keys, out=w.outs)))
        w.check("verified CPU load")
        # NOTE: kept, as a caller keeps what it loads: each value's buffer is new memory, not one reused
        rows["load() without out=, CPU tier"].add("kvmem", timed_kept(lambda: [cpu.load(k) for k in w.keys]))
        # disk, warm then cold
        for cold, name in ((False, "load, disk, warm"), (True, "load, disk, cold")):
            before = (lambda: drop_page_cache(paths)) if cold else (lambda: None)
            before()
            rows[name].add("kvmem", timed(lambda: disk.load_many(w.keys, out=w.outs)))
            w.check(name)
            if peer:
                rows[name].add("LMCache", peer.seconds("load_disk", cold=cold))
            before()
            rows[name].add("raw readinto x4", timed(lambda: raw_read(paths, buffers, io)))
    if peer:
        args.peer_info = peer.info
        peer.close()
    # durable store: each from the same quiet state (its previous files removed, the catalogs' buffered
    # writes flushed, all of it committed by os.sync), in an order that rotates with the trial, after the LMCache
    # worker has quit (it takes no part in these rows).
    # NOTE: not so, what came before landed in whichever fsyncs came next: a catalog's timed flush (an
    # SQLite commit), the TRIM of freed files (this filesystem is mounted with ``discard``), the peer's
    # disk reads just before. kvmem, always first, read 0.37 s in one run and 0.84 s in another. With the
    # worker resident (idle, 3.5 GB) the third session measured 0.54-0.73 of raw, 0.84-0.89 without it; on the
    # fourth session's VM that gap did not reproduce in isolation.
    cpu.flush()
    verified.flush()
    contenders = [
        ("kvmem", lambda: clear_entries(disk, w.keys), lambda: disk.store_many(items)),
        ("raw write+fsync", lambda: clear_files(raw_dir), lambda: raw_durable(raw_dir, whole, None)),
        ("raw write+fsync x4", lambda: clear_files(raw_dir), lambda: raw_durable(raw_dir, whole, io)),
        ("raw writev of the slices x4", lambda: clear_files(raw_dir), lambda: raw_durable(raw_dir, sliced, io)),
        (
            "raw write+fsync x4, early writeback",
            lambda: clear_files(raw_dir),
            lambda: raw_durable(raw_dir, whole, io, 8 << 20),
        ),
    ]
    for trial in range(DURABLE_TRIALS * args.repeat):
        rows["durable store"].add("memcpy", timed(lambda: np.copyto(memcpy_dst, memcpy_src)))
        for who, clear, store in rotated(contenders, trial):
            rows["durable store"].add(who, quiet_then_timed(clear, store))
    small = small_items(cpu, args.small, args.repeat)
    for mem in (cpu, verified, disk):
        mem.close()
    return list(rows.values()) + small


def small_items(mem: Memory, n: int, repeat: int) -> list[Row]:
    """Microseconds per call of 64 KiB stores and loads on the CPU tier (medians over ``repeat`` passes)."""
    values = [torch.randn(SMALL // 2, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(n)]
    out = torch.empty_like(values[0])
    keys = [f"small/{i}" for i in range(n)]
    src, dst = values[0].view(torch.uint8).numpy(), np.empty(SMALL, np.uint8)
    names = ("64 KiB store", "64 KiB store + catalog flush", "64 KiB load", "64 KiB load(out=)")
    rows = {name: Row(name, SMALL) for name in names}
    # NOTE: one untimed pass first, as for the large rows: the first passes of plain load() grow the heap its new
    # tensors come from (first-touch page faults: 60-84 us a load here, 17-22 us once the heap has grown)
    for k, v in zip(keys, values):
        mem.store(k, v)
    loaded = [mem.load(k) for k in keys]
    del loaded
    # NOTE: each pass starts with the catalog's buffered writes flushed (untimed): the hits a load pass counts
    # are otherwise written by the catalog's timer within a second, on another thread, during the next pass
    for _ in range(repeat):
        mem.flush()
        stored = timed(lambda: [mem.store(k, v) for k, v in zip(keys, values)])
        rows["64 KiB store"].add("kvmem", stored / n)
        # NOTE: the catalog writes the stores' rows (and their CRCs) in the background within a second: its cost
        rows["64 KiB store + catalog flush"].add("kvmem", (stored + timed(mem.flush)) / n)
        rows["64 KiB load"].add("kvmem", timed(lambda: [mem.load(k) for k in keys]) / n)
        mem.flush()
        rows["64 KiB load(out=)"].add("kvmem", timed(lambda: [mem.load(k, out=out) for k in keys]) / n)
        copy = timed(lambda: [np.copyto(dst, src) for _ in range(n)]) / n
        for row in rows.values():
            row.add("memcpy", copy)
    return list(rows.values())


# -- the report -------------------------------------------------------------------------------------
def machine_state() -> str:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    huge = next(
        (
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("AnonHugePages")
        ),
        "?",
    )
    return (
        f"{os.cpu_count()} vCPUs, torch {torch.__version__} on {torch.get_num_threads()} threads, "
        f"THP {thp.read_text().strip() if thp.exists() else 'n/a'} (AnonHugePages {huge} kB now), "
        f"kvmem {kvmem.__version__ if hasattr(kvmem, '__version__') else ''}, "
        # NOTE: a full garbage collection scans every one; small-item stores pay for it in proportion
        f"{len(gc.get_objects()):,} Python objects tracked by the garbage collector"
    )


def _cell(row: Row, seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if row.nbytes == SMALL:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds:.3f} s ({row.nbytes / seconds / 1e9:.1f} GB/s)"


def _ratio(seconds: float | None, reference: float | None) -> str:
    """How fast ``seconds`` is next to ``reference`` (>1: faster)."""
    return f"{reference / seconds:.2f}" if seconds and reference else "-"


def report(rows: list[Row], args: argparse.Namespace, scratch: Path) -> None:
    print(f"\nmachine: {machine_state()}; scratch on {filesystem_of(scratch)}; load {load_average()}")
    print(
        f"median of {args.repeat} ({DURABLE_TRIALS * args.repeat} for the durable store); "
        "x memcpy = np.copyto of the same bytes into a warm buffer / that time\n"
    )
    print(
        "| operation | kvmem | LMCache 0.5.6 | machine reference | kvmem x memcpy | LMCache x memcpy "
        "| kvmem / LMCache | kvmem / reference |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        kv, lm, mc = row.median("kvmem"), row.median("LMCache"), row.median("memcpy")
        # NOTE: the fastest raw way is the reference (raw reads and writes on 1 or 4 threads)
        refs = sorted((row.median(k), k) for k in row.times if k.startswith("raw"))
        ref, ref_name = refs[0] if refs else (None, "")
        cells = [_cell(row, s) for s in (kv, lm)] + [f"{_cell(row, ref)} ({ref_name})" if ref else "-"]
        ratios = [_ratio(kv, mc), _ratio(lm, mc), _ratio(kv, lm), _ratio(kv, ref)]
        print(f"| {row.name} | " + " | ".join(cells + ratios) + " |")
    for row in rows:
        kv = row.median("kvmem")
        raws = [k for k in row.times if k.startswith("raw")]
        others = [f"{k} {row.median(k):.3f} s (kvmem / it {_ratio(kv, row.median(k))})" for k in raws]
        if len(others) > 1:
            print(f"\n{row.name}, every raw reference: " + "; ".join(others))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": machine_state(),
                    "repeat": args.repeat,
                    "peer": getattr(args, "peer_info", None),
                    "rows": [{"name": r.name, "bytes": r.nbytes, "times": r.times} for r in rows],
                },
                indent=2,
            )
        )


def _reference(row: Row, name: str, who: str, scale: float) -> dict[str, object]:
    """``who``'s median in ``row`` (times ``scale``) and its time over kvmem's."""
    kv, theirs = row.median("kvmem"), row.median(who)
    return records.ref(name, theirs * scale if theirs else None, theirs / kv if theirs and kv else None)


def figures(rows: list[Row]) -> list[dict[str, object]]:
    """The results record's figures: each row's kvmem time beside LMCache's, the fastest raw way (then the other
    raw ways) and memcpy of the same bytes; every ratio is the reference's time / kvmem's."""
    out = []
    for row in rows:
        small = row.nbytes == SMALL
        scale, unit = (1e6, "µs") if small else (1.0, "s")
        kv = row.median("kvmem")

        refs = [_reference(row, "LMCache 0.5.6", "LMCache", scale)] if row.median("LMCache") else []
        raws = sorted((row.median(k) or 0.0, k) for k in row.times if k.startswith("raw"))
        refs += [_reference(row, who, who, scale) for _, who in raws]  # NOTE: the fastest raw way first
        refs.append(_reference(row, "memcpy (np.copyto, warm buffer)", "memcpy", scale))
        out.append(
            records.figure(
                records.slug(row.name),
                row.name,
                unit,
                kv * scale if kv else None,
                *refs,
                ratio="reference time / kvmem time (> 1: kvmem faster)",
                group="64 KiB items, CPU tier, per call" if small else f"{row.nbytes / 1e6:.0f} MB of KV, 16 chunks",
            )
        )
    return out


def main() -> None:
    run_record = records.start("bench_peer_lmcache")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--small", type=int, default=2000, help="64 KiB items per small-item pass")
    p.add_argument("--dir", default=None, help="scratch directory, on the disk to measure (default: ./.bench-tmp)")
    p.add_argument("--no-peer", action="store_true", help="skip LMCache (kvmem and the references only)")
    p.add_argument("--peer-python", default=None, help="python of an LMCache 0.5.6 venv")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    base = Path(args.dir or ".bench-tmp")
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="peer-", dir=base))
    try:
        rows = run(args, scratch)
        report(rows, args, scratch)
        fs = filesystem_of(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    records.write(
        run_record,
        figures(rows),
        headline=["store-return", "load-cpu-tier", "load-without-out-cpu-tier", "load-disk-cold", "durable-store"],
        machine={"state": machine_state(), "filesystem": fs, "peer": getattr(args, "peer_info", None) or "none"},
    )


if __name__ == "__main__":
    main()
