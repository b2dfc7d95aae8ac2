"""Agent memory: per-step time to first token of a ReAct agent's growing prompt, with and without kvmem.

Not a test: a measurement (issue 6, requirement 7). An agent session runs 20
model calls; call *n* sees the system prompt and the *n - 1* steps before it
(each a thought, an action and an observation) and ``Thought:``. Each call is
timed three ways, side by side:

==========  ============================================================================
series      what is timed (TTFT: until the last position's logits are there)
==========  ============================================================================
plain       a forward pass over the whole prompt (what an agent framework does)
kvmem       ``AgentSession.prefill()``: the chunks earlier calls stored are loaded
            (CPU tier), only the rest is computed; new chunks stored in the background
oracle      the previous call's KV kept alive in this process (a ``DynamicCache``),
            a forward pass over the new tokens only: the limit any cache can reach
==========  ============================================================================

Goal (issue 6): at step 20, kvmem's TTFT at least 5x faster than plain.

Then the same agent through LangGraph (:mod:`agent_langgraph`, the agent of
``examples/langgraph_agent.py``: ``create_agent`` over ``ChatTransformersKV``, ``KVMemSaver``,
``KVMemStore``), on the same model: per-call TTFT (start callback to first streamed token) against the
same agent whose chat model computes every prompt whole (goal, issue #35: at call 20, >= 5x, and the
same messages), and one thread of ``--thread-steps`` model calls (the example's tiny model) written to
``KVMemSaver`` and to ``langgraph-checkpoint-sqlite`` at once: the bytes each stores, the time each
takes to read its newest checkpoint (goal: <= 1/5 of the bytes, a read no slower).

Each repetition is a whole 20-call session on a fresh ``Memory`` (its own
directory), as an agent sees it: call *n*'s prefill finds what calls before it
stored, nothing else. The table shows per-step medians over repetitions; the
speed-ups are medians of per-repetition ratios. Background chunk stores are
flushed between calls, outside the timing. The three series run in rotating
order, so background load hits all of them alike. The last-position logits of
kvmem and the oracle are checked against the plain pass.

The model is a random-weight Llama built from a config (``55m``: hidden 512, 8
layers; ``250m``: hidden 1024, 16 layers, GQA), nothing downloaded. Text is
seeded random English words, one token per word (a word-hash tokenizer): a
300-token system prompt and steps of 60-150 tokens, the same in every
repetition.

Usage (from the repository root)::

    python benchmarks/bench_agent.py --threads 1             # 55m fp32, 20 steps, median of 3
    python benchmarks/bench_agent.py --quick                 # smoke run: 8 steps, one repetition, a 20-call thread
    python benchmarks/bench_agent.py --size 250m --block-size 256 --repeat 5 --json benchmarks/results/agent.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import records
import torch
from bench_ttft import DTYPES, SIZES, VOCAB, build_model
from machine import filesystem_of, load_average

try:
    import agent_langgraph
except ModuleNotFoundError as exc:  # NOTE: langchain-kvmem is a package of its own (integrations/langchain)
    raise SystemExit(
        f'bench_agent needs {exc.name}: pip install -c constraints.txt -e ".[kv,bench]" -e integrations/langchain'
    ) from None
from transformers import DynamicCache, LlamaForCausalLM

import kvmem
from kvmem import Memory
from kvmem.agent import AgentSession
from kvmem.kv.layout import cache_argument

GOAL = 5.0  # speed-up at the last step
SUFFIX = "Thought:"
SERIES = ("plain", "kvmem", "oracle")
LOGIT_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
_VOCABULARY = (
    "the order customer shipped invoice refund carrier warehouse delivery address payment card account "
    "status item price total tax discount week day date email phone support ticket issue request tracking "
    "number return label box damaged missing replace check confirm update record search result found not "
    "yet again after before since until today tomorrow morning evening late early fast slow standard "
    "express policy rule limit amount currency euro dollar pound store online app page link error code "
    "message reply wait call tool lookup calculator answer question need should will can must first then "
    "next last also because so but and or if when where which what who how many much more less each every "
    "some any none all one two three four five six seven eight nine ten hundred thousand percent"
)
WORDS = _VOCABULARY.split()


# -- text and tokens ------------------------------------------------------------------------------------------
class WordTokenizer:
    """One token per whitespace-separated word, by a hash (the random model has no vocabulary)."""

    def encode(self, text: str) -> list[int]:
        return [3 + zlib.crc32(w.encode()) % (VOCAB - 3) for w in text.split()]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_steps(seed: int, count: int) -> list[tuple[str, str, str]]:
    """``count`` (thought, action, observation) of 60-150 tokens each in all (three label tokens included)."""
    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        total = rng.randint(60, 150) - 3  # NOTE: "Thought:", "Action:", "Observation:" are a token each
        action = rng.randint(3, 8)
        thought = rng.randint(12, min(40, total - action - 10))
        steps.append((words(rng, thought), f"lookup( {words(rng, action - 2)} )", words(rng, total - action - thought)))
    return steps


# -- one session ----------------------------------------------------------------------------------------------
@dataclass
class Call:
    """One model call of one repetition."""

    prompt: int
    reused: int
    times: dict[str, float]  # seconds per series
    diff: dict[str, float]  # max |series - plain| of the last position's logits


class Runner:
    """The model's plain and oracle forward passes."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.arg = cache_argument(model)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: DynamicCache | None = None) -> tuple[torch.Tensor, DynamicCache]:
        """(last position's logits in fp32, the cache) of ``ids`` after ``cache`` (none: from scratch)."""
        cache = DynamicCache(config=self.model.config) if cache is None else cache
        out = self.model(ids.unsqueeze(0), use_cache=True, logits_to_keep=1, **{self.arg: cache})
        return out.logits[0, -1].float(), cache  # NOTE: not out.cache: 5.19's output names it past_key_values


