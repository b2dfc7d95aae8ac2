"""``kvmem demo --tiers``: store KV-cache-sized chunks through the tiers, load them back twice, report.

The workload is the KV cache of a Llama-3.2-1B-like model (16 layers, 8 KV heads,
head_dim 64, bf16), cut into chunks of ``block_size`` tokens (8 MiB per chunk at
256 tokens), keyed by prefix-chained token hashes as the KV layer keys them. The
CPU tier is sized to hold only about a quarter of the workload, so stores demote
to disk and loads promote back: both show in the report.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvmem.api import Memory, TierStats
from kvmem.cli.table import format_percent, format_rate, render_table
from kvmem.config import format_size
from kvmem.keys import chunk_hashes

__all__ = ["LLAMA_3_2_1B", "DemoReport", "KVLayout", "PhaseResult", "cpu_bytes_for", "render_report", "run_demo"]

DEMO_NAMESPACE = "kvmem-demo"
_HEADER_SLACK = 64 * 1024  # room for a blob's header and CRC on top of the raw tensor bytes
_VOCAB = 128_256
_COUNTERS = ("kvmem_misses_total", "kvmem_demotions_total", "kvmem_promotions_total", "kvmem_evictions_total")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one chunk's KV: ``{"k", "v"}`` each ``[layers, kv_heads, tokens, head_dim]``."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def chunk_bytes(self, tokens: int) -> int:
        """Raw bytes of one chunk of ``tokens`` tokens (K and V)."""
        return 2 * self.layers * self.kv_heads * tokens * self.head_dim * self.dtype.itemsize

    def make_chunk(self, index: int, tokens: int) -> dict[str, torch.Tensor]:
        """Chunk ``index``'s K and V: deterministic random values, so they can be made again to compare."""
        g = torch.Generator().manual_seed(index)
        shape = (self.layers, self.kv_heads, tokens, self.head_dim)
        k = torch.randn(shape, generator=g).to(self.dtype)
        return {"k": k, "v": torch.randn(shape, generator=g).to(self.dtype)}


LLAMA_3_2_1B = KVLayout("Llama-3.2-1B", layers=16, kv_heads=8, head_dim=64)


@dataclass
class PhaseResult:
    """One pass over the workload: timing, what the tiers did, and what came back."""

    name: str
    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    hits: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    wrong: int = 0
    missing: int = 0


@dataclass
class DemoReport:
    """Everything ``kvmem demo`` prints."""

    path: str
    layout: KVLayout
    tokens: int
    chunks: int
    tier_names: list[str]
    phases: list[PhaseResult]
    tiers: list[TierStats]

    @property
    def loads(self) -> int:
        return sum(p.count for p in self.phases[1:])

    @property
    def failures(self) -> int:
        """Loads that returned a wrong value or nothing."""
        return sum(p.wrong + p.missing for p in self.phases)


