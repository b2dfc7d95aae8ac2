"""Reusing RAG documents in any order: ``BlendCache``'s answers and TTFT against a full prefill (issue #36).

Not a test: a measurement, on the model of ``train_retrieval_lm.py`` (loaded from
``--model``; trained there first, ``--minutes`` long, when absent), on its task: four
documents of ``WORKS person company .`` and ``IN company city .`` facts, a question
``Q WHERE person`` and a two-token answer, the person's company (read in one
document) then that company's city (read in another). Entities are drawn anew per
document set, so only the documents hold the answer.

Each of ``--worlds`` document sets is stored once (every document's KV computed on
its own, at position 0, no neighbours) and asked ``--prompts`` questions, each with
its documents in a fresh random order: the orders are never the ones the KV was
computed in. The prompt is

    BOS (computed) + doc_1 + ... + doc_4 (reused) + question + answer (computed)

and the answer is scored teacher-forced: an exact match is both answer tokens the
top-1 prediction (what greedy decoding would emit), with its Wilson 95 % interval;
answer perplexity is over the two tokens. Rows: a plain full prefill (the
reference), no documents (BOS + question + answer), and ``BlendCache`` at each
``--ratios`` recompute ratio, for each ``--selections`` way of choosing the tokens:
``DEVIATION@LAYERS``, the KV deviation measured (``values`` or ``keys_values``) and over
how many layers the selection narrows (1: one selection at layer 1; more: CacheBlend's
gradual filtering). Series without a suffix use ``BlendCache``'s defaults.

TTFT: median over ``--reps`` (and ``--long-prompts`` prompts) of the time until the
question's last logits, on 4 documents of ``--long-facts`` facts (1,021 tokens each
at 255), documents in the CPU tier. No accuracy there: that many facts need more names
than the pools hold, so names repeat and a question can have several answers.

Usage (from the repository root)::

    python benchmarks/bench_blend.py                 # 50 document sets x 5 orders; trains the model when absent
    python benchmarks/bench_blend.py --quick         # a smoke run (-quick record, never rendered)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import records  # noqa: E402
import train_retrieval_lm as task  # noqa: E402  (a sibling script, not a package)
from machine import load_average  # noqa: E402

from kvmem import Memory  # noqa: E402
from kvmem.kv import BlendCache, Segment  # noqa: E402

CHANCE = 100 / (task.COMPANIES * task.CITIES)  # a uniform guess of both answer tokens, %


@dataclass
class Prompt:
    """One question: its documents in this prompt's order, the question, the answer."""

    docs: list[torch.Tensor]
    question: torch.Tensor
    answer: torch.Tensor


@dataclass
class Row:
    """One line of the table."""

    series: str
    exact: int
    prompts: int
    low: float
    high: float
    perplexity: float

    @property
    def accuracy(self) -> float:
        return 100 * self.exact / self.prompts


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``hits / n`` (95 % by default), in %."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, centre - half), 100 * min(1.0, centre + half)


def load_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """The trained model at ``args.model``; trained and saved there first when absent."""
    path = Path(args.model)
    if not (path / "config.json").exists():
        print(f"no model at {path}: training one for {args.minutes:g} min (train_retrieval_lm.py)")
        task.train_and_save(task.parse_args([f"--minutes={args.minutes}", f"--out={path}"]))
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_prompts(
    rng: random.Random, sets: int, per_set: int, facts: int, *, distinct: bool = True
) -> list[list[Prompt]]:
    """``sets`` document sets, each asked ``per_set`` questions with its documents in fresh random orders
    (``distinct``: see ``train_retrieval_lm.make_world``)."""
    out = []
    for _ in range(sets):
        world = task.make_world(rng, facts, distinct=distinct)
        docs = [torch.tensor(d) for d in world.docs]
        orders = set()
        while len(orders) < per_set:
            orders.add(tuple(rng.sample(range(task.DOCS), task.DOCS)))
        prompts = []
        for order in sorted(orders, key=lambda _: rng.random()):
            q, answer = world.question(rng.randrange(len(world.chains)))
            prompts.append(Prompt([docs[i] for i in order], torch.tensor(q), torch.tensor(answer)))
        out.append(prompts)
    return out


def segments(p: Prompt, *, with_answer: bool = True, docs: bool = True) -> list[Segment]:
    tail = torch.cat([p.question, p.answer]) if with_answer else p.question
    middle = [Segment(d) for d in p.docs] if docs else []
    return [Segment(torch.tensor([task.BOS]), reusable=False), *middle, Segment(tail, reusable=False)]


@torch.no_grad()
def full_logits(model: LlamaForCausalLM, segs: list[Segment], keep: int) -> torch.Tensor:
    return model(torch.cat([s.tokens for s in segs])[None], logits_to_keep=keep).logits


