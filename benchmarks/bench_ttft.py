"""Time to first token with kvmem's prefix cache, side by side with the plain way and the physical limit.

Not a test: a measurement. For each model size, dtype and prompt length, one
run times the same prefill done seven ways and reports medians and ratios:

==================  ==============================================================================
series              what is timed (TTFT: until the last position's logits are there)
==================  ==============================================================================
full                a plain forward pass over prefix + suffix (cache kept, ``logits_to_keep=1``)
oracle              the prefix's ``DynamicCache`` already in memory, a forward pass of the suffix
                    only: the limit any prefix cache can reach
kvmem CPU           ``PrefixCache.prefill(prefix + suffix)``, the prefix's chunks in the CPU tier
disk layer-wise     the same from a disk-only Memory (``cpu_bytes=0``), page cache dropped before
                    each repetition, layers streaming in behind the forward pass (default)
disk load-all       the same with ``layerwise=False``: every chunk loaded before the forward pass
miss                ``PrefixCache.prefill`` of a never-seen prompt (new chunks stored afterwards, in
                    the background)
plain               a plain forward pass of a never-seen prompt of the same length
==================  ==============================================================================

Targets (issue 3): kvmem/oracle <= 1.05 from the CPU tier, <= 1.15 from a cold
disk (layer-wise), miss-path overhead <= 2 %. ``full/oracle`` is the most any
prefix cache can gain; ``full/kvmem`` is what kvmem gains.

The model is a random-weight Llama built from a config (nothing is downloaded):
``55m`` (hidden 512, 8 layers, 8 heads = 8 KV heads, vocab 32000) and ``250m``
(hidden 1024, 16 layers, 16 heads, 4 KV heads: GQA). Prompts are random token
ids (fixed seed): a prefix of each ``--lengths`` followed by a fresh 256-token
suffix. Chunks are stored lossless (``compression="none"``) in the model's dtype.

Usage (from the repository root)::

    python benchmarks/bench_ttft.py --quick                     # smoke run, ~1-2 min on 2 cores
    python benchmarks/bench_ttft.py --dir /data/scratch         # 55m fp32, 1k/2k/4k, median of 3
    python benchmarks/bench_ttft.py --sizes 55m,250m --dtypes fp32,bf16 --lengths 1024,2048,4096,8192 \\
        --json benchmarks/results/ttft.json --plot benchmarks/results/ttft.png

Every series runs once per repetition, in alternating order (reversed on odd
repetitions), so background load hits all of them alike; ratios are medians of
per-repetition ratios. Every timed prefill gets a suffix of its own, so a chunk
stored by one call is never a hit for the next. Background chunk stores are
flushed between calls, outside the timing: TTFT is when ``prefill`` returns.
Put ``--dir`` on the disk you mean to measure (tmpfs makes the disk rows measure
RAM; the script warns). Also run: a multi-round QA workload (users x rounds,
a shared system prompt, one document per user, one question appended per
round) reporting the token hit rate and mean TTFT with and without kvmem.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import records
import torch
from machine import drop_page_cache, filesystem_of, load_average
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvmem
from kvmem import Memory
from kvmem.kv import PrefixCache
from kvmem.kv.layout import cache_argument

SIZES: dict[str, dict[str, int]] = {
    "55m": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1152
    ),
    "250m": dict(
        hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOGIT_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}  # max |kvmem - full| of the last position's logits
VOCAB = 32000
SUFFIX = 256
BLOCK = 256
TARGETS = {"cpu": 1.05, "disk": 1.15, "miss": 0.02}
SERIES = ("full", "oracle", "kvmem_cpu", "disk_layerwise", "disk_load_all", "miss", "plain")
LABELS = {
    "full": "full",
    "oracle": "oracle",
    "kvmem_cpu": "kvmem CPU",
    "disk_layerwise": "disk lw",
    "disk_load_all": "disk all",
    "miss": "miss",
    "plain": "plain",
}
CHECKED = ("oracle", "kvmem_cpu", "disk_layerwise")  # compared with ``full`` on the same prompt (repetition 0)
FULL_LENGTH = ("full", "miss", "plain")  # series that run the model over the whole prompt


# -- model and prompts -------------------------------------------------------------------
def build_model(size: str, dtype: torch.dtype, max_tokens: int) -> LlamaForCausalLM:
    """A random-weight Llama of ``size`` (seeded), in ``dtype``, in eval mode."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=max(max_tokens, 2048), tie_word_embeddings=False, **SIZES[size]
    )
    return LlamaForCausalLM(config).to(dtype).eval()