def cpu_bytes_for(layout: KVLayout, tokens: int, chunks: int, offload_threshold: float) -> int:
    """A CPU capacity that keeps about a quarter of ``chunks`` (at least one) below the offload threshold."""
    resident = max(1, chunks // 4)
    return int(resident * (layout.chunk_bytes(tokens) + _HEADER_SLACK) / offload_threshold) + 1


def run_demo(
    memory: Memory, chunks: int, *, layout: KVLayout = LLAMA_3_2_1B, tokens: int = 256, progress: bool | None = None
) -> DemoReport:
    """Store ``chunks`` KV chunks in ``memory``, then load them all back twice and check every bit.

    Pass 1 reads newest first (the CPU tier still holds the latest stores), pass 2
    oldest first (the CPU tier holds what pass 1 read last); everything else comes
    from disk and is promoted.

    Args:
        memory: where to store (its tiers decide what is demoted and promoted).
        chunks: number of chunks.
        layout: model KV layout of a chunk.
        tokens: tokens per chunk.
        progress: show tqdm bars (``None``: only on a terminal).
    """
    token_ids = torch.randint(0, _VOCAB, (chunks * tokens,), generator=torch.Generator().manual_seed(0))
    keys = chunk_hashes(token_ids, tokens, f"{layout.name}/{layout.dtype}")
    tier_names = [t.name for t in memory.stats().tiers]
    phases = [_store_phase(memory, keys, layout, tokens, progress)]
    for name, order in (("load pass 1", range(chunks - 1, -1, -1)), ("load pass 2", range(chunks))):
        phases.append(_load_phase(memory, name, keys, order, layout, tokens, progress))
    return DemoReport(
        path=memory.config.path,
        layout=layout,
        tokens=tokens,
        chunks=chunks,
        tier_names=tier_names,
        phases=phases,
        tiers=memory.stats().tiers,
    )


def _store_phase(
    memory: Memory, keys: Sequence[str], layout: KVLayout, tokens: int, progress: bool | None
) -> PhaseResult:
    result = PhaseResult("store")
    before = _counters(memory)
    for i, key in enumerate(tqdm(keys, desc="store", unit="chunk", disable=_disable(progress))):
        value = layout.make_chunk(i, tokens)
        with _Timer(result):
            memory.store(key, value, namespace=DEMO_NAMESPACE, metadata={"chunk": i, "tokens": tokens})
        result.count += 1
        result.nbytes += layout.chunk_bytes(tokens)
    with _Timer(result):
        memory.flush()  # durable (per config.fsync) before the phase counts as done
    _finish(result, before, _counters(memory))
    return result


def _load_phase(
    memory: Memory,
    name: str,
    keys: Sequence[str],
    order: Iterable[int],
    layout: KVLayout,
    tokens: int,
    progress: bool | None,
) -> PhaseResult:
    result = PhaseResult(name)
    before = _counters(memory)
    for i in tqdm(list(order), desc=name, unit="chunk", disable=_disable(progress)):
        with _Timer(result):
            value = memory.load(keys[i], namespace=DEMO_NAMESPACE)
        result.count += 1
        if value is None:
            result.missing += 1
            continue
        result.nbytes += layout.chunk_bytes(tokens)
        if not _bit_exact(value, layout.make_chunk(i, tokens)):
            result.wrong += 1
    _finish(result, before, _counters(memory))
    return result


def _bit_exact(got: object, want: dict[str, torch.Tensor]) -> bool:
    if not isinstance(got, dict) or set(got) != set(want):
        return False
    return all(
        isinstance(got[k], torch.Tensor)
        and got[k].dtype == w.dtype
        and got[k].shape == w.shape
        and torch.equal(got[k].contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
        for k, w in want.items()
    )


class _Timer:
    """Adds the wall time of a ``with`` block to a phase."""

    def __init__(self, result: PhaseResult) -> None:
        self.result = result

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.result.seconds += time.perf_counter() - self.start


def _disable(progress: bool | None) -> bool | None:
    return None if progress is None else not progress


def _counters(memory: Memory) -> dict[str, int]:
    """Hits per tier (``hits:<tier>``) and the offload counters, summed over labels."""
    out: dict[str, int] = {}
    for family in memory.metrics.registry.collect():
        for s in family.samples:
            if s.name == "kvmem_hits_total":
                name = f"hits:{s.labels['tier']}"
            elif s.name in _COUNTERS:
                name = s.name
            else:
                continue
            out[name] = out.get(name, 0) + int(s.value)
    return out


def _finish(result: PhaseResult, before: dict[str, int], after: dict[str, int]) -> None:
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    result.hits = {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("hits:")}
    result.counters = {
        k.removeprefix("kvmem_").removesuffix("_total"): v for k, v in delta.items() if not k.startswith("hits:")
    }


def render_report(report: DemoReport) -> str:
    """The demo's tables: one row per phase, then tier usage, then the verdict."""
    chunk = report.layout.chunk_bytes(report.tokens)
    lay = report.layout
    lines = [
        f"workload: {report.chunks} chunks of {report.tokens} tokens, {lay.name} KV layout "
        f"({lay.layers} layers x {lay.kv_heads} KV heads x {lay.head_dim} head_dim, K and V, "
        f"{str(lay.dtype).removeprefix('torch.')}) = {format_size(chunk)} per chunk, "
        f"{format_size(chunk * report.chunks)} in all",
        "",
    ]
    headers = (
        ["phase", "chunks", "bytes", "seconds", "GB/s"]
        + [f"{t} hits" for t in report.tier_names]
        + ["misses", "demoted", "promoted", "evicted"]
    )
    rows = [
        [p.name, p.count, format_size(p.nbytes), p.seconds, format_rate(p.nbytes, p.seconds)]
        + [p.hits.get(t, 0) for t in report.tier_names]
        + [p.counters.get(c, 0) for c in ("misses", "demotions", "promotions", "evictions")]
        for p in report.phases
    ]
    lines += [
        render_table(headers, rows),
        "",
        "pass 1 reads newest first, pass 2 oldest first; a disk hit is promoted to the CPU tier,",
        "which demotes its least recently used chunk (already on disk: write-through)",
        "",
    ]
    lines.append(
        render_table(
            ["tier", "usage", "capacity", "used", "entries"],
            [
                [t.name, format_size(t.usage), format_size(t.capacity), format_percent(t.usage, t.capacity), t.entries]
                for t in report.tiers
            ],
        )
    )
    lines.append("")
    if report.failures:
        wrong, missing = (sum(getattr(p, a) for p in report.phases) for a in ("wrong", "missing"))
        lines.append(f"FAILED: {wrong} of {report.loads} loads came back wrong, {missing} missing")
    else:
        lines.append(f"OK: all {report.loads} loads came back bit-exact")
    return "\n".join(lines)