def run_session(
    runner: Runner, root: Path, system: str, steps: Sequence[tuple[str, str, str]], block: int, first: int
) -> list[Call]:
    """One fresh session of ``len(steps) + 1`` calls (the last sees every step); series order rotates from ``first``."""
    calls: list[Call] = []
    with Memory(path=str(root), cpu_bytes=4 << 30, disk_bytes=16 << 30) as mem:
        session = AgentSession("bench", memory=mem, system_prompt=system)
        session.attach(runner.model, WordTokenizer(), block_size=block, compression="none")
        live: tuple[int, DynamicCache] | None = None  # the oracle's cache and how many tokens it holds
        for n in range(len(steps) + 1):
            ids = session.prompt_ids(SUFFIX)
            oracle_cache = copy.deepcopy(live[1]) if live else None  # NOTE: untimed; the oracle extends a copy
            times, logits, reused = {}, {}, 0
            order = SERIES[(first + n) % 3 :] + SERIES[: (first + n) % 3]
            for name in order:
                start = time.perf_counter()
                if name == "plain":
                    logits[name], _ = runner.forward(ids)
                elif name == "kvmem":
                    r = session.prefill(SUFFIX)
                    logits[name], reused = r.logits[0, -1].float(), r.reused_tokens
                else:
                    held = live[0] if live else 0
                    logits[name], oracle_cache = runner.forward(ids[held:], oracle_cache)
                times[name] = time.perf_counter() - start
                if name == "kvmem":
                    del r
                    session.flush()  # NOTE: untimed
            live = (len(ids), oracle_cache)
            calls.append(
                Call(
                    len(ids),
                    reused,
                    times,
                    {s: (logits[s] - logits["plain"]).abs().max().item() for s in ("kvmem", "oracle")},
                )
            )
            if n < len(steps):
                thought, action, observation = steps[n]
                session.append_step(thought=thought, action=action, observation=observation)
                new = session.prompt_ids(SUFFIX)
                if not torch.equal(new[: len(ids)], ids):
                    raise SystemExit("a step's prompt is not a prefix of the next one's: benchmark aborted")
        session.close()
    return calls


# -- report ---------------------------------------------------------------------------------------------------
@dataclass
class StepRow:
    step: int
    prompt: int
    reused: int
    times: dict[str, list[float]] = field(default_factory=dict)  # seconds per repetition, per series
    diff: float = 0.0  # worst max |logit diff| of kvmem and oracle against plain, over repetitions

    def median_ms(self, name: str) -> float:
        return statistics.median(self.times[name]) * 1e3

    def ratio(self, num: str, den: str) -> float:
        """Median over repetitions of ``num``'s time / ``den``'s time."""
        return statistics.median(a / b for a, b in zip(self.times[num], self.times[den]))