class Tokens:
    """Random token ids from one seeded generator: every call gives new ids, the sequence is fixed."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (1, n), generator=self.gen)


# -- what is timed --------------------------------------------------------------------------
class Forward:
    """Plain forward passes of a model, as serving without kvmem runs them."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.arg = cache_argument(model)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        """Last position's logits (fp32) of ``ids`` after ``cache`` (none: from scratch)."""
        extra = {self.arg: cache} if cache is not None else {}
        out = self.model(ids, use_cache=True, logits_to_keep=1, **extra)
        return out.logits[0, -1].float()

    @torch.no_grad()
    def cache_of(self, ids: torch.Tensor) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)  # NOTE: passed in: the output names it per version
        self.model(ids, use_cache=True, logits_to_keep=1, **{self.arg: cache})
        return cache


def prefill(pc: PrefixCache, ids: torch.Tensor, expect_reused: int | None = None) -> torch.Tensor:
    """``pc.prefill`` as a server calls it; the last position's logits (fp32)."""
    r = pc.prefill(ids, logits_to_keep=1)
    if expect_reused is not None and r.reused_tokens != expect_reused:
        raise SystemExit(f"kvmem reused {r.reused_tokens} tokens, expected {expect_reused}: benchmark aborted")
    return r.logits[0, -1].float()


def drop_chunk_files(root: Path) -> None:
    """Evict every chunk file under ``root/disk/blobs`` from the page cache (synced first: only clean pages go)."""
    os.sync()
    drop_page_cache((root / "disk" / "blobs").rglob("*.kvb"))


@dataclass
class Series:
    """One way of getting the first token.

    ``prepare(rep)`` (untimed; ``rep`` -1 is the warm-up) returns the arguments of
    ``run``; ``after`` (untimed) runs once ``run`` has returned.
    """

    name: str
    prepare: Callable[[int], tuple[Any, ...]]
    run: Callable[..., torch.Tensor]
    after: Callable[[], None] = lambda: None
    times: list[float] = field(default_factory=list)


def time_series(series: Sequence[Series], repeat: int, warm: set[str]) -> dict[str, torch.Tensor]:
    """Run every series ``repeat`` times in alternating order; the logits each gave in repetition 0.

    Args:
        warm: series given one untimed warm-up call first.
    """
    for s in series:
        if s.name in warm:
            s.run(*s.prepare(-1))
            s.after()
    first: dict[str, torch.Tensor] = {}
    for rep in range(repeat):
        for s in series if rep % 2 == 0 else list(reversed(series)):
            args = s.prepare(rep)
            start = time.perf_counter()
            logits = s.run(*args)
            s.times.append(time.perf_counter() - start)
            del args
            s.after()
            if rep == 0:
                first[s.name] = logits
    return first


# -- one (size, dtype, length) -------------------------------------------------------------
@dataclass
class Result:
    size: str
    dtype: str
    params: int
    prefix: int
    times: dict[str, list[float]]  # seconds per repetition, per series
    logit_diff: dict[str, float]  # max |series - full| of the last position's logits, same prompt

    def median_ms(self, name: str) -> float:
        return statistics.median(self.times[name]) * 1e3

    def ratio(self, num: str, den: str) -> float:
        """Median over repetitions of ``num``'s time / ``den``'s time (runs of one repetition)."""
        return statistics.median(a / b for a, b in zip(self.times[num], self.times[den]))

    def best_ratio(self, num: str, den: str) -> float:
        """Fastest ``num`` / fastest ``den``: the least disturbed runs of each.

        NOTE: interference from other threads and processes only ever adds time, so on a
        shared machine this is the second opinion to read beside the median ratio.
        """
        return min(self.times[num]) / min(self.times[den])

    def ratios(self) -> dict[str, float]:
        return {
            "kvmem_cpu/oracle": self.ratio("kvmem_cpu", "oracle"),
            "disk_layerwise/oracle": self.ratio("disk_layerwise", "oracle"),
            "disk_load_all/oracle": self.ratio("disk_load_all", "oracle"),
            "full/kvmem_cpu": self.ratio("full", "kvmem_cpu"),
            "full/disk_layerwise": self.ratio("full", "disk_layerwise"),
            "full/oracle": self.ratio("full", "oracle"),
            "disk_load_all/disk_layerwise": self.ratio("disk_load_all", "disk_layerwise"),
            "miss_overhead": self.ratio("miss", "plain") - 1,
            "best:kvmem_cpu/oracle": self.best_ratio("kvmem_cpu", "oracle"),
            "best:disk_layerwise/oracle": self.best_ratio("disk_layerwise", "oracle"),
            "best:miss_overhead": self.best_ratio("miss", "plain") - 1,
        }