def scored(series: str, logits: list[torch.Tensor], prompts: list[Prompt]) -> Row:
    """Exact match (both answer tokens top-1) and answer perplexity of each prompt's last-3-position logits."""
    exact, nll = 0, []
    for lg, p in zip(logits, prompts):
        predicting = lg[0, :2]  # the person's position and the company's predict the answer
        exact += predicting.argmax(-1).tolist() == p.answer.tolist()
        nll.append(F.cross_entropy(predicting, p.answer, reduction="none"))
    low, high = wilson(exact, len(prompts))
    return Row(series, exact, len(prompts), low, high, math.exp(torch.cat(nll).mean().item()))


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (after one untimed call)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def store_all(bc: BlendCache, sets: list[list[Prompt]]) -> None:
    """Every document's KV computed on its own and stored once (ingestion)."""
    for prompts in sets:
        for doc in prompts[0].docs:
            seg = Segment(doc)
            if not bc.lookup([seg])[0]:
                bc.store_segment(seg)


@torch.no_grad()
def quality(model: LlamaForCausalLM, sets: list[list[Prompt]], args: argparse.Namespace) -> list[Row]:
    prompts = [p for ps in sets for p in ps]
    rows = [
        scored("no documents", [full_logits(model, segments(p, docs=False), 3) for p in prompts], prompts),
        scored("full prefill", [full_logits(model, segments(p), 3) for p in prompts], prompts),
    ]
    with tempfile.TemporaryDirectory(prefix="kvmem-blend-") as tmp, Memory(path=tmp) as memory:
        for selection in args.selections:
            bc = BlendCache(model, memory, compression="none", **selection_options(selection))
            store_all(bc, sets)
            for ratio in args.ratios:
                if selection != DEFAULT and ratio in (0.0, 1.0):
                    continue  # nothing is selected: the same as the default's row
                out = [bc.prefill(segments(p), recompute_ratio=ratio, logits_to_keep=3).logits for p in prompts]
                rows.append(scored(series_name(ratio, selection), out, prompts))
            bc.close()
    return rows


DEFAULT = "default"  # the --selections entry of BlendCache's own defaults


def selection_options(selection: str) -> dict[str, object]:
    """BlendCache options of a ``--selections`` entry: ``default`` (none), or ``DEVIATION@LAYERS``
    (``values@1``, ``keys_values@3``)."""
    if selection == DEFAULT:
        return {}
    deviation, _, layers = selection.partition("@")
    return {"deviation": deviation, "filter_layers": int(layers or 1)}


def series_name(ratio: float, selection: str) -> str:
    name = f"blend {100 * ratio:g} %"
    return name if selection == DEFAULT else f"{name} ({selection})"


@torch.no_grad()
def long_prompts(model: LlamaForCausalLM, args: argparse.Namespace) -> dict[str, float]:
    """Per series, the median TTFT (ms) on ``args.long_prompts`` prompts of 4 documents of ``args.long_facts``
    facts.

    NOTE: no accuracy: documents this long hold more facts than the pools have names, so names repeat
    (drawn with replacement) and a question can have several answers.
    """
    sets = make_prompts(random.Random(args.seed + 1), args.long_prompts, 1, args.long_facts, distinct=False)
    prompts = [ps[0] for ps in sets]
    ttft = {
        "full prefill": statistics.median(
            timed(lambda p=p: full_logits(model, segments(p, with_answer=False), 1), args.reps) for p in prompts
        )
    }
    ratio = args.long_ratio
    with tempfile.TemporaryDirectory(prefix="kvmem-blend-") as tmp, Memory(path=tmp) as memory:
        for selection in args.selections:
            bc = BlendCache(model, memory, compression="none", **selection_options(selection))
            store_all(bc, sets)
            ttft[series_name(ratio, selection)] = statistics.median(
                timed(lambda p=p, b=bc: b.prefill(segments(p, with_answer=False), recompute_ratio=ratio), args.reps)
                for p in prompts
            )
            bc.close()
    return ttft


def print_table(rows: list[Row], full: Row) -> None:
    head = f"{'series':<28}{'exact match':>12}{'95 % interval':>17}{'of full':>9}{'answer ppl':>12}"
    print(head)
    print("-" * len(head))
    for r in rows:
        share = 100 * r.exact / full.exact if full.exact else float("nan")
        print(
            f"{r.series:<28}{r.accuracy:>11.1f}%{f'{r.low:.1f}-{r.high:.1f} %':>17}{share:>8.0f}%{r.perplexity:>12.3f}"
        )