def collect(sessions: Sequence[Sequence[Call]]) -> list[StepRow]:
    """Per-step rows from every repetition's calls (the prompts are the same in each)."""
    rows = []
    for i, calls in enumerate(zip(*sessions)):
        if len({(c.prompt, c.reused) for c in calls}) != 1:
            raise SystemExit(f"step {i + 1}: repetitions disagree on prompt or reused tokens: benchmark aborted")
        rows.append(
            StepRow(
                i + 1,
                calls[0].prompt,
                calls[0].reused,
                {s: [c.times[s] for c in calls] for s in SERIES},
                max(max(c.diff.values()) for c in calls),
            )
        )
    return rows


def print_table(rows: Sequence[StepRow], repeat: int) -> None:
    head = (
        f"{'step':>4} {'prompt':>6} {'new':>5} {'reused':>6} {'computed':>8} {'plain ms':>9} {'kvmem ms':>9} "
        f"{'oracle ms':>9} {'speed-up':>8} {'kv/orcl':>8} {'max|dlogit|':>11}"
    )
    print(f"\nper-step TTFT, median of {repeat} (speed-up: plain / kvmem, median of per-repetition ratios)")
    print(head)
    print("-" * len(head))
    previous = 0
    for r in rows:
        print(
            f"{r.step:>4} {r.prompt:>6} {r.prompt - previous:>5} {r.reused:>6} {r.prompt - r.reused:>8} "
            f"{r.median_ms('plain'):>9.1f} {r.median_ms('kvmem'):>9.1f} {r.median_ms('oracle'):>9.1f} "
            f"{r.ratio('plain', 'kvmem'):>7.2f}x {r.ratio('kvmem', 'oracle'):>8.2f} {r.diff:>11.1e}"
        )
        previous = r.prompt


def summary(rows: Sequence[StepRow], tolerance: float) -> dict[str, float | bool]:
    last = rows[-1]
    plain = sum(r.median_ms("plain") for r in rows)
    kv = sum(r.median_ms("kvmem") for r in rows)
    speedup = last.ratio("plain", "kvmem")
    worst = max(r.diff for r in rows)
    print(
        f"\nall {len(rows)} calls: plain {plain:.0f} ms, kvmem {kv:.0f} ms in all ({plain / kv:.2f}x); "
        f"tokens reused {sum(r.reused for r in rows)} of {sum(r.prompt for r in rows)}"
    )
    print(
        f"goal: at step {last.step}, >= {GOAL:g}x faster with the cache: plain {last.median_ms('plain'):.1f} ms, "
        f"kvmem {last.median_ms('kvmem'):.1f} ms -> {speedup:.2f}x  {'PASS' if speedup >= GOAL else 'MISS'}"
        f"{'' if last.step == 20 else f'  (NOTE: {last.step} steps, not 20)'}"
    )
    print(
        f"logits: max |kvmem or oracle - plain| {worst:.1e} ({'ok' if worst <= tolerance else 'WRONG'}, "
        f"tolerance {tolerance:g})"
    )
    return {
        "speedup_last": speedup,
        "goal_met": speedup >= GOAL,
        "total_plain_ms": plain,
        "total_kvmem_ms": kv,
        "max_logit_diff": worst,
        "logits_ok": worst <= tolerance,
    }


def figures(rows: Sequence[StepRow]) -> list[dict[str, object]]:
    """The results record's figures: each call beside a plain forward and the oracle, then all calls."""
    out = []
    for r in rows:
        out.append(
            records.figure(
                f"call-{r.step}",
                f"call {r.step}: {r.prompt}-token prompt, {r.reused} reused",
                "ms",
                r.median_ms("kvmem"),
                records.ref("plain forward", r.median_ms("plain"), r.ratio("plain", "kvmem")),
                records.ref(
                    "oracle (previous cache kept)",
                    r.median_ms("oracle"),
                    r.ratio("kvmem", "oracle"),
                    ratio_is="kvmem / oracle",
                ),
                ratio="plain time / kvmem time, median of per-session ratios",
                group="per call (TTFT)",
            )
        )
    plain, kv = sum(r.median_ms("plain") for r in rows), sum(r.median_ms("kvmem") for r in rows)
    out.append(
        records.figure(
            "all-calls",
            f"all {len(rows)} calls",
            "ms",
            kv,
            records.ref("plain forward", plain, plain / kv),
            ratio="plain time / kvmem time",
            group="the whole session",
        )
    )
    return out


