"""Prefetch and eviction on replayed traces they were not built from: CPU-tier hit rate, load latency, bytes.

Not a test: a measurement. The traces come from :mod:`traces` (workload shapes: multi-turn chat returning
after heavy-tailed gaps, RAG over a drifting Zipf popularity, interleaved tool-calling agents, and uniform
draws with nothing to learn); neither the predictor nor the eviction orders know how they were made.

Each request is replayed through the public API: ``Memory.load_many`` of the chunks it reads (what is timed:
the part of time to first token the cache decides), then ``Memory.store_many`` of the chunks it adds. Every
chunk is ``--chunk-kib`` KiB. The CPU tier holds ``--cpu-share`` of the trace's distinct chunks; below it is
a Redis tier (a throwaway ``redis-server`` on loopback), so a miss is a cold read over a socket, not a page
cache hit. Documents and system prompts are stored in Redis before the trace starts; the CPU tier starts
empty. Requests arrive ``--gap-ms`` apart (background work runs in the gaps); the first ``--warmup`` share of
each run fills the tier and trains the predictor and is not measured.

Rows, per trace, each on the same trace back to back:

- ``lru`` / ``arc``: no prefetch, the CPU tier's eviction order LRU or ARC (``eviction`` in the config);
- ``lru + predictive``: :class:`kvmem.kv.PredictivePrefetcher` told about each request (its stream: the
  conversation, user or agent session);
- ``lru + oracle``: the next request's chunks warmed while this one is served (the next request known, as
  ``PrefixCache.prefetch`` does for a queued request): the ceiling of prefetch.

Reported: CPU-tier hit rate (reads served by the CPU tier over all reads), load latency P50/P99 per
request, MiB read from Redis on the request path, MiB warmed by prefetch and the share of it never used, and
the predictor's own CPU per request over a request's. Medians over ``--repeat`` repetitions (each its own
seed); latency ratios are paired (per repetition, on the same trace, back to back), since 2 shared vCPUs
swing more from run to run than the effects measured.

Usage (from the repository root)::

    python benchmarks/bench_prefetch.py            # 3000 requests a trace, median of 3
    python benchmarks/bench_prefetch.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import records
import torch
import traces
from servers import RedisServer

import kvmem
from kvmem.kv import PredictivePrefetcher
from kvmem.kv.background import Prefetcher

MODES = ("lru", "arc", "lru + predictive", "lru + oracle")


@dataclass
class Result:
    hit_rate: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    cpu_ms: float
    cold_mib: float
    predictor_cpu_ms: float = 0.0
    warmed_mib: float = 0.0
    wasted_share: float = 0.0


class Replay:
    """One trace's chunks in one Redis database: stored before, read and added by the runs."""

    def __init__(
        self, url: str, trace: list[traces.Request], namespace: str, workdir: Path, args: argparse.Namespace
    ) -> None:
        self.url, self.trace, self.namespace, self.workdir, self.args = url, trace, namespace, workdir, args
        self.elements = args.chunk_kib * 1024 // 2
        chunks = traces.summary(trace)["chunks"]
        self.cpu_bytes = max(1, int(chunks * args.cpu_share)) * args.chunk_kib * 1024
        with self._memory(cpu_bytes=1 << 20) as memory:
            for key in traces.pre_stored(trace):
                memory.store(key, self.value(key), namespace=namespace)

    def value(self, key: str) -> torch.Tensor:
        return torch.full((self.elements,), float(zlib.crc32(key.encode()) % 997), dtype=torch.float16)

    def _memory(self, cpu_bytes: int, eviction: str = "lru") -> kvmem.Memory:
        path = tempfile.mkdtemp(prefix="kvmem-", dir=self.workdir)  # its catalog; the chunks are in Redis
        return kvmem.Memory(
            path, cpu_bytes=cpu_bytes, disk_bytes=0, remote_url=self.url, compression="none", eviction=eviction
        )

    def run(self, mode: str) -> Result:
        memory = self._memory(self.cpu_bytes, eviction="arc" if mode == "arc" else "lru")
        store, ns, args, trace = memory.chunk_store(), self.namespace, self.args, self.trace
        predictor = PredictivePrefetcher(memory) if mode.endswith("predictive") else None
        oracle = (
            Prefetcher(lambda k: store.warm(memory.storage_key(k, ns)), memory.config.prefetch_depth, lambda s: None)
            if mode.endswith("oracle")
            else None
        )
        m = memory.metrics
        skip = int(len(trace) * args.warmup)
        times: list[float] = []
        base = {"cpu": 0.0, "all": 0.0, "remote": 0.0, "process": 0.0, "predictor": 0.0}
        moved = {"warmed": 0.0, "wasted": 0.0}

        def counters() -> dict[str, float]:
            return {
                "cpu": m.value("kvmem_hits_total", tier="cpu", kind="tensor"),
                "all": m.total("kvmem_hits_total"),
                "remote": m.value("kvmem_hits_total", tier="redis", kind="tensor"),
                "process": time.process_time(),
                "predictor": m.total("kvmem_predictive_prefetch_cpu_seconds_total"),
            }

        def guesses() -> dict[str, float]:
            return {o: m.value("kvmem_predictive_prefetch_bytes_total", outcome=o) for o in moved}

        for i, request in enumerate(trace):
            if i == skip:
                base, moved = counters(), guesses()
            start = time.perf_counter()
            values = memory.load_many(list(request.reads), namespace=ns)
            elapsed = time.perf_counter() - start
            if any(v is None for v in values):
                raise RuntimeError(f"a chunk of request {i} is missing from every tier")
            if i >= skip:
                times.append(elapsed)
            if request.adds:
                memory.store_many([(k, self.value(k)) for k in request.adds], namespace=ns)
            if oracle is not None and i + 1 < len(trace):
                oracle.prefetch(list(trace[i + 1].reads))
            if predictor is not None:
                predictor.observe([*request.reads, *request.adds], namespace=ns, stream=request.stream)
            time.sleep(args.gap_ms / 1000)
        if predictor is not None:
            predictor.flush()  # its work for the last requests is part of their cost
        end, after = counters(), guesses()
        for closing in (predictor, oracle):
            if closing is not None:
                closing.close()
        memory.close()
        ms = sorted(t * 1e3 for t in times)
        served = end["all"] - base["all"]
        warmed = after["warmed"] - moved["warmed"]
        return Result(
            hit_rate=(end["cpu"] - base["cpu"]) / served if served else 0.0,
            p50_ms=ms[len(ms) // 2],
            p99_ms=ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            mean_ms=statistics.fmean(ms),
            cpu_ms=(end["process"] - base["process"]) * 1e3 / len(ms),
            cold_mib=(end["remote"] - base["remote"]) * args.chunk_kib / 1024,
            predictor_cpu_ms=(end["predictor"] - base["predictor"]) * 1e3 / len(ms),
            warmed_mib=warmed / 2**20,
            wasted_share=(after["wasted"] - moved["wasted"]) / warmed if warmed else 0.0,
        )


def median(results: list[Result], field: str) -> float:
    return statistics.median(getattr(r, field) for r in results)


def paired(results: list[Result], baseline: list[Result], field: str) -> float:
    """The median over repetitions of ``field`` of ``results`` over ``baseline``'s (same trace, back to back)."""
    return statistics.median(getattr(r, field) / getattr(b, field) for r, b in zip(results, baseline))


def below(results: list[Result], baseline: list[Result], field: str) -> int:
    return sum(getattr(r, field) < getattr(b, field) for r, b in zip(results, baseline))


LOWER = "kvmem row / lru, median of per-repetition ratios (< 1: lower)"


def figures(results: dict[tuple[str, str], list[Result]], names: list[str]) -> list[dict[str, object]]:
    """Per trace: hit rate of each row beside LRU's and the oracle's; P99 and P50 of predictive prefetch and
    ARC beside LRU's (paired ratios); bytes; the predictor's CPU on the uniform trace."""
    out = []
    for name in names:
        lru, arc = results[name, "lru"], results[name, "arc"]
        pred, oracle = results[name, "lru + predictive"], results[name, "lru + oracle"]
        group = f"{name} trace"
        base = records.ref("LRU, no prefetch", 100 * median(lru, "hit_rate"))
        top = records.ref("oracle prefetch (next request known)", 100 * median(oracle, "hit_rate"))
        out.append(
            records.figure(
                f"{name}-hit-arc", "CPU-tier hit rate, ARC", "%", 100 * median(arc, "hit_rate"), base, group=group
            )
        )
        out.append(
            records.figure(
                f"{name}-hit-predictive",
                "CPU-tier hit rate, predictive prefetch",
                "%",
                100 * median(pred, "hit_rate"),
                base,
                top,
                group=group,
            )
        )
        for field, what in (("p99_ms", "P99 load latency"), ("p50_ms", "P50 load latency")):
            for row, rs in (("predictive prefetch", pred), ("ARC", arc)):
                out.append(
                    records.figure(
                        f"{name}-{field}-{records.slug(row)}",
                        f"{what}, {row}",
                        "ms",
                        median(rs, field),
                        records.ref("LRU, no prefetch", median(lru, field), paired(rs, lru, field), ratio_is=LOWER),
                        records.ref("oracle prefetch (next request known)", median(oracle, field)),
                        group=group,
                    )
                )
        out.append(
            records.figure(
                f"{name}-cold",
                "MiB read from Redis on the request path, predictive prefetch",
                "MiB",
                median(pred, "cold_mib"),
                records.ref("LRU, no prefetch", median(lru, "cold_mib")),
                records.ref("ARC", median(arc, "cold_mib")),
                group=group,
            )
        )
        out.append(
            records.figure(
                f"{name}-warmed", "MiB warmed by predictive prefetch", "MiB", median(pred, "warmed_mib"), group=group
            )
        )
        out.append(
            records.figure(
                f"{name}-wasted",
                "share of warmed bytes never used",
                "%",
                100 * median(pred, "wasted_share"),
                group=group,
            )
        )
    if "uniform" in names:
        flat, flat_pred = results["uniform", "lru"], results["uniform", "lru + predictive"]
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
                group="uniform trace",
            )
        )
    return out


