"""Prometheus collectors of one :class:`kvmem.Memory`, on a registry passed in, and their HTTP exporter.

NOTE: each working process serves its own ``/metrics`` (``Memory(metrics_port=...)``), the
way Prometheus expects one target per process; prometheus_client's multiprocess mode was not
chosen: it is switched on for the whole process by an environment variable read when
prometheus_client is imported (so for the application's own metrics too), needs the files of
dead processes cleaned up, and drops function gauges (hit rate, usage read when scraped).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.registry import Collector, RestrictedRegistry

from kvmem.errors import ConfigError

__all__ = ["Exporter", "Metrics"]

_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The kvmem metric family. Each ``Memory`` owns one, on its own registry by default.

    Args:
        registry: where the collectors are registered (a new private registry when ``None``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.memory_usage = Gauge("kvmem_memory_usage_bytes", "Bytes held per tier", ["tier"], registry=r)
        self.capacity = Gauge("kvmem_capacity_bytes", "Capacity per tier", ["tier"], registry=r)
        self.hits = Counter("kvmem_hits_total", "Loads served, by tier and value kind", ["tier", "kind"], registry=r)
        self.misses = Counter("kvmem_misses_total", "Loads that found nothing usable", ["kind"], registry=r)
        self.hit_rate = Gauge("kvmem_hit_rate", "hits / (hits + misses) since start", registry=r)
        self.hit_rate.set_function(self._rate)  # computed when scraped, not on every load
        self.load_seconds = Histogram("kvmem_load_seconds", "Latency of load()", buckets=_LATENCY_BUCKETS, registry=r)
        self.store_seconds = Histogram(
            "kvmem_store_seconds", "Latency of store()", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.compression_ratio = Gauge(
            "kvmem_compression_ratio",
            "Raw bytes / stored bytes over all stores since start: 2.0 means half the bytes saved, 1.0 none",
            registry=r,
        )
        self.compression_ratio.set_function(lambda: self._raw / self._stored if self._stored else 0.0)
        self.crc_failures = Counter(
            "kvmem_crc_failures_total", "Entries that failed their integrity check", ["tier"], registry=r
        )
        self.evictions = Counter("kvmem_evictions_total", "Entries dropped from a tier for room", ["tier"], registry=r)
        self.demotions = Counter(
            "kvmem_demotions_total", "Entries moved to a lower tier for room", ["tier"], registry=r
        )
        self.promotions = Counter("kvmem_promotions_total", "Entries copied up on a hit", ["tier"], registry=r)
        self.tier_errors = Counter(
            "kvmem_tier_errors_total", "Operations a failing tier could not serve", ["tier"], registry=r
        )
        self.recovered_files = Counter(
            "kvmem_recovered_files_total",
            "Damaged metadata files moved aside and rebuilt, by file (areas, catalog, journal, hnsw)",
            ["file"],
            registry=r,
        )
        self.kv_tokens = Counter(
            "kvmem_kv_tokens_total", "Prompt tokens seen by the KV prefix cache", ["kind"], registry=r
        )  # kind: requested | reused | computed
        self.kv_chunk_hits = Counter(
            "kvmem_kv_chunk_hits_total", "KV chunks loaded, by serving tier", ["tier"], registry=r
        )
        self.ttft_seconds = Histogram(
            "kvmem_ttft_seconds",
            "Prefill time to first-token logits (prefix load + forward)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prefetch_seconds = Histogram(
            "kvmem_prefetch_latency_seconds", "Time to warm one request's chunks", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.predictive = Counter(
            "kvmem_predictive_prefetch_total",
            "Predictive prefetch decisions, by outcome: predicted (entries a prediction named), warmed (copied "
            "into the memory tier on a guess), resident (already there), no_room, missing (not stored), "
            "used (a load hit the guess), wasted (it left the tier unused)",
            ["outcome"],
            registry=r,
        )
        self.predictive_bytes = Counter(
            "kvmem_predictive_prefetch_bytes_total",
            "Bytes of predictive prefetch guesses, by outcome (warmed, used, wasted)",
            ["outcome"],
            registry=r,
        )
        self.predictive_cpu = Counter(
            "kvmem_predictive_prefetch_cpu_seconds",
            "CPU time of the predictive prefetcher's thread (learning, predicting, copying guesses)",
            registry=r,
        )
        self._hits = 0
        self._misses = 0
        self._hits_by: dict[tuple[str, str], int] = {}  # (tier, kind) -> hits: read without collecting the registry
        self._hits_lock = threading.Lock()
        self._children: dict[tuple[Counter, tuple[str, ...]], Counter] = {}
        self._raw = 0
        self._stored = 0

    def hit(self, tier: str, kind: str) -> None:
        self._child(self.hits, tier, kind).inc()
        self._hits += 1
        with self._hits_lock:
            self._hits_by[tier, kind] = self._hits_by.get((tier, kind), 0) + 1

    def hits_of(self, tier: str, kind: str) -> int:
        """Hits tier ``tier`` served of values of kind ``kind`` so far (``kvmem_hits_total{tier, kind}``): for
        a caller that reads it every step, where :meth:`value` collects the whole registry (~0.2 ms a read)."""
        return self._hits_by.get((tier, kind), 0)

    def count_guess(self, outcome: str, nbytes: int = 0) -> None:
        """Count one predictive prefetch decision (see ``kvmem_predictive_prefetch_total``), and its bytes."""
        self._child(self.predictive, outcome).inc()
        if nbytes:
            self._child(self.predictive_bytes, outcome).inc(nbytes)

    def _child(self, counter: Counter, *labels: str) -> Counter:
        """``counter.labels(*labels)``, looked up once: ``labels()`` costs ~1.5 us a call, and a load counts
        a hit per key and an outcome per guess it used."""
        child = self._children.get((counter, labels))
        if child is None:
            child = self._children[counter, labels] = counter.labels(*labels)
        return child

    def recovered(self, file: str) -> None:
        """Count a damaged metadata file set aside (``file``: its label, see :mod:`kvmem.recovery`)."""
        self.recovered_files.labels(file=file).inc()

    def miss(self, kind: str, count: int = 1) -> None:
        """Count ``count`` loads of ``kind`` values that found nothing usable."""
        self.misses.labels(kind=kind).inc(count)
        self._misses += count

    def stored(self, raw_bytes: int, stored_bytes: int) -> None:
        self._raw += raw_bytes
        self._stored += stored_bytes  # the ratio is computed when scraped

    def _rate(self) -> float:
        seen = self._hits + self._misses
        return self._hits / seen if seen else 0.0

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (0 when never set).

        E.g. ``value("kvmem_hits_total", tier="cpu", kind="tensor")``.
        """
        return self.registry.get_sample_value(name, labels) or 0.0

    def total(self, name: str) -> float:
        """Sum of a counter over all its label values."""
        return sum(s.value for m in self.registry.collect() for s in m.samples if s.name == name)


class Exporter:
    """``/metrics`` of ``collector`` served over HTTP from a daemon thread of this process, until :meth:`close`.

    Args:
        collector: what is served (a registry, or a restricted view of one).
        host: address to listen on.
        port: TCP port; 0 picks a free one (:attr:`url` names it).

    Raises:
        ConfigError: nothing can listen there (port in use, unknown address).
    """

    def __init__(self, collector: Collector | RestrictedRegistry, host: str, port: int) -> None:
        try:
            server, thread = start_http_server(port, addr=host, registry=collector)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port} for /metrics ({exc.strerror or exc}): accepted a "
                "free port (0: any free one) on an address of this machine"
            ) from None
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        netloc = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets
        self.url = f"http://{netloc}:{server.server_port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