# -- main -----------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="55m", help="model size (default 55m)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="model dtype (default fp32)")
    p.add_argument("--steps", type=int, default=None, help="model calls per session (default 20; 8 with --quick)")
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="sessions, each on a fresh Memory (default 3; 1 with --quick); the table shows medians",
    )
    p.add_argument("--system", type=int, default=300, help="system prompt tokens (default 300)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per KV chunk (default 64)")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 calls, one repetition")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: every core)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="scratch directory (default: a temporary directory under the current directory)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the text")
    p.add_argument(
        "--thread-steps", type=int, default=None, help="model calls of the weighed thread (default 50; 20 with --quick)"
    )
    p.add_argument("--reads", type=int, default=20, help="newest-checkpoint reads per saver (default 20)")
    p.add_argument("--json", type=Path, default=None, help="also write every raw time as JSON to this file")
    args = p.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 20)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.thread_steps = args.thread_steps or (20 if args.quick else 50)
    if args.steps < 2 or args.block_size < 1 or args.system < 1:
        p.error("--steps must be at least 2, --block-size and --system at least 1")
    return args


def measure(
    args: argparse.Namespace, root: Path, model: LlamaForCausalLM, progress: Callable[[str], None]
) -> list[StepRow]:
    rng = random.Random(args.seed)
    system = words(rng, args.system - 1)  # NOTE: the session adds a blank line, no token; "Thought:" is one
    steps = make_steps(args.seed + 1, args.steps - 1)
    runner = Runner(model)
    run_session(runner, root / "warm-up", system, steps[:1], args.block_size, 0)  # NOTE: first calls are slow
    sessions = []
    for rep in range(args.repeat):
        progress(f"  repetition {rep + 1}/{args.repeat} ... (load average {load_average()})")
        sessions.append(run_session(runner, root / f"rep{rep}", system, steps, args.block_size, rep))
        shutil.rmtree(root / f"rep{rep}", ignore_errors=True)
    return collect(sessions)


def main(argv: Sequence[str] | None = None) -> dict[str, float | bool]:
    run = records.start("bench_agent", argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    parent = args.dir or Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvmem-agent-", dir=parent))
    started, load_start = time.perf_counter(), load_average()
    model = build_model(args.size, DTYPES[args.dtype], 8192)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"kvmem {kvmem.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; scratch {root} on {filesystem_of(root)}; "
        f"load average {load_start}"
    )
    print(
        f"{args.size} random Llama ({params / 1e6:.1f}M params), {args.dtype}; {args.steps} calls per session, "
        f"a {args.system}-token system prompt, steps of 60-150 tokens, {args.block_size}-token chunks, CPU tier"
    )
    try:
        rows = measure(args, root, model, lambda line: print(line, flush=True))
        graph = agent_langgraph.measure(
            model,
            root,
            args.steps,
            args.repeat,
            args.block_size,
            args.thread_steps,
            args.reads,
            lambda line: print(line, flush=True),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows, args.repeat)
    result = summary(rows, LOGIT_TOLERANCE[args.dtype])
    result.update(agent_langgraph.report(graph))
    print(
        f"\n{time.perf_counter() - started:.0f} s in all; load average {load_start} at start, {load_average()} at end"
    )
    records.write(
        run,
        figures(rows) + agent_langgraph.figures(graph),
        headline=[
            f"call-{rows[-1].step}",
            "all-calls",
            f"langgraph-call-{args.steps}",
            f"langgraph-row-bytes-{args.thread_steps}",
            "langgraph-read-latest",
        ],
        machine={"torch_threads": torch.get_num_threads(), "model": f"{args.size} {args.dtype}"},
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
                        "platform": platform.platform(),
                        "load_average_start": load_start,
                        "load_average_end": load_average(),
                    },
                    "size": args.size,
                    "dtype": args.dtype,
                    "params": params,
                    "block_size": args.block_size,
                    "system_tokens": args.system,
                    "repeat": args.repeat,
                    "goal": GOAL,
                    "summary": result,
                    "steps": [
                        {
                            "step": r.step,
                            "prompt": r.prompt,
                            "reused": r.reused,
                            "times_s": r.times,
                            "median_ms": {s: r.median_ms(s) for s in SERIES},
                            "speedup": r.ratio("plain", "kvmem"),
                            "kvmem_over_oracle": r.ratio("kvmem", "oracle"),
                            "max_logit_diff": r.diff,
                        }
                        for r in rows
                    ],
                },
                indent=2,
            )
        )
        print(f"results written to {args.json}")
    return result


if __name__ == "__main__":
    main()