def verdicts(results: dict[tuple[str, str], list[Result]], names: list[str]) -> list[str]:
    """The issue's checks, as lines: where ARC and predictive prefetch help, and what they cost."""
    lines = []
    arc_gain = {n: 100 * (median(results[n, "arc"], "hit_rate") - median(results[n, "lru"], "hit_rate")) for n in names}
    wins = [n for n, g in arc_gain.items() if g >= 5]
    losses = [n for n, g in arc_gain.items() if g < -1]
    lines.append(
        "ARC over LRU, hit-rate points: "
        + ", ".join(f"{n} {g:+.1f}" for n, g in arc_gain.items())
        + f" (target: >= +5 on two traces: {len(wins)}; worse than -1 on none: {len(losses)})"
    )
    for n in names:
        pred, lru = results[n, "lru + predictive"], results[n, "lru"]
        lines.append(
            f"{n}: predictive prefetch P99 {paired(pred, lru, 'p99_ms'):.2f}x of LRU "
            f"(lower in {below(pred, lru, 'p99_ms')} of {len(lru)}), mean {paired(pred, lru, 'mean_ms'):.2f}x; "
            f"ARC P99 {paired(results[n, 'arc'], lru, 'p99_ms'):.2f}x"
        )
    return lines


def main() -> None:
    run = records.start("bench_prefetch")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="requests of each trace")
    parser.add_argument(
        "--traces", default=",".join(traces.TRACES), help="comma-separated, of " + ", ".join(traces.TRACES)
    )
    parser.add_argument("--chunk-kib", type=int, default=64)
    parser.add_argument("--cpu-share", type=float, default=0.1, help="CPU tier size over the trace's distinct chunks")
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="600 requests, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeat = 600, 1
    names = [n for n in args.traces.split(",") if n]
    unknown = [n for n in names if n not in traces.TRACES]
    if unknown:
        parser.error(f"--traces: {unknown} unknown; accepted: {', '.join(traces.TRACES)}")
    torch.set_num_threads(1)
    results: dict[tuple[str, str], list[Result]] = {(n, mode): [] for n in names for mode in MODES}
    print(
        f"{args.requests} requests a trace, chunks of {args.chunk_kib} KiB, CPU tier {args.cpu_share:.0%} of each "
        f"trace's distinct chunks (offload_threshold 0.7), misses read from Redis on loopback; requests "
        f"{args.gap_ms} ms apart; {args.warmup:.0%} of each run not measured; median of {args.repeat}"
    )
    make: dict[str, Callable[[int, int], list[traces.Request]]] = traces.TRACES
    sizes: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-redis-") as tmp:
        server = RedisServer(Path(tmp))
        try:
            for rep in range(args.repeat):
                for name in names:
                    trace = make[name](args.requests, args.seed + rep)
                    sizes[name] = traces.summary(trace)
                    replay = Replay(server.url, trace, f"{name}{rep}", Path(tmp), args)
                    order = MODES if rep % 2 == 0 else MODES[::-1]  # NOTE: no row always runs first
                    for mode in order:
                        results[name, mode].append(replay.run(mode))
                        r = results[name, mode][-1]
                        print(
                            f"  rep {rep} {name:<8} {mode:<18} hit {r.hit_rate:6.1%}  P99 {r.p99_ms:7.3f} ms",
                            flush=True,
                        )
        finally:
            server.stop()
    header = f"{'trace':<9}{'row':<19}{'CPU hit':>8}{'P50 ms':>9}{'P99 ms':>9}{'mean ms':>9}{'cold MiB':>10}"
    print(header + f"{'warmed MiB':>12}{'wasted':>8}")
    for (name, mode), rs in results.items():
        line = (
            f"{name:<9}{mode:<19}{median(rs, 'hit_rate'):>8.1%}{median(rs, 'p50_ms'):>9.3f}{median(rs, 'p99_ms'):>9.3f}"
            f"{median(rs, 'mean_ms'):>9.3f}{median(rs, 'cold_mib'):>10.1f}"
        )
        if mode.endswith("predictive"):
            line += f"{median(rs, 'warmed_mib'):>12.1f}{median(rs, 'wasted_share'):>8.0%}"
        print(line)
    for line in verdicts(results, names):
        print(line)
    if "uniform" in names:
        flat, flat_pred = results["uniform", "lru"], results["uniform", "lru + predictive"]
        share = statistics.median(p.predictor_cpu_ms / b.cpu_ms for p, b in zip(flat_pred, flat))
        print(f"uniform: predictive prefetch's own CPU {share:.1%} of a request's (target <= 2%)")
    headline = [f"{n}-hit-arc" for n in ("chat", "rag") if n in names]
    records.write(
        run,
        figures(results, names),
        headline=headline,
        machine={"torch_threads": 1, "cold_tier": "redis on loopback"},
        quick=args.quick,
        data={"traces": sizes, "rows": {f"{n} | {mode}": [vars(r) for r in rs] for (n, mode), rs in results.items()}},
    )


if __name__ == "__main__":
    main()