class Bench:
    """The memories and prefix caches of one model, shared by its prompt lengths."""

    def __init__(self, root: Path, model: LlamaForCausalLM, label: str) -> None:
        self.model = model
        self.forward = Forward(model)
        kw = dict(block_size=BLOCK, compression="none")
        base = root / label
        self.cpu_mem = Memory(path=str(base / "cpu"), cpu_bytes=8 << 30, disk_bytes=0)
        self.disk_root = base / "disk-only"
        self.disk_mem = Memory(path=str(self.disk_root), cpu_bytes=0, disk_bytes=64 << 30)
        self.miss_mem = Memory(path=str(base / "miss"), cpu_bytes=4 << 30, disk_bytes=64 << 30)
        self.cpu = PrefixCache(model, self.cpu_mem, **kw)
        self.disk_lw = PrefixCache(model, self.disk_mem, layerwise=True, **kw)
        self.disk_all = PrefixCache(model, self.disk_mem, layerwise=False, **kw)
        self.miss = PrefixCache(model, self.miss_mem, **kw)

    def close(self) -> None:
        for pc in (self.cpu, self.disk_lw, self.disk_all, self.miss):
            pc.close()
        for mem in (self.cpu_mem, self.disk_mem, self.miss_mem):
            mem.close()

    def measure(self, size: str, dtype: str, prefix_len: int, repeat: int, warm_full: bool) -> Result:
        """Every series for one prefix length (its chunks stored first, as a previous request would have)."""
        tokens = Tokens(prefix_len)
        prefix = tokens(prefix_len)
        check = tokens(SUFFIX)  # the suffix of repetition 0 of the checked series and of ``full``
        oracle_cache = self.forward.cache_of(prefix)
        self.cpu.store(prefix, oracle_cache)
        self.disk_lw.store(prefix, oracle_cache)
        self.disk_mem.flush()

        def prompt(name: str, rep: int) -> torch.Tensor:
            suffix = check if rep == 0 and name in ("full",) + CHECKED else tokens(SUFFIX)
            return torch.cat([prefix, suffix], dim=1)

        def flushing(pc: PrefixCache) -> Callable[[], None]:
            return lambda: (pc.flush(), pc.memory.flush())

        def cold(name: str) -> Callable[[int], tuple[Any, ...]]:
            def prep(rep: int) -> tuple[Any, ...]:
                ids = prompt(name, rep)
                drop_chunk_files(self.disk_root)
                return (ids,)

            return prep

        series = [
            Series("full", lambda rep: (prompt("full", rep),), self.forward),
            Series(
                "oracle", lambda rep: (prompt("oracle", rep)[:, prefix_len:], copy.deepcopy(oracle_cache)), self.forward
            ),
            Series(
                "kvmem_cpu", lambda rep: (self.cpu, prompt("kvmem_cpu", rep), prefix_len), prefill, flushing(self.cpu)
            ),
            Series(
                "disk_layerwise",
                lambda rep: (self.disk_lw,) + cold("disk_layerwise")(rep) + (prefix_len,),
                prefill,
                flushing(self.disk_lw),
            ),
            Series(
                "disk_load_all",
                lambda rep: (self.disk_all,) + cold("disk_load_all")(rep) + (prefix_len,),
                prefill,
                flushing(self.disk_all),
            ),
            Series("miss", lambda rep: (self.miss, tokens(prefix_len + SUFFIX), 0), prefill, flushing(self.miss)),
            Series("plain", lambda rep: (tokens(prefix_len + SUFFIX),), self.forward),
        ]
        warm = {"oracle", "kvmem_cpu", "disk_layerwise", "disk_load_all"} | (set(FULL_LENGTH) if warm_full else set())
        first = time_series(series, repeat, warm)
        diff = {name: (first[name] - first["full"]).abs().max().item() for name in CHECKED}
        params = sum(p.numel() for p in self.model.parameters())
        return Result(size, dtype, params, prefix_len, {s.name: s.times for s in series}, diff)


