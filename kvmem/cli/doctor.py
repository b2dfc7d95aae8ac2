"""``kvmem doctor``: the tuning table turned into checks, each a pure function of a :class:`Snapshot`.

| symptom | setting |
| --- | --- |
| high first-token latency, chunks served from disk (prefetch missed) | ``prefetch_depth`` |
| reuse lost to chunk granularity, fragmented cache | ``block_size`` |
| stores slowed by I/O (fsync per write, full write-back queue) | ``write_policy``, ``fsync``, ``write_back_queue`` |
| frequent demotions/evictions, reused set larger than a tier | ``cpu_bytes``, ``disk_bytes``, ``offload_threshold`` |
| CRC failures, quarantined entries, failing tiers | ``kvmem verify --fix``, the disk itself |
| damaged metadata files set aside and rebuilt (``*.corrupt-*``) | the disk itself |
| large copies slower than they could be (``kvmem._stream`` not built) | reinstall kvmem with a C compiler |

In a serving process, ``diagnose(memory)`` also judges this process's live
counters (latency, chunk hits per tier, evictions). ``kvmem doctor`` runs in a
process of its own, so it sees what persists: catalog, tier usage, quarantine,
config. Every rule returns at least one :class:`Finding` (``ok`` when nothing is
wrong), with the numbers it judged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvmem.api import Memory
from kvmem.cli.doctor_snapshot import KVChunkGroup, LiveMetrics, Snapshot, take_snapshot
from kvmem.cli.table import format_percent
from kvmem.config import format_size

__all__ = [
    "Finding",
    "Severity",
    "Snapshot",
    "Thresholds",
    "check",
    "diagnose",
    "format_number",
    "render_findings",
    "take_snapshot",
    "RULES",
]

Severity = Literal["ok", "info", "warn"]
Number = int | float | str


@dataclass(frozen=True)
class Finding:
    """One conclusion of the doctor.

    Attributes:
        check: the area (``prefetch``, ``block_size``, ``pipeline``, ``capacity``, ``integrity``, ``copies``).
        severity: ``ok``, ``info`` (worth knowing) or ``warn`` (act on it).
        title: one line saying what was found.
        numbers: the evidence. Key suffixes give units: ``_bytes``, ``_s`` (seconds), ``_share`` (0..1).
        recommendation: the setting change or action (empty when there is nothing to do).
    """

    check: str
    severity: Severity
    title: str
    numbers: dict[str, Number] = field(default_factory=dict)
    recommendation: str = ""


@dataclass(frozen=True)
class Thresholds:
    """Where the rules draw their lines (defaults suit CPU-served models; pass your own for GPUs)."""

    min_samples: int = 8  # requests, chunk hits or stores a live rule needs before it judges
    slow_ttft_s: float = 0.25  # mean time to first token called high
    slow_tier_share: float = 0.5  # share of chunk hits from persistent tiers called "mostly from disk"
    min_chunks_per_prompt: float = 4.0  # below: the trailing partial chunk is a large share of a prompt
    max_chunks_per_prompt: float = 512.0  # above: per-chunk overhead (rows, lookups) dominates
    min_kv_chunks: int = 32  # catalog KV chunks before fragmentation is judged
    fragmented_share: float = 0.8  # share of KV chunks never reused called fragmented
    slow_store_s: float = 0.02  # p90 store latency called slow
    churn_ratio: float = 0.5  # demotions + evictions per store (or promotion) called thrashing
    full_share: float = 0.9  # a persistent tier this full evicts on every store


def diagnose(memory: Memory, thresholds: Thresholds | None = None) -> list[Finding]:
    """Findings for a running ``memory``: its data directory *and* this process's metrics."""
    return check(take_snapshot(memory, live=True), thresholds)


def check(snapshot: Snapshot, thresholds: Thresholds | None = None) -> list[Finding]:
    """Every rule over ``snapshot``, in table order."""
    t = thresholds or Thresholds()
    return [finding for rule in RULES for finding in rule(snapshot, t)]


