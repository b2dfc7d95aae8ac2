"""Reusing RAG documents in any order: ``BlendCache`` quality and TTFT against a full prefill (issue 19).

Not a test: a measurement, on the trained byte-level Llama of ``train_tiny_lm.py``
(loaded from ``--model``; trained there first, ``--minutes`` long, when absent).

The task is retrieval with answers that depend on the documents: each trial draws
``--docs`` held-out source windows of ``--doc-len`` bytes (from a pool of
``2 x --docs``, so the same documents recur in other orders and neighbours), picks
one of them and a spot in it, and asks for the text there: the prompt is

    system (computed) + doc_1 + ... + doc_n (reused) + cue (computed)

where the cue is the ``--cue`` bytes before the spot, and the answer is the
``--answer`` bytes after it (teacher-forced, scored). A model that reads the
documents copies the answer; one that does not guesses. The "no documents" row
(system + cue + answer alone) shows how much the documents are worth.

Rows: a plain full prefill (the reference), no documents, and ``BlendCache`` at each
``--ratios`` recompute ratio with every document's KV in the CPU tier (stored once,
computed alone at position 0). Columns: answer perplexity (bytes) and its change
against the full prefill, top-1 agreement with the full prefill on the answer
tokens, and TTFT: median over ``--reps`` of the time until the cue's last logits
(``logits_to_keep=1``, the answer not in the prompt), and full/blend.

Usage (from the repository root)::

    python benchmarks/bench_blend.py                       # 16 trials, 4 x 1024-byte documents
    python benchmarks/bench_blend.py --trials 4 --reps 3   # a quicker look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import records  # noqa: E402
import train_tiny_lm as tiny  # noqa: E402  (a sibling script, not a package)
from machine import load_average  # noqa: E402

from kvmem import Memory  # noqa: E402
from kvmem.kv import BlendCache, Segment  # noqa: E402

SYSTEM = b"# Answer from the files below.\n"


@dataclass
class Trial:
    """One prompt: the documents in their order, the cue, the answer."""

    docs: list[torch.Tensor]
    cue: torch.Tensor
    answer: torch.Tensor


@dataclass
class Row:
    """One line of the table."""

    series: str
    perplexity: float
    delta_pct: float
    top1_agree: float
    ttft_ms: float
    speedup: float


def load_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """The trained tiny LM at ``args.model``; trained and saved there first when absent."""
    path = Path(args.model)
    if not (path / "config.json").exists():
        print(f"no model at {path}: training one for {args.minutes:g} min (train_tiny_lm.py)")
        train_ids, _, _ = tiny.load_corpus(20)
        model = tiny.build_model(max(2048, args.train_len), args.layers)
        settings = {"minutes": args.minutes, "lr": 2e-3, "seed": 0, "seq_len": args.train_len, "batch": 1}
        settings["layers"] = args.layers
        tiny.train(model, train_ids, argparse.Namespace(**settings))
        model.save_pretrained(path)
        (path / "training.json").write_text(json.dumps(settings, indent=1))
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_trials(args: argparse.Namespace) -> list[Trial]:
    """``args.trials`` prompts over a pool of ``2 x args.docs`` held-out documents (fixed seed)."""
    _, held, _ = tiny.load_corpus(20)
    rng = random.Random(args.seed)
    stride = len(held) // (2 * args.docs)
    pool = [held[i * stride : i * stride + args.doc_len] for i in range(2 * args.docs)]
    trials = []
    for _ in range(args.trials):
        docs = rng.sample(pool, args.docs)
        source = docs[rng.randrange(args.docs)]
        spot = rng.randrange(args.cue, args.doc_len - args.answer)
        trials.append(Trial(docs, source[spot - args.cue : spot], source[spot : spot + args.answer]))
    return trials


def segments(trial: Trial, *, with_answer: bool) -> list[Segment]:
    system = torch.tensor([tiny.BOS, *SYSTEM])
    tail = torch.cat([trial.cue, trial.answer]) if with_answer else trial.cue
    return [Segment(system, reusable=False), *(Segment(d) for d in trial.docs), Segment(tail, reusable=False)]


def answer_logits(logits: torch.Tensor, trial: Trial) -> torch.Tensor:
    """The rows of ``logits`` (the last ``answer + 1`` positions) that predict the answer's bytes."""
    return logits[0, -trial.answer.numel() - 1 : -1]


@torch.no_grad()
def full_logits(model: LlamaForCausalLM, segs: list[Segment], keep: int) -> torch.Tensor:
    ids = torch.cat([s.tokens for s in segs])[None]
    return model(ids, logits_to_keep=keep).logits