def figures(rows: list[Row], long_ttft: dict[str, float], tokens: int) -> list[dict[str, object]]:
    """The record's figures: per series, exact match (and its interval) beside the full prefill's, answer
    perplexity; on the long prompts, TTFT beside the full prefill's."""
    full = next(r for r in rows if r.series == "full prefill")
    group = f"answer quality: {full.prompts} prompts, documents in orders never stored"
    out = []
    for r in rows:
        if r is full:
            out.append(records.figure("full-em", "full prefill: exact match", "%", r.accuracy, group=group))
            out.append(records.figure("full-em-ci", "full prefill: 95 % interval", "%", [r.low, r.high], group=group))
            out.append(records.figure("full-ppl", "full prefill: answer perplexity", "", r.perplexity, group=group))
            continue
        tag = records.slug(r.series)
        share = r.exact / full.exact if full.exact else None
        out.append(
            records.figure(
                f"{tag}-em",
                f"{r.series}: exact match",
                "%",
                r.accuracy,
                records.ref("full prefill", full.accuracy, share),
                ratio="this / full prefill",
                group=group,
            )
        )
        out.append(records.figure(f"{tag}-em-ci", f"{r.series}: 95 % interval", "%", [r.low, r.high], group=group))
        out.append(
            records.figure(
                f"{tag}-ppl",
                f"{r.series}: answer perplexity",
                "",
                r.perplexity,
                records.ref("full prefill", full.perplexity, full.perplexity / r.perplexity),
                ratio="full prefill perplexity / this",
                group=group,
                decimals=3,
            )
        )
    long_group = f"{tokens}-token prompts (4 documents), documents in the CPU tier"
    full_ms = long_ttft["full prefill"]
    out.append(records.figure("long-full-prefill-ttft", "full prefill: TTFT", "ms", full_ms, group=long_group))
    for series, ms in long_ttft.items():
        if series != "full prefill":
            out.append(
                records.figure(
                    f"long-{records.slug(series)}-ttft",
                    f"{series}: TTFT",
                    "ms",
                    ms,
                    records.ref("full prefill", full_ms, full_ms / ms),
                    ratio="full prefill time / this time",
                    group=long_group,
                )
            )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="benchmarks/results/retrieval-lm", help="a saved model (trained if absent)")
    p.add_argument("--minutes", type=float, default=16.0, help="training time when --model is absent")
    p.add_argument("--worlds", type=int, default=50, help="document sets")
    p.add_argument("--prompts", type=int, default=5, help="questions per document set, each in a fresh order")
    p.add_argument("--facts", type=int, default=4, help="facts per document of the scored prompts")
    p.add_argument("--ratios", default="0,0.05,0.15,0.3,1", help="recompute ratios, comma-separated")
    p.add_argument(
        "--selections",
        default=None,
        help="BlendCache selections, comma-separated: default (BlendCache's own) or DEVIATION@LAYERS",
    )
    p.add_argument("--long-facts", type=int, default=255, help="facts per document of the TTFT prompts")
    p.add_argument("--long-prompts", type=int, default=20, help="TTFT prompts")
    p.add_argument("--long-ratio", type=float, default=0.15)
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per TTFT prompt (median)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared machine, threads that wait for each other run several times slower)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: 10 sets x 2, 3 long prompts, 2 reps")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    if args.quick:
        args.worlds, args.prompts, args.long_prompts, args.reps = 10, 2, 3, 2
    args.ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    args.selections = [s.strip() for s in (args.selections or DEFAULT).split(",") if s.strip()]
    return args


def main() -> None:
    run_record = records.start("bench_blend")
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args)
    sets = make_prompts(random.Random(args.seed), args.worlds, args.prompts, args.facts)
    doc_tokens = 1 + 4 * args.facts
    long_tokens = 1 + task.DOCS * (1 + 4 * args.long_facts) + 3  # BOS, the documents, the question
    print(
        f"{args.worlds * args.prompts} prompts: {args.worlds} document sets x {args.prompts} orders, "
        f"4 documents x {doc_tokens} tokens; chance {CHANCE:.4f} %; "
        f"{model.config.num_hidden_layers}-layer model at {args.model}; torch {torch.__version__}, "
        f"{args.threads} threads, load {load_average()}"
    )
    rows = quality(model, sets, args)
    full = rows[1]
    print_table(rows, full)
    print(f"\n{args.long_prompts} prompts of {long_tokens} tokens (4 documents x {1 + 4 * args.long_facts}):")
    long_ttft = long_prompts(model, args)
    for series, ms in long_ttft.items():
        speedup = "" if series == "full prefill" else f"  ({long_ttft['full prefill'] / ms:.2f}x faster)"
        print(f"{series:<28}TTFT {ms:8.1f} ms{speedup}")
    records.write(
        run_record,
        figures(rows, long_ttft, long_tokens),
        headline=["blend-15-em", "long-blend-15-ttft"] if DEFAULT in args.selections else [],
        machine={"torch_threads": args.threads, "model": f"{model.config.num_hidden_layers} layers at {args.model}"},
        quick=args.quick,
        data={"rows": [asdict(r) for r in rows], "long_ttft_ms": long_ttft},
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