# -- (a) prefetch -------------------------------------------------------------------------
def check_prefetch(s: Snapshot, t: Thresholds) -> list[Finding]:
    """High TTFT while chunks come from disk: prefetch did not warm them in time; and predictive prefetch's
    guesses (when it is on, or guessed in this process): how many were used, how many wasted."""
    return _queue_prefetch(s, t) + _predictive_prefetch(s, t)


def _queue_prefetch(s: Snapshot, t: Thresholds) -> list[Finding]:
    depth = s.config.prefetch_depth
    if s.live is None:
        if depth == 0 and any(g.reused for g in s.kv):
            return [
                Finding(
                    "prefetch",
                    "warn",
                    "prefetch is off while stored KV chunks are reused",
                    {"prefetch_depth": depth, "reused_chunks": sum(g.reused for g in s.kv)},
                    "prefetch_depth: 0 -> 3, and call PrefixCache.prefetch(ids) when a request is queued",
                )
            ]
        return [
            Finding(
                "prefetch",
                "info",
                "latency and chunk hits are per process: judge them where the model "
                "runs, with kvmem.cli.doctor.diagnose(memory)",
                {"prefetch_depth": depth},
            )
        ]
    live = s.live
    hits = sum(live.chunk_hits.values())
    if hits < t.min_samples:
        return [
            Finding(
                "prefetch",
                "info",
                f"too little KV traffic in this process to judge ({hits} chunk hits)",
                {"chunk_hits": hits, "prefetch_depth": depth},
            )
        ]
    slow = sum(n for tier, n in live.chunk_hits.items() if _persistent(s, tier))
    numbers: dict[str, Number] = {
        "ttft_mean_s": live.ttft.mean,
        "ttft_p90_s": live.ttft.p90,
        **{f"chunk_hits_{k}": v for k, v in sorted(live.chunk_hits.items())},
        "from_disk_share": slow / hits,
        "prefetches": live.prefetch.count,
        "prefetch_mean_s": live.prefetch.mean,
        "prefetch_depth": depth,
    }
    if slow / hits < t.slow_tier_share:
        return [Finding("prefetch", "ok", "KV chunks are mostly served from memory tiers", numbers)]
    if live.ttft.mean < t.slow_ttft_s:
        return [
            Finding("prefetch", "info", "KV chunks mostly come from disk, but first tokens are still fast", numbers)
        ]
    action = f"prefetch_depth: {depth} -> {max(3, 2 * depth)}"
    if not live.prefetch.count:
        action += "; no prefetch ran in this process: call PrefixCache.prefetch(ids) when a request is queued"
    return [
        Finding(
            "prefetch",
            "warn",
            "high first-token latency with KV chunks mostly read from disk (prefetch missed them)",
            numbers,
            action,
        )
    ]


def _predictive_prefetch(s: Snapshot, t: Thresholds) -> list[Finding]:
    """One line on predictive prefetch: off, not judged out of process, or its guesses' outcomes."""
    on = s.config.predictive_prefetch
    counts = s.live.predictive if s.live is not None else {}
    if not on and not counts:
        return []
    if s.live is None:
        return [Finding("prefetch", "info", "predictive prefetch is on; its guesses are counted per process", {})]
    sizes = s.live.predictive_bytes
    warmed, used, wasted = (sizes.get(k, 0) for k in ("warmed", "used", "wasted"))
    numbers: dict[str, Number] = {
        "predicted": counts.get("predicted", 0),
        "warmed": counts.get("warmed", 0),
        "no_room": counts.get("no_room", 0),
        "warmed_bytes": warmed,
        "used_bytes": used,
        "wasted_bytes": wasted,
        "cpu_seconds": round(s.live.predictive_cpu_seconds, 6),
    }
    if counts.get("used", 0) + counts.get("wasted", 0) < t.min_samples or not used + wasted:
        return [Finding("prefetch", "info", "predictive prefetch: too few guesses settled to judge", numbers)]
    numbers["wasted_share"] = wasted / (used + wasted)
    title = f"predictive prefetch: {format_percent(used, used + wasted)} of the settled guessed bytes were used"
    if wasted > used:
        return [Finding("prefetch", "warn", title, numbers, "predictive_prefetch: true -> false")]
    return [Finding("prefetch", "ok", title, numbers)]