# -- multi-round QA ---------------------------------------------------------------------------
@dataclass
class QAResult:
    users: int
    rounds: int
    system: int
    document: int
    question: int
    requested: int
    reused: int
    kvmem_times: list[float]
    plain_times: list[float]
    max_logit_diff: float

    @property
    def hit_rate(self) -> float:
        return self.reused / self.requested


def run_qa(
    root: Path, model: LlamaForCausalLM, users: int, rounds: int, system_len: int, doc_len: int, question_len: int
) -> QAResult:
    """Users x rounds of prefill over a shared system prompt, a document per user and a growing list of questions.

    Requests go round by round (every user's round 1, then round 2, ...); each is
    timed with kvmem (CPU + disk tiers) and as a plain forward pass, in
    alternating order. Background stores are flushed between requests, untimed.
    """
    tokens = Tokens(12345)
    system = tokens(system_len)
    history = [torch.cat([system, tokens(doc_len)], dim=1) for _ in range(users)]
    forward = Forward(model)
    mem = Memory(path=str(root / "qa"), cpu_bytes=4 << 30, disk_bytes=64 << 30)
    pc = PrefixCache(model, mem, block_size=BLOCK, compression="none")
    kv_t, plain_t, requested, reused, worst = [], [], 0, 0, 0.0
    try:
        n = 0
        for _round in range(rounds):
            for u in range(users):
                history[u] = torch.cat([history[u], tokens(question_len)], dim=1)
                ids = history[u]
                for which in (0, 1) if n % 2 == 0 else (1, 0):
                    start = time.perf_counter()
                    if which == 0:
                        r = pc.prefill(ids, logits_to_keep=1)
                        kv_t.append(time.perf_counter() - start)
                        kv_logits = r.logits[0, -1].float()
                        requested, reused = requested + ids.shape[1], reused + r.reused_tokens
                        del r
                        pc.flush()
                    else:
                        plain_logits = forward(ids)
                        plain_t.append(time.perf_counter() - start)
                worst = max(worst, (kv_logits - plain_logits).abs().max().item())
                n += 1
    finally:
        pc.close()
        mem.close()
    return QAResult(users, rounds, system_len, doc_len, question_len, requested, reused, kv_t, plain_t, worst)


# -- report ------------------------------------------------------------------------------------
def verdict(value: float, target: float) -> str:
    return "PASS" if value <= target else "MISS"