def timed(fn: object, reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (after one untimed call)."""
    fn()  # type: ignore[operator]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def score(logits: list[torch.Tensor], reference: list[torch.Tensor], trials: list[Trial]) -> tuple[float, float]:
    """Answer perplexity of ``logits`` and their top-1 agreement (%) with ``reference``."""
    nll = torch.cat([F.cross_entropy(lg, t.answer, reduction="none") for lg, t in zip(logits, trials)])
    agree = torch.cat([(lg.argmax(-1) == ref.argmax(-1)).float() for lg, ref in zip(logits, reference)])
    return math.exp(nll.mean().item()), 100 * agree.mean().item()


@torch.no_grad()
def run(model: LlamaForCausalLM, trials: list[Trial], args: argparse.Namespace) -> list[Row]:
    keep = args.answer + 1
    ref = [answer_logits(full_logits(model, segments(t, with_answer=True), keep), t) for t in trials]
    ref_ppl, _ = score(ref, ref, trials)
    full_ms = statistics.median(
        timed(lambda t=t: full_logits(model, segments(t, with_answer=False), 1), args.reps) for t in trials
    )
    bare = []
    for t in trials:
        segs = segments(t, with_answer=True)
        bare.append(answer_logits(full_logits(model, [segs[0], segs[-1]], keep), t))
    bare_ppl, bare_agree = score(bare, ref, trials)
    rows = [
        Row("full prefill", ref_ppl, 0.0, 100.0, full_ms, 1.0),
        Row("no documents", bare_ppl, 100 * (bare_ppl / ref_ppl - 1), bare_agree, 0.0, 0.0),
    ]
    with tempfile.TemporaryDirectory(prefix="kvmem-blend-") as tmp, Memory(path=tmp) as memory:
        bc = BlendCache(model, memory, compression="none")
        for t in trials:  # every document's KV computed alone and stored once (ingestion)
            for seg in segments(t, with_answer=False)[1:-1]:
                if not bc.lookup([seg])[0]:
                    bc.store_segment(seg)
        for ratio in args.ratios:
            out = [
                answer_logits(
                    bc.prefill(segments(t, with_answer=True), recompute_ratio=ratio, logits_to_keep=keep).logits, t
                )
                for t in trials
            ]
            ms = statistics.median(
                timed(lambda t=t, r=ratio: bc.prefill(segments(t, with_answer=False), recompute_ratio=r), args.reps)
                for t in trials
            )
            ppl, agree = score(out, ref, trials)
            rows.append(Row(f"blend {100 * ratio:g} %", ppl, 100 * (ppl / ref_ppl - 1), agree, ms, full_ms / ms))
        bc.close()
    return rows


def print_table(rows: list[Row]) -> None:
    head = f"{'series':<16}{'answer ppl':>11}{'vs full':>10}{'top-1 agree':>13}{'TTFT ms':>10}{'full/this':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ttft = f"{r.ttft_ms:>10.1f}{r.speedup:>10.2f}x" if r.ttft_ms else f"{'-':>10}{'-':>11}"
        print(f"{r.series:<16}{r.perplexity:>11.4f}{r.delta_pct:>+9.2f}%{r.top1_agree:>12.2f}%{ttft}")


def figures(rows: list[Row]) -> list[dict[str, object]]:
    """The results record's figures: per series, the answer's quality and TTFT beside the full prefill's."""
    full = rows[0]
    out = []
    for r in rows[1:]:
        tag = r.series.replace(" %", "").replace(" ", "-")
        out.append(
            records.figure(
                f"{tag}-ppl",
                f"{r.series}: answer perplexity",
                "",
                r.perplexity,
                records.ref("full prefill", full.perplexity, r.delta_pct, unit="", ratio_is="change against it, %"),
                group="answer quality",
                decimals=3,
            )
        )
        out.append(
            records.figure(
                f"{tag}-top1",
                f"{r.series}: top-1 agreement with the full prefill",
                "%",
                r.top1_agree,
                group="answer quality",
            )
        )
        if r.ttft_ms:
            out.append(
                records.figure(
                    f"{tag}-ttft",
                    f"{r.series}: TTFT",
                    "ms",
                    r.ttft_ms,
                    records.ref("full prefill", full.ttft_ms, r.speedup),
                    ratio="full prefill time / this time",
                    group="time to first token (documents in the CPU tier)",
                )
            )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=None, help="a saved model (default: benchmarks/results/blend-lm-<layers>; trained if absent)"
    )
    p.add_argument("--minutes", type=float, default=25.0, help="training time when --model is absent")
    p.add_argument(
        "--train-len", type=int, default=4352, help="training sequence length when --model is absent (>= the prompt)"
    )
    p.add_argument(
        "--layers", type=int, default=12, help="decoder layers of a model trained here (4: width 256, more: width 128)"
    )
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--cue", type=int, default=32, help="bytes before the answer given in the question")
    p.add_argument("--answer", type=int, default=32, help="answer bytes scored")
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--ratios", default="0,0.05,0.15,0.3,1", help="recompute ratios, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per trial (median)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    args.ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    args.model = args.model or f"benchmarks/results/blend-lm-{args.layers}"
    return args


def main() -> None:
    run_record = records.start("bench_blend")
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args)
    trials = make_trials(args)
    print(
        f"{args.trials} trials: {args.docs} documents x {args.doc_len} bytes, {args.cue}-byte cue, "
        f"{args.answer} answer bytes scored; {model.config.num_hidden_layers}-layer model at {args.model}; "
        f"torch {torch.__version__}, {args.threads} threads, "
        f"load {load_average()}"
    )
    rows = run(model, trials, args)
    print_table(rows)
    records.write(
        run_record,
        figures(rows),
        headline=["blend-15-ttft"] if any(r.series == "blend 15 %" for r in rows) else [],
        machine={"torch_threads": args.threads, "model": f"{model.config.num_hidden_layers} layers at {args.model}"},
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows]}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
