"""Eviction orders simulated on the traces of :mod:`traces`: hit rate of LRU, ARC and S3-FIFO by cache size.

Not a test: a measurement, and how kvmem's memory tiers got their second eviction order. Each trace is
replayed against a cache of a share of its distinct chunks (counted in chunks: every chunk is the same
size): a read that misses inserts the chunk (a promotion), a request's added chunks are inserted after it.
ARC and LRU are kvmem's own orders (:mod:`kvmem.stores.eviction`, driven as a tier drives them); S3-FIFO
(Yang et al., SOSP '23: a small FIFO of 10 % for new entries, a main FIFO, a ghost FIFO, 2-bit frequency)
is written here for the comparison. No I/O and no timing: ``bench_prefetch.py`` measures the real tiers.

Usage (from the repository root)::

    python benchmarks/sim_eviction.py             # 6000 requests a trace, seeds 0-2
"""

from __future__ import annotations

import argparse
import statistics
import threading
from collections import OrderedDict, deque

import records
import traces

from kvmem.stores.eviction import Arc, Lru, Order

SHARES = (0.05, 0.1, 0.2)


class OrderCache:
    """A cache of ``capacity`` chunks that gives chunks up in a kvmem eviction order."""

    def __init__(self, capacity: int, eviction: str) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, object] = OrderedDict()
        self.order: Order = Arc() if eviction == "arc" else Lru(self.entries)
        self.lock = threading.Lock()

    def read(self, key: str) -> bool:
        if key in self.entries:
            self.order.hit(key)
            return True
        self.add(key)
        return False

    def add(self, key: str) -> None:
        if key in self.entries:
            self.order.hit(key)
            return
        if len(self.entries) >= self.capacity:
            victim = next(self.order.victims(self.lock))
            del self.entries[victim]
            self.order.removed(victim)
        self.entries[key] = None
        self.order.added(key, 1)


class S3Fifo:
    """S3-FIFO over ``capacity`` chunks."""

    def __init__(self, capacity: int, small: float = 0.1) -> None:
        self.capacity, self.small_cap = capacity, max(1, int(capacity * small))
        self.small: deque[str] = deque()
        self.main: deque[str] = deque()
        self.ghost: OrderedDict[str, None] = OrderedDict()
        self.freq: dict[str, int] = {}

    def read(self, key: str) -> bool:
        if key in self.freq:
            self.freq[key] = min(self.freq[key] + 1, 3)
            return True
        self.add(key)
        return False

    def add(self, key: str) -> None:
        if key in self.freq:
            self.freq[key] = min(self.freq[key] + 1, 3)
            return
        while len(self.freq) >= self.capacity:
            self._evict()
        if key in self.ghost:  # it left too early once: into the main FIFO
            del self.ghost[key]
            self.main.append(key)
        else:
            self.small.append(key)
        self.freq[key] = 0

    def _evict(self) -> None:
        if len(self.small) >= self.small_cap or not self.main:
            while self.small:
                key = self.small.popleft()
                if self.freq[key] >= 1:  # read again while in the small FIFO: into the main one
                    self.main.append(key)
                    self.freq[key] = 0
                    if len(self.main) > self.capacity - self.small_cap:
                        break
                else:
                    del self.freq[key]
                    self.ghost[key] = None
                    while len(self.ghost) > self.capacity:
                        self.ghost.popitem(last=False)
                    return
        while self.main:
            key = self.main.popleft()
            if self.freq[key] > 0:
                self.freq[key] -= 1
                self.main.append(key)
            else:
                del self.freq[key]
                return


def hit_rate(trace: list[traces.Request], cache: OrderCache | S3Fifo) -> float:
    hits = reads = 0
    for request in trace:
        for key in request.reads:
            hits += cache.read(key)
            reads += 1
        for key in request.adds:
            cache.add(key)
    return hits / reads


def main() -> None:
    run = records.start("sim_eviction")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1500 requests, one seed")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.seeds = 1500, 1
    rates: dict[tuple[str, float, str], list[float]] = {}
    for name, make in traces.TRACES.items():
        for seed in range(args.seeds):
            trace = make(args.requests, seed)
            chunks = traces.summary(trace)["chunks"]
            for share in SHARES:
                capacity = max(4, int(chunks * share))
                for policy, cache in (
                    ("lru", OrderCache(capacity, "lru")),
                    ("arc", OrderCache(capacity, "arc")),
                    ("s3-fifo", S3Fifo(capacity)),
                ):
                    rates.setdefault((name, share, policy), []).append(100 * hit_rate(trace, cache))
    print(
        f"{args.requests} requests a trace, median hit rate (%) of {args.seeds} seeds, cache = share of distinct chunks"
    )
    print(f"{'trace':<9}{'cache':>6}{'LRU':>8}{'ARC':>8}{'S3-FIFO':>9}{'ARC-LRU':>9}{'S3-LRU':>8}")
    figures = []
    for name in traces.TRACES:
        for share in SHARES:
            lru, arc, s3 = (statistics.median(rates[name, share, p]) for p in ("lru", "arc", "s3-fifo"))
            print(f"{name:<9}{share:>6.0%}{lru:>8.1f}{arc:>8.1f}{s3:>9.1f}{arc - lru:>+9.1f}{s3 - lru:>+8.1f}")
            figures.append(
                records.figure(
                    f"{name}-{round(share * 100)}-arc",
                    f"hit rate, ARC, cache {share:.0%} of the chunks",
                    "%",
                    arc,
                    records.ref("LRU", lru, arc - lru, ratio_is="points over it"),
                    records.ref("S3-FIFO", s3, arc - s3, ratio_is="points over it"),
                    group=f"{name} trace",
                )
            )
    records.write(run, figures, headline=[], quick=args.quick)


if __name__ == "__main__":
    main()
