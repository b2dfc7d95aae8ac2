"""Predictive prefetch on a replayed request trace: CPU-tier hit rate, request latency, bytes moved and wasted.

Not a test: a measurement. Requests are replayed through the public API
(``Memory.load_many`` of a document's chunk-sized tensors, ``namespace="docs"``),
not through a model: what is measured is where the chunks come from and how long
loading them takes, which is the part of time to first token prefetch changes.

Workload (seeded, the same for every mode):

- ``--docs`` documents of ``--chunks`` chunks of ``--chunk-kib`` KiB each, all on the
  disk tier (page cache warm), a CPU tier of ``--cpu-mib`` MiB: smaller than the
  working set, so the CPU tier keeps only part of it.
- *structured* trace: ``--users`` users take turns at random (a user comes back
  after about ``--users`` other requests). A user asks about the same document again
  (a multi-turn session, ``0.3``), moves on to the document that follows it
  (each document has one fixed successor, ``0.55``), or starts a new session on a
  document drawn from a Zipf(1.1) popularity (``0.15``).
- *structureless* trace: documents drawn uniformly at random: what prefetch costs
  where there is nothing to learn (``--cost-pairs`` pairs of ``--cost-requests``
  requests).

Modes: ``none`` (no prefetch); ``queue`` (the next request's chunks are warmed
while this one is served, as ``PrefixCache.prefetch`` does for a queued request);
``predictive`` (:class:`kvmem.kv.PredictivePrefetcher` told about each request,
with the user as its stream). Requests arrive ``--gap-ms`` apart (a server is not
saturated by one client; background work runs in the gaps). The first
``--warmup`` share of each trace fills the tier and trains the model and is not
measured. Modes alternate within each repetition (each repetition its own seed);
the table shows medians over ``--repeat`` repetitions.

Latency on 2 shared vCPUs swings from run to run by more than the effects
measured, so the comparisons are also made *paired*: per repetition, predictive
over no prefetch on the same trace, run back to back (on the structureless
trace in alternating order); the summary gives the median of those ratios and
in how many repetitions the ratio was below 1. The cost where there is nothing
to learn is given as latency, as the process's CPU time per request (every
thread), and as the prefetcher thread's own CPU time per request
(``kvmem_predictive_prefetch_cpu_seconds_total``) over the CPU time a request
takes without prefetch: what it takes from the cores the requests run on.

Usage (from the repository root)::

    python benchmarks/bench_prefetch.py            # 3000 requests, median of 5
    python benchmarks/bench_prefetch.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import records
import torch

import kvmem
from kvmem.kv import PredictivePrefetcher
from kvmem.kv.background import Prefetcher

NS = "docs"
Trace = list[tuple[str, int]]  # (user, document)


def doc_keys(d: int, chunks: int) -> list[str]:
    return [f"doc{d}/chunk{i}" for i in range(chunks)]


def structured(n: int, docs: int, users: int, seed: int) -> Trace:
    """Multi-turn sessions of ``users`` interleaved users over documents that follow one another."""
    rng = random.Random(seed)
    successor = list(range(docs))
    rng.shuffle(successor)
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(docs)]
    popular = list(range(docs))
    rng.shuffle(popular)

    def start() -> int:
        return rng.choices(popular, weights)[0]

    at = {u: start() for u in range(users)}
    trace = []
    for _ in range(n):
        u = rng.randrange(users)
        r = rng.random()
        if r >= 0.3:
            at[u] = successor[at[u]] if r < 0.85 else start()
        trace.append((f"user{u}", at[u]))
    return trace


def structureless(n: int, docs: int, users: int, seed: int) -> Trace:
    rng = random.Random(seed)
    return [(f"user{rng.randrange(users)}", rng.randrange(docs)) for _ in range(n)]


@dataclass
class Result:
    hit_rate: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    cpu_ms: float
    predictor_cpu_ms: float = 0.0
    moved_mib: float = 0.0
    wasted_share: float = 0.0
    used_share: float = 0.0


def replay(path: Path, trace: Trace, mode: str, args: argparse.Namespace) -> Result:
    """One mode over one trace on a fresh process's CPU tier (empty) over the shared disk tier."""
    memory = kvmem.Memory(
        str(path), cpu_bytes=f"{args.cpu_mib}MiB", disk_bytes="4GiB", fsync="never", compression="none"
    )
    store = memory.chunk_store()
    predictor = PredictivePrefetcher(memory) if mode == "predictive" else None
    queue = (
        Prefetcher(lambda k: store.warm(memory.storage_key(k, NS)), memory.config.prefetch_depth, lambda s: None)
        if mode == "queue"
        else None
    )
    skip = int(len(trace) * args.warmup)
    times: list[float] = []
    m = memory.metrics

    def cpu_hits() -> float:
        return m.value("kvmem_hits_total", tier="cpu", kind="tensor")

    def all_hits() -> float:
        return m.total("kvmem_hits_total")

    base_cpu = base_all = cpu_start = predictor_start = 0.0
    base_bytes = {o: 0.0 for o in ("warmed", "used", "wasted")}
    for i, (user, d) in enumerate(trace):
        if i == skip:
            base_cpu, base_all, cpu_start = cpu_hits(), all_hits(), time.process_time()
            predictor_start = m.total("kvmem_predictive_prefetch_cpu_seconds_total")
            base_bytes = {o: m.value("kvmem_predictive_prefetch_bytes_total", outcome=o) for o in base_bytes}
        keys = doc_keys(d, args.chunks)
        start = time.perf_counter()
        values = memory.load_many(keys, namespace=NS)
        elapsed = time.perf_counter() - start
        assert all(v is not None for v in values), "a document's chunk is missing from the disk tier"
        if i >= skip:
            times.append(elapsed)
        if queue is not None and i + 1 < len(trace):
            queue.prefetch(doc_keys(trace[i + 1][1], args.chunks))
        if predictor is not None:
            predictor.observe(keys, namespace=NS, stream=user)
        time.sleep(args.gap_ms / 1000)
    if predictor is not None:
        predictor.flush()  # its work for the last requests is part of their cost
    cpu_seconds = time.process_time() - cpu_start
    predictor_seconds = m.total("kvmem_predictive_prefetch_cpu_seconds_total") - predictor_start
    moved = {o: m.value("kvmem_predictive_prefetch_bytes_total", outcome=o) - base_bytes[o] for o in base_bytes}
    served = all_hits() - base_all
    hit_rate = (cpu_hits() - base_cpu) / served if served else 0.0
    if predictor is not None:
        predictor.close()
    if queue is not None:
        queue.close()
    memory.close()
    ms = sorted(t * 1e3 for t in times)
    warmed = moved["warmed"]
    return Result(
        hit_rate=hit_rate,
        p50_ms=ms[len(ms) // 2],
        p99_ms=ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        mean_ms=statistics.fmean(ms),
        cpu_ms=cpu_seconds * 1e3 / len(ms),
        predictor_cpu_ms=predictor_seconds * 1e3 / len(ms),
        moved_mib=warmed / 2**20,
        wasted_share=moved["wasted"] / warmed if warmed else 0.0,
        used_share=moved["used"] / warmed if warmed else 0.0,
    )


def populate(path: Path, args: argparse.Namespace) -> None:
    """Every document's chunks on the disk tier (the CPU tier of later processes starts empty)."""
    elements = args.chunk_kib * 1024 // 2
    with kvmem.Memory(str(path), cpu_bytes="1MiB", disk_bytes="4GiB", fsync="never", compression="none") as memory:
        for d in range(args.docs):
            for i, key in enumerate(doc_keys(d, args.chunks)):
                memory.store(
                    key, torch.full((elements,), float(d * args.chunks + i), dtype=torch.float16), namespace=NS
                )


def median(results: list[Result], field: str) -> float:
    return statistics.median(getattr(r, field) for r in results)


def paired(results: list[Result], baseline: list[Result], field: str) -> str:
    """Per repetition ``field`` of ``results`` over ``baseline``'s (same trace, back to back): median, runs below 1."""
    ratios = [getattr(r, field) / getattr(b, field) for r, b in zip(results, baseline)]
    below = sum(ratio < 1 for ratio in ratios)
    return f"{statistics.median(ratios):.2f}x (lower in {below} of {len(ratios)} runs)"


def paired_ratio(results: list[Result], baseline: list[Result], field: str) -> float:
    """The median of :func:`paired`'s per-repetition ratios."""
    return statistics.median(getattr(r, field) / getattr(b, field) for r, b in zip(results, baseline))


def figures(results: dict[tuple[str, str], list[Result]]) -> list[dict[str, object]]:
    """The results record's figures: predictive prefetch beside no prefetch (and queue prefetch), per trace."""
    lower = "predictive / none, median of per-repetition ratios (< 1: lower with prefetch)"
    out = []
    for trace in ("structured", "structureless"):
        pred, none = results[trace, "predictive"], results[trace, "none"]
        group = f"{trace} trace"
        queue = results.get((trace, "queue"))
        refs = [records.ref("no prefetch", 100 * median(none, "hit_rate"))]
        if queue:
            refs.append(records.ref("queue prefetch (next request known)", 100 * median(queue, "hit_rate")))
        out.append(
            records.figure(
                f"{trace}-hit",
                "CPU-tier hit rate, predictive prefetch",
                "%",
                100 * median(pred, "hit_rate"),
                *refs,
                group=group,
            )
        )
        for field, what, unit in (
            ("p50_ms", "P50 latency", "ms"),
            ("p99_ms", "P99 latency", "ms"),
            ("mean_ms", "mean latency", "ms"),
            ("cpu_ms", "process CPU per request", "ms"),
        ):
            refs = [records.ref("no prefetch", median(none, field), paired_ratio(pred, none, field), ratio_is=lower)]
            if queue:
                refs.append(records.ref("queue prefetch (next request known)", median(queue, field)))
            out.append(
                records.figure(
                    f"{trace}-{field}", f"{what}, predictive prefetch", unit, median(pred, field), *refs, group=group
                )
            )
        out.append(records.figure(f"{trace}-moved", "bytes warmed", "MiB", median(pred, "moved_mib"), group=group))
        out.append(
            records.figure(
                f"{trace}-wasted",
                "share of warmed bytes never used",
                "%",
                100 * median(pred, "wasted_share"),
                group=group,
            )
        )
    flat, flat_pred = results["structureless", "none"], results["structureless", "predictive"]
    out.append(
        records.figure(
            "predictor-cpu",
            "predictive prefetch's own CPU per request (model and thread)",
            "µs",
            median(flat_pred, "predictor_cpu_ms") * 1e3,
            records.ref(
                "a request's CPU, no prefetch",
                median(flat, "cpu_ms") * 1e3,
                statistics.median(p.predictor_cpu_ms / b.cpu_ms for p, b in zip(flat_pred, flat)),
                ratio_is="its share of a request's CPU (target <= 0.02)",
            ),
            group="structureless trace",
        )
    )
    return out


def main() -> None:
    run = records.start("bench_prefetch")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=4, help="chunks per document")
    parser.add_argument("--chunk-kib", type=int, default=64)
    parser.add_argument("--cpu-mib", type=int, default=16)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cost-pairs", type=int, default=16, help="structureless runs of each mode")
    parser.add_argument("--cost-requests", type=int, default=1000, help="requests of one structureless run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="600 requests, 2 repetitions, 2 cost pairs")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeat, args.cost_pairs = 600, 2, 2
    torch.set_num_threads(1)
    modes = ("none", "predictive", "queue")  # the compared pair back to back
    results: dict[tuple[str, str], list[Result]] = {
        key: [] for key in [("structured", "none"), ("structured", "queue"), ("structured", "predictive")]
    }
    results["structureless", "none"], results["structureless", "predictive"] = [], []
    working = args.docs * args.chunks * args.chunk_kib / 1024
    print(
        f"{args.docs} documents x {args.chunks} chunks x {args.chunk_kib} KiB = {working:.0f} MiB on disk; "
        f"CPU tier {args.cpu_mib} MiB; {args.users} users, requests {args.gap_ms} ms apart, "
        f"{args.warmup:.0%} of each run not measured (warm-up); structured: {args.requests} requests, "
        f"median of {args.repeat}; structureless: {args.cost_requests} requests, median of {args.cost_pairs}"
    )
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-", dir=".") as tmp:  # ignored by git
        path = Path(tmp) / "kvmem"
        populate(path, args)
        for rep in range(args.repeat):
            trace = structured(args.requests, args.docs, args.users, args.seed + rep)
            for mode in modes:
                results["structured", mode].append(replay(path, trace, mode, args))
        for pair in range(args.cost_pairs):
            trace = structureless(args.cost_requests, args.docs, args.users, args.seed + pair)
            for mode in ("none", "predictive") if pair % 2 == 0 else ("predictive", "none"):
                results["structureless", mode].append(replay(path, trace, mode, args))
    header = f"{'trace':<14}{'mode':<12}{'CPU hit':>9}{'P50 ms':>9}{'P99 ms':>9}{'mean ms':>9}{'CPU ms':>8}"
    print(header + f"{'moved MiB':>11}{'used':>7}{'wasted':>8}")
    for (trace_name, mode), rs in results.items():
        line = (
            f"{trace_name:<14}{mode:<12}{median(rs, 'hit_rate'):>9.1%}{median(rs, 'p50_ms'):>9.3f}"
            f"{median(rs, 'p99_ms'):>9.3f}{median(rs, 'mean_ms'):>9.3f}{median(rs, 'cpu_ms'):>8.3f}"
        )
        if mode == "predictive":
            line += (
                f"{median(rs, 'moved_mib'):>11.1f}{median(rs, 'used_share'):>7.0%}{median(rs, 'wasted_share'):>8.0%}"
            )
        print(line)
    base, pred = results["structured", "none"], results["structured", "predictive"]
    flat, flat_pred = results["structureless", "none"], results["structureless", "predictive"]
    print(
        f"structured: CPU-tier hit rate {median(pred, 'hit_rate') - median(base, 'hit_rate'):+.1%} points "
        f"(target >= +15), P99 {paired(pred, base, 'p99_ms')} of no prefetch (target < 1), "
        f"wasted {median(pred, 'wasted_share'):.0%} of bytes moved (target < 30%)"
    )
    share = statistics.median(p.predictor_cpu_ms / b.cpu_ms for p, b in zip(flat_pred, flat))
    print(
        f"structureless: with predictive prefetch mean latency {paired(flat_pred, flat, 'mean_ms')}, "
        f"P50 {paired(flat_pred, flat, 'p50_ms')}, the process's CPU time per request "
        f"{paired(flat_pred, flat, 'cpu_ms')} of no prefetch; predictive prefetch (model and thread) "
        f"{median(flat_pred, 'predictor_cpu_ms') * 1e3:.0f} us CPU per request = {share:.1%} of a request's "
        f"(target <= 2%)"
    )
    records.write(
        run,
        figures(results),
        headline=["structured-hit", "structured-p99_ms"],
        machine={"torch_threads": 1},
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