# -- (b) block size -------------------------------------------------------------------------
def check_block_size(s: Snapshot, t: Thresholds) -> list[Finding]:
    """Chunk granularity against prompt lengths, stale block sizes, and never-reused chunks."""
    block = s.config.block_size
    out = [
        Finding(
            "block_size",
            "info",
            f"{g.chunks} KV chunks were stored with block_size {g.block_size}, not "
            f"the configured {block}: a PrefixCache using the config never finds them",
            {
                "block_size": block,
                "other_block_size": g.block_size,
                "other_chunks": g.chunks,
                "other_bytes": g.stored_bytes,
            },
            f"block_size: {block} -> {g.block_size} to reuse them, or let them age out",
        )
        for g in s.kv
        if g.block_size != block and g.chunks
    ]
    if s.live is not None:
        out += _prompt_granularity(s.live, block, t)
    for group in s.kv:
        if group.chunks >= t.min_kv_chunks:
            out += _fragmentation(group, t)
    if not out:
        numbers: dict[str, Number] = {"block_size": block, "kv_chunks": sum(g.chunks for g in s.kv)}
        out.append(Finding("block_size", "ok", f"block_size {block} shows no sign of lost reuse", numbers))
    return out


def _prompt_granularity(live: LiveMetrics, block: int, t: Thresholds) -> list[Finding]:
    """Block size against the mean prompt length (requested KV tokens per TTFT observation, i.e. per prefill).

    ``PrefixCache.generate`` counts its prompt tokens but observes no TTFT, so
    a process that mostly generates reads as having longer prompts than it has.
    """
    prefills = live.ttft.count
    requested = live.kv_tokens.get("requested", 0)
    if prefills < t.min_samples or not requested:
        return []
    tokens = requested / prefills
    per_prompt = tokens / block
    numbers: dict[str, Number] = {
        "block_size": block,
        "prompt_tokens_mean": round(tokens, 1),
        "chunks_per_prompt": round(per_prompt, 2),
        "reused_share": live.kv_tokens.get("reused", 0) / requested,
    }
    smaller = _pow2_floor(tokens / 8)
    if per_prompt < t.min_chunks_per_prompt and 16 <= smaller < block:
        numbers["tail_share"] = min(1.0, block / 2 / tokens)
        return [
            Finding(
                "block_size",
                "warn",
                f"block_size {block} is coarse for prompts of ~{tokens:.0f} tokens: "
                "the trailing partial chunk (block_size/2 tokens on average) is always recomputed",
                numbers,
                f"block_size: {block} -> {smaller}",
            )
        ]
    if per_prompt > t.max_chunks_per_prompt:
        larger = _pow2_floor(tokens / 64)
        return [
            Finding(
                "block_size",
                "info",
                f"block_size {block} is fine-grained: ~{per_prompt:.0f} chunks "
                "per prompt, each its own catalog row and load",
                numbers,
                f"block_size: {block} -> {larger}",
            )
        ]
    return []