def print_config(results: Sequence[Result], tolerance: float) -> None:
    """TTFT medians and ratios of one (size, dtype), one row per prompt length."""
    r0 = results[0]
    print(
        f"\n== {r0.size} ({r0.params / 1e6:.1f}M params), {r0.dtype}; prefix + {SUFFIX}-token suffix; "
        f"median of {len(r0.times['full'])} ==\n"
    )
    head = f"{'prompt':>12} " + " ".join(f"{LABELS[s]:>10}" for s in SERIES)
    print("TTFT (ms)")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r.prefix:>6}+{SUFFIX:<5} " + " ".join(f"{r.median_ms(s):>10.1f}" for s in SERIES))
    cols = [
        ("kvmem_cpu/oracle", "cpu/orcl", TARGETS["cpu"]),
        ("disk_layerwise/oracle", "lw/orcl", TARGETS["disk"]),
        ("disk_load_all/oracle", "all/orcl", None),
        ("full/kvmem_cpu", "full/cpu", None),
        ("full/disk_layerwise", "full/lw", None),
        ("full/oracle", "full/orcl", None),
        ("disk_load_all/disk_layerwise", "all/lw", None),
    ]
    head = f"{'prompt':>12} " + " ".join(f"{c[1]:>9}" for c in cols) + f" {'miss ovh':>9}  {'max|dlogit|':>11}  result"
    print(
        f"\nratios (median of per-repetition ratios); targets: cpu/orcl <= {TARGETS['cpu']}, "
        f"lw/orcl <= {TARGETS['disk']}, miss overhead <= {TARGETS['miss']:.0%}, |dlogit| <= {tolerance:g}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        rat = r.ratios()
        checks = [
            verdict(rat["kvmem_cpu/oracle"], TARGETS["cpu"]),
            verdict(rat["disk_layerwise/oracle"], TARGETS["disk"]),
            verdict(rat["miss_overhead"], TARGETS["miss"]),
            "ok" if max(r.logit_diff["kvmem_cpu"], r.logit_diff["disk_layerwise"]) <= tolerance else "WRONG",
        ]
        diff = max(r.logit_diff["kvmem_cpu"], r.logit_diff["disk_layerwise"])
        print(
            f"{r.prefix:>6}+{SUFFIX:<5} "
            + " ".join(f"{rat[c[0]]:>9.3f}" for c in cols)
            + f" {rat['miss_overhead']:>+9.1%}  {diff:>11.2e}  {' '.join(checks)}"
        )
    print(
        "best runs (fastest / fastest): "
        + "; ".join(
            f"{r.prefix}: cpu/orcl {r.best_ratio('kvmem_cpu', 'oracle'):.3f}, lw/orcl "
            f"{r.best_ratio('disk_layerwise', 'oracle'):.3f}, miss ovh {r.best_ratio('miss', 'plain') - 1:+.1%}"
            for r in results
        )
    )
    print(
        "\nmax |logit - full| (last position, same prompt): "
        + "; ".join(
            f"{r.prefix}: oracle {r.logit_diff['oracle']:.1e}, kvmem CPU {r.logit_diff['kvmem_cpu']:.1e}, "
            f"disk {r.logit_diff['disk_layerwise']:.1e}"
            for r in results
        )
    )


def print_qa(qa: QAResult, label: str) -> None:
    kv, plain = statistics.mean(qa.kvmem_times), statistics.mean(qa.plain_times)
    print(
        f"\n== multi-round QA, {label}: {qa.users} users x {qa.rounds} rounds; shared {qa.system}-token system "
        f"prompt, a {qa.document}-token document per user, +{qa.question} tokens of question per round =="
    )
    print(f"tokens requested {qa.requested}, reused {qa.reused}: hit rate {qa.hit_rate:.1%}")
    print(
        f"mean TTFT: plain {plain * 1e3:.1f} ms, kvmem {kv * 1e3:.1f} ms -> {plain / kv:.2f}x; "
        f"max |logit diff| {qa.max_logit_diff:.1e}"
    )
    per_round = [statistics.mean(qa.kvmem_times[i * qa.users : (i + 1) * qa.users]) for i in range(qa.rounds)]
    per_plain = [statistics.mean(qa.plain_times[i * qa.users : (i + 1) * qa.users]) for i in range(qa.rounds)]
    print(
        "per round (mean ms, plain -> kvmem): "
        + ", ".join(f"{i + 1}: {p * 1e3:.0f} -> {k * 1e3:.0f}" for i, (p, k) in enumerate(zip(per_plain, per_round)))
    )


def plot(results: Sequence[Result], path: Path, threads: int) -> None:
    """TTFT against prompt length, one panel per (size, dtype), one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.size, r.dtype), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(6.0 * len(groups), 4.3), squeeze=False)
    shown = {
        "full": ("full prefill", "o-"),
        "oracle": ("oracle (prefix cache in memory)", "k--"),
        "kvmem_cpu": ("kvmem, CPU tier", "s-"),
        "disk_layerwise": ("kvmem, cold disk (layer-wise)", "^-"),
    }
    for ax, ((_size, dtype), rs) in zip(axes[0], groups.items()):
        rs = sorted(rs, key=lambda r: r.prefix)
        x = [r.prefix + SUFFIX for r in rs]
        for name, (label, style) in shown.items():
            ax.plot(x, [r.median_ms(name) for r in rs], style, label=label)
        ms = [r.median_ms(n) for r in rs for n in shown]
        if max(ms) / min(ms) > 8:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v}" for v in x])
        ax.minorticks_off()
        ax.set_xlabel(f"prompt tokens (last {SUFFIX} new)")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title(
            f"TTFT, random-weight Llama {rs[0].params / 1e6:.0f}M params, {dtype}, {threads} CPU threads", fontsize=10
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(results: Sequence[Result], qa: QAResult | None) -> list[dict[str, object]]:
    """The results record's figures: each kvmem series beside the full prefill and the oracle, the miss path
    beside a plain forward, and the multi-round QA."""
    speed = "reference time / kvmem time (median TTFT)"
    out = []
    for r in results:
        group = f"{r.size} ({r.params / 1e6:.0f}M params) {r.dtype}, prefix + {SUFFIX} new tokens"
        tag = f"{r.size}-{r.dtype}-{r.prefix}"
        full = records.ref("full prefill", r.median_ms("full"), r.median_ms("full") / r.median_ms("kvmem_cpu"))
        for series, what in (
            ("kvmem_cpu", "CPU tier"),
            ("disk_layerwise", "cold disk, layer-wise"),
            ("disk_load_all", "cold disk, load-all"),
        ):
            out.append(
                records.figure(
                    f"{tag}-{series}",
                    f"TTFT, {r.prefix} + {SUFFIX} tokens, {what}",
                    "ms",
                    r.median_ms(series),
                    records.ref("full prefill", r.median_ms("full"), r.median_ms("full") / r.median_ms(series))
                    if series != "kvmem_cpu"
                    else full,
                    records.ref(
                        "oracle (cache in memory)",
                        r.median_ms("oracle"),
                        r.ratio(series, "oracle"),
                        ratio_is="kvmem / oracle, median of per-repetition ratios (target <= "
                        f"{TARGETS['cpu' if series == 'kvmem_cpu' else 'disk']})",
                    ),
                    ratio=speed,
                    group=group,
                )
            )
        out.append(
            records.figure(
                f"{tag}-miss",
                f"TTFT, {r.prefix} + {SUFFIX} tokens, miss (never-seen prompt)",
                "ms",
                r.median_ms("miss"),
                records.ref("plain forward", r.median_ms("plain"), r.ratio("plain", "miss")),
                ratio=speed,
                group=group,
            )
        )
    if qa is not None:
        kv, plain = statistics.mean(qa.kvmem_times) * 1e3, statistics.mean(qa.plain_times) * 1e3
        group = f"multi-round QA: {qa.users} users x {qa.rounds} rounds over a shared {qa.system}-token system prompt"
        out.append(
            records.figure(
                "qa-ttft",
                "mean TTFT",
                "ms",
                kv,
                records.ref("plain forward", plain, plain / kv),
                ratio=speed,
                group=group,
            )
        )
        out.append(records.figure("qa-reused", "prompt tokens reused", "%", 100 * qa.hit_rate, group=group))
    return out


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help=f"model sizes, comma-separated, of {','.join(SIZES)} (default 55m)")
    p.add_argument("--dtypes", default=None, help="fp32 and/or bf16, comma-separated (default fp32)")
    p.add_argument(
        "--lengths", default=None, help="prefix lengths in tokens, multiples of 256 (default 1024,2048,4096)"
    )
    p.add_argument("--repeat", type=int, default=None, help="repetitions per series (default 3; 2 with --quick)")
    p.add_argument("--users", type=int, default=None, help="QA users (default 4; 2 with --quick; 0: no QA run)")
    p.add_argument("--rounds", type=int, default=None, help="QA rounds per user (default 3; 2 with --quick)")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 55m fp32, prefixes 1024 and 2048, repeat 2, small QA"
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: every core)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="scratch directory on the disk to measure (default: a temporary directory under the current "
        "directory; avoid tmpfs)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write every raw time as JSON to this file")
    p.add_argument("--plot", type=Path, default=Path("benchmarks/ttft.png"), help="PNG plot (default %(default)s)")
    args = p.parse_args(argv)
    args.sizes = (args.sizes or "55m").split(",")
    args.dtypes = (args.dtypes or "fp32").split(",")
    args.lengths = [int(n) for n in (args.lengths or ("1024,2048" if args.quick else "1024,2048,4096")).split(",")]
    args.repeat = args.repeat or (2 if args.quick else 3)
    args.users = args.users if args.users is not None else (2 if args.quick else 4)
    args.rounds = args.rounds or (2 if args.quick else 3)
    for name in args.sizes:
        if name not in SIZES:
            p.error(f"--sizes: {name!r}; accepted {', '.join(SIZES)}")
    for name in args.dtypes:
        if name not in DTYPES:
            p.error(f"--dtypes: {name!r}; accepted {', '.join(DTYPES)}")
    for n in args.lengths:
        if n <= 0 or n % BLOCK:
            p.error(f"--lengths: {n}; accepted positive multiples of {BLOCK}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run = records.start("bench_ttft", argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    parent = args.dir or Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvmem-ttft-", dir=parent))
    fs = filesystem_of(root)
    started = time.perf_counter()
    load_start = load_average()
    print(
        f"kvmem {kvmem.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; scratch {root} on {fs}; "
        f"load average {load_start}"
    )
    if fs.startswith(("tmpfs", "ramfs")):
        print("WARNING: the scratch directory is in memory; disk rows measure RAM. Pass --dir on a real disk.")
    results: list[Result] = []
    qa: QAResult | None = None
    try:
        for size in args.sizes:
            for dtype in args.dtypes:
                model = build_model(size, DTYPES[dtype], max(args.lengths) + SUFFIX)
                bench = Bench(root, model, f"{size}-{dtype}")
                try:
                    done = []
                    for i, n in enumerate(sorted(args.lengths)):
                        print(f"  {size} {dtype} prefix {n}: measuring ... (load average {load_average()})", flush=True)
                        done.append(bench.measure(size, dtype, n, args.repeat, warm_full=i == 0))
                finally:
                    bench.close()
                results += done
                print_config(done, LOGIT_TOLERANCE[dtype])
                if qa is None and args.users:
                    qa = run_qa(
                        root,
                        model,
                        args.users,
                        args.rounds,
                        1024 if not args.quick else 512,
                        512 if not args.quick else 256,
                        64,
                    )
                    print_qa(qa, f"{size} {dtype}")
                del model
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # NOTE: after a run of minutes the tables above are the result: no traceback for a missing plotting library
    if importlib.util.find_spec("matplotlib") is None:
        plotted = "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    else:
        plot(results, args.plot, torch.get_num_threads())
        plotted = f"plot written to {args.plot}"
    elapsed = time.perf_counter() - started
    print(f"\n{plotted}; {elapsed:.0f} s in all; load average {load_start} at start, {load_average()} at end")
    figs = figures(results, qa)
    longest = max(results, key=lambda r: r.prefix) if results else None
    records.write(
        run,
        figs,
        headline=[f"{longest.size}-{longest.dtype}-{longest.prefix}-kvmem_cpu"] if longest else [],
        machine={"filesystem": fs, "torch_threads": torch.get_num_threads()},
        quick=args.quick,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "machine": {
                        "cpus": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(),
                        "filesystem": fs,
                        "platform": platform.platform(),
                        "load_average_start": load_start,
                        "load_average_end": load_average(),
                    },
                    "repeat": args.repeat,
                    "suffix": SUFFIX,
                    "block_size": BLOCK,
                    "targets": TARGETS,
                    "results": [
                        {
                            "size": r.size,
                            "dtype": r.dtype,
                            "params": r.params,
                            "prefix": r.prefix,
                            "times_s": r.times,
                            "median_ms": {s: r.median_ms(s) for s in SERIES},
                            "ratios": r.ratios(),
                            "max_logit_diff_vs_full": r.logit_diff,
                        }
                        for r in results
                    ],
                    "qa": None if qa is None else {**{k: v for k, v in vars(qa).items()}, "hit_rate": qa.hit_rate},
                },
                indent=2,
            )
        )
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