def _fragmentation(g: KVChunkGroup, t: Thresholds) -> list[Finding]:
    never = g.chunks - g.reused
    numbers: dict[str, Number] = {
        "block_size": g.block_size,
        "kv_chunks": g.chunks,
        "never_reused": never,
        "never_reused_share": never / g.chunks,
        "kv_bytes": g.stored_bytes,
        "never_reused_bytes": g.stored_bytes - g.reused_bytes,
        "chunk_hits": g.hits,
        "re_stored": g.re_stored,
    }
    if never / g.chunks < t.fragmented_share:
        return []
    smaller = max(16, g.block_size // 2)
    change = f"block_size: {g.block_size} -> {smaller}" if smaller < g.block_size else ""
    if not g.reused:
        return [
            Finding(
                "block_size",
                "info",
                f"none of {g.chunks} stored KV chunks was ever reused: no prompts "
                f"shared a prefix of {g.block_size} tokens",
                numbers,
                change and f"if prompts share shorter prefixes: {change}",
            )
        ]
    return [
        Finding(
            "block_size",
            "warn",
            f"fragmented: {format_percent(never, g.chunks)} of KV chunks were never "
            "reused, while a few are: shared prefixes end inside chunks",
            numbers,
            change,
        )
    ]


# -- (c) pipeline ---------------------------------------------------------------------------------
def check_pipeline(s: Snapshot, t: Thresholds) -> list[Finding]:
    """Stores slowed by I/O: fsync per write, synchronous write-through, a full write-back queue."""
    c = s.config
    store = s.live.store if s.live is not None else None
    numbers: dict[str, Number] = {
        "write_policy": c.write_policy,
        "fsync": c.fsync,
        "write_back_queue": c.write_back_queue,
    }
    if store is not None:
        numbers.update(stores=store.count, store_mean_s=store.mean, store_p90_s=store.p90)
    measured = store is not None and store.count >= t.min_samples
    p90_ms = 1e3 * store.p90 if store is not None else 0.0
    slow = measured and p90_ms >= 1e3 * t.slow_store_s
    out = []
    if c.fsync == "always":
        out.append(
            Finding(
                "pipeline",
                "warn",
                "every store waits for its own fsync",
                numbers,
                "fsync: always -> batch (one fsync per flush; writes stay atomic)",
            )
        )
    if slow and c.write_policy == "through":
        out.append(
            Finding(
                "pipeline",
                "warn",
                f"stores take {p90_ms:.0f} ms (p90) writing through to persistent tiers while the caller waits",
                numbers,
                "write_policy: through -> back (disk writes leave the request path)",
            )
        )
    elif slow and c.write_policy == "back":
        out.append(
            Finding(
                "pipeline",
                "warn",
                f"stores take {p90_ms:.0f} ms (p90) with write-back: "
                "the write-back queue is full and stores wait for room",
                numbers,
                f"write_back_queue: {c.write_back_queue} -> {2 * c.write_back_queue}, or a faster disk",
            )
        )
    if not out:
        what = (
            "store latency is fine"
            if measured
            else "no I/O contention in the config (store latency is judged in-process)"
        )
        out.append(Finding("pipeline", "ok", what, numbers))
    return out


# -- (d) capacity and offload -------------------------------------------------------------------------
def check_capacity(s: Snapshot, t: Thresholds) -> list[Finding]:
    """Reused set against the CPU tier, full persistent tiers, demotion/eviction churn."""
    c = s.config
    out = []
    cpu = s.tier("cpu")
    if cpu is not None and s.hot_bytes > cpu.capacity * c.offload_threshold:
        want = _size_setting(int(s.hot_bytes * 1.25 / c.offload_threshold))
        out.append(
            Finding(
                "capacity",
                "warn",
                "the reused set is larger than the CPU tier keeps: reused entries are demoted and read back from disk",
                {
                    "hot_entries": s.hot_entries,
                    "hot_bytes": s.hot_bytes,
                    "cpu_bytes": cpu.capacity,
                    "offload_threshold": c.offload_threshold,
                },
                f"cpu_bytes: {_size_setting(cpu.capacity)} -> {want}",
            )
        )
    for tier in s.tiers:
        if tier.persistent and tier.capacity and tier.usage >= t.full_share * tier.capacity:
            out.append(
                Finding(
                    "capacity",
                    "warn",
                    f"tier {tier.name} is {format_percent(tier.usage, tier.capacity)} "
                    "full: new stores evict its least recently used entries",
                    {f"{tier.name}_usage_bytes": tier.usage, f"{tier.name}_capacity_bytes": tier.capacity},
                    f"{tier.name}_bytes: {_size_setting(tier.capacity)} -> "
                    f"{_size_setting(2 * tier.capacity)}, or kvmem gc",
                )
            )
    if s.live is not None:
        out += _churn(s, s.live, t)
    if c.offload_threshold < 0.5:
        out.append(
            Finding(
                "capacity",
                "info",
                f"offload_threshold {c.offload_threshold} demotes early: most of each memory tier stays empty",
                {"offload_threshold": c.offload_threshold},
                f"offload_threshold: {c.offload_threshold} -> 0.7",
            )
        )
    if not out:
        numbers: dict[str, Number] = {"hot_bytes": s.hot_bytes}
        # out of process, memory tiers are empty: only persistent tiers' usage means anything
        numbers.update(
            {
                f"{x.name}_usage_share": x.usage / x.capacity
                for x in s.tiers
                if x.capacity and (x.persistent or s.live is not None)
            }
        )
        out.append(Finding("capacity", "ok", "tiers have room for what is reused", numbers))
    return out


def _churn(s: Snapshot, live: LiveMetrics, t: Thresholds) -> list[Finding]:
    moved = sum(live.demotions.values()) + sum(live.evictions.values())
    basis = max(live.store.count, sum(live.promotions.values()))
    if moved < t.min_samples or moved < t.churn_ratio * basis:
        return []
    numbers: dict[str, Number] = {
        **{f"demotions_{k}": v for k, v in sorted(live.demotions.items())},
        **{f"evictions_{k}": v for k, v in sorted(live.evictions.items())},
        **{f"promotions_{k}": v for k, v in sorted(live.promotions.items())},
        "stores": live.store.count,
        "ttft_mean_s": live.ttft.mean,
    }
    first = next((x for x in s.tiers if not x.persistent), None) or (s.tiers[0] if s.tiers else None)
    if first is None:
        return []
    setting = "cpu_bytes" if first.name == "cpu" else f"{first.name}_bytes"
    return [
        Finding(
            "capacity",
            "warn",
            f"entries churn through the tiers ({moved} demotions/evictions for "
            f"{basis} stores/promotions): long contexts keep being moved down and read back",
            numbers,
            f"{setting}: {_size_setting(first.capacity)} -> {_size_setting(2 * first.capacity)}, "
            f"or offload_threshold: {s.config.offload_threshold} -> "
            f"{min(0.9, round(s.config.offload_threshold + 0.15, 2))}",
        )
    ]


# -- (e) integrity ---------------------------------------------------------------------------------------
def check_integrity(s: Snapshot, t: Thresholds) -> list[Finding]:
    """CRC failures and quarantined entries; tiers that fail; damaged metadata files set aside; a blob-format
    migration left unfinished."""
    crc = sum(s.live.crc_failures.values()) if s.live is not None else 0
    numbers: dict[str, Number] = {
        "quarantined_rows": s.quarantined_rows,
        "quarantine_files": s.quarantine_files,
        "quarantine_bytes": s.quarantine_bytes,
    }
    if s.live is not None:
        numbers["crc_failures"] = crc
    out = []
    if crc or s.quarantined_rows or s.quarantine_files:
        out.append(
            Finding(
                "integrity",
                "warn",
                "corrupt entries were found and quarantined",
                numbers,
                "run `kvmem verify --fix`, then `kvmem gc`; if it recurs, check the disk (dmesg, SMART, free space)",
            )
        )
    errors = dict(s.live.tier_errors) if s.live is not None else {}
    down = [x.name for x in s.tiers if not x.healthy]
    if errors or down:
        failing = sorted(set(errors) | set(down))
        out.append(
            Finding(
                "integrity",
                "warn",
                f"tier(s) {', '.join(failing)} failed and were skipped",
                {**{f"tier_errors_{k}": v for k, v in sorted(errors.items())}, "unhealthy": ",".join(down) or "-"},
                "check the failing tier: disk space and permissions, Redis / PostgreSQL reachability",
            )
        )
    out += _set_aside(s)
    areas = s.disk_areas
    if areas is not None and areas.target is not None:
        out.append(
            Finding(
                "integrity",
                "warn",
                f"a blob-format migration to format {areas.target_format} is under "
                f"way (area {areas.target}); entries are read from both areas until it finishes",
                {"active_format": areas.format, "target_format": areas.target_format or 0},
                f"finish it: `kvmem migrate --to-format {areas.target_format}` (resumes where it stopped)",
            )
        )
    if not out:
        out.append(
            Finding(
                "integrity",
                "ok",
                "nothing quarantined, no failing tiers (`kvmem verify` reads every copy for a full CRC scan)",
                numbers,
            )
        )
    return out


def _set_aside(s: Snapshot) -> list[Finding]:
    """Damaged metadata files kvmem moved aside and rebuilt (kept for inspection, never deleted)."""
    if not s.set_aside:
        return []
    shown = ", ".join(s.set_aside[:3]) + (f" and {len(s.set_aside) - 3} more" if len(s.set_aside) > 3 else "")
    return [
        Finding(
            "integrity",
            "warn",
            f"{len(s.set_aside)} damaged metadata file(s) were set aside and rebuilt from the blobs: {shown}",
            {"set_aside_files": len(s.set_aside)},
            "inspect them, then delete them; if it recurs, check the disk (dmesg, SMART, free space)",
        )
    ]


# -- (f) copies -----------------------------------------------------------------------------------------------
def check_copies(s: Snapshot, t: Thresholds) -> list[Finding]:
    """Large host copies through torch on a machine where kvmem's streaming copies would run: it was installed
    without a C compiler."""
    if s.copies != "not built":
        title = "large host copies use streaming stores" if s.copies == "streaming" else "no streaming stores here"
        return [Finding("copies", "ok", title)]
    return [
        Finding(
            "copies",
            "warn",
            "kvmem._stream is not built: copies of 1 MiB and more go through torch (about 1.4x slower measured)",
            {},
            "reinstall kvmem where a C compiler is found (`pip install --force-reinstall --no-deps kvmem`, "
            "or `pip install -e .` in a checkout)",
        )
    ]


RULES: tuple[Callable[[Snapshot, Thresholds], list[Finding]], ...] = (
    check_prefetch,
    check_block_size,
    check_pipeline,
    check_capacity,
    check_integrity,
    check_copies,
)


# -- helpers and rendering -----------------------------------------------------------------------------------
def _persistent(s: Snapshot, tier: str) -> bool:
    state = s.tier(tier)
    return state.persistent if state is not None else tier not in ("gpu", "cpu")


def _pow2_floor(x: float) -> int:
    n = 1
    while n * 2 <= x:
        n *= 2
    return n


def _size_setting(n: int) -> str:
    """A byte count as a config value, rounded up: ``3221225472 -> '3GiB'``, ``700000 -> '1MiB'``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2)):
        if n >= scale:
            return f"{-(-n // scale)}{unit}"
    return f"{n}"


def format_number(name: str, value: Number) -> str:
    """A number as the doctor prints it, its unit taken from the name's suffix."""
    if isinstance(value, str):
        return value
    if name.endswith("_bytes"):
        return format_size(value)
    if name.endswith("_s"):
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    if name.endswith("_share"):
        return f"{100 * value:.1f}%"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def render_findings(findings: list[Finding]) -> str:
    """Findings as text: ``SEVERITY  area  title``, then the numbers and the recommended change."""
    lines = []
    for f in findings:
        lines.append(f"{f.severity.upper():<5} {f.check:<10} {f.title}")
        if f.numbers:
            lines.append(" " * 17 + ", ".join(f"{k} {format_number(k, v)}" for k, v in f.numbers.items()))
        if f.recommendation:
            lines.append(" " * 17 + f"-> {f.recommendation}")
    warns = sum(f.severity == "warn" for f in findings)
    lines += [
        "",
        f"{warns} warning{'s' * (warns != 1)}, "
        f"{sum(f.severity == 'info' for f in findings)} info, {sum(f.severity == 'ok' for f in findings)} ok",
    ]
    return "\n".join(lines)
