"""Train a tiny byte-level Llama on local Python sources, then measure quantized-KV perplexity.

Issue #3, requirement 5: the accuracy of ``int8``/``int4`` KV chunks is measured on a
*trained* model (random weights say nothing about it). No downloads: the corpus is the
``.py`` files of this interpreter's standard library, tokenized bytewise (ids 0-255,
plus BOS=256 and EOS=257), with every ``--holdout``-th file (sorted order) held out.

Evaluation: held-out windows of ``--prefix + --cont + 1`` tokens (default 768 + 256 + 1);
the model sees the first ``prefix + cont`` and its ``cont`` next-token predictions after
the prefix are scored, with the prefix KV from

* a plain full forward pass in fp32 (the reference), and
* kvmem ``PrefixCache`` reuse (``block_size=256``) for each codec: a first ``prefill``
  of the prefix stores its chunks with that codec, ``flush()``, then a second
  ``prefill`` of the whole window loads them (dequantized) and computes the continuation.

A "no prefix" row (the continuation scored alone) shows how much the prefix KV is
worth at all: if it is worth little, small KV errors cannot show either.
The table reports perplexity, its change vs fp32, top-1 agreement with fp32, stored
bytes per chunk (the catalog's ``stored_size``: payload, scales/zeros, blob header)
and the size ratio vs bf16. The seed's goal: int4 >= 3.5x smaller than bf16 with
< 1 % perplexity increase.

How to run (from the repository root)::

    python benchmarks/train_tiny_lm.py                          # train 4 min, save, evaluate
    python benchmarks/train_tiny_lm.py --minutes 10 --json benchmarks/results/tiny-lm.json
    python benchmarks/train_tiny_lm.py --model benchmarks/results/tiny-lm   # evaluate a saved model only

The model is saved with ``save_pretrained`` to ``--out`` (default
``benchmarks/results/tiny-lm``, git-ignored) and loads with
``LlamaForCausalLM.from_pretrained(path)``; other benchmarks take it as ``--model PATH``.
Training is seeded, but stops on wall-clock time, so the step count (and the
exact weights) depend on the machine's speed and load. It trains on 1024-token
windows so that every evaluated position is one the model was trained at.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import records
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from kvmem import Memory
from kvmem.kv import PrefixCache

BOS, EOS, VOCAB = 256, 257, 258
BLOCK_SIZE = 256


@dataclass
class Row:
    """One line of the results table."""

    codec: str
    perplexity: float
    delta_pct: float
    top1_agree: float
    bytes_per_chunk: int | None
    ratio_vs_bf16: float | None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_corpus(holdout: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Bytes of the stdlib ``.py`` files as two token streams (train, held-out), files joined by EOS.

    Returns:
        ``(train_ids, eval_ids, eval_files)``; files are read in sorted order and every
        ``holdout``-th one goes to evaluation.
    """
    root = Path(os.__file__).parent
    files = sorted(
        p for p in root.rglob("*.py") if p.is_file() and not {"site-packages", "dist-packages"} & set(p.parts)
    )
    train, held, held_names = [], [], []
    for i, path in enumerate(files):
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)
        doc = np.concatenate([[BOS], data, [EOS]])
        if i % holdout == 0:
            held.append(doc)
            held_names.append(str(path.relative_to(root)))
        else:
            train.append(doc)
    return torch.from_numpy(np.concatenate(train)), torch.from_numpy(np.concatenate(held)), held_names


def build_model(max_positions: int, layers: int = 4) -> LlamaForCausalLM:
    """The byte-level Llama: 4 layers of width 256, or ``layers`` deeper ones of width 128 (about the same
    compute per token: what depth changes is the share of one layer, e.g. BlendCache's full first layer)."""
    wide = layers <= 4
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256 if wide else 128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688 if wide else 344,
        max_position_embeddings=max_positions,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def learning_rate(frac: float, peak: float, warmup: float = 0.05) -> float:
    """Linear warmup over the first ``warmup`` of the time budget, then cosine down to 10 % of ``peak``.

    NOTE: a function of elapsed time, not of steps, so any machine speed gets a whole schedule.
    """
    if frac < warmup:
        return peak * max(frac / warmup, 0.01)
    frac = min((frac - warmup) / (1 - warmup), 1.0)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def train(model: LlamaForCausalLM, ids: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    """AdamW on random windows of ``ids`` until ``args.minutes`` have passed.

    Returns:
        Steps, tokens seen, seconds and the final smoothed training loss (nats/byte).
    """
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60.0
    model.train()
    start = last_log = time.perf_counter()
    step, ema = 0, float("nan")
    bar = tqdm(total=round(budget), unit="s", desc="train", mininterval=2.0)
    while (elapsed := time.perf_counter() - start) < budget:
        lr = learning_rate(elapsed / budget, args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(ids) - args.seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([ids[o : o + args.seq_len + 1] for o in offsets.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        now = time.perf_counter()
        bar.update(min(round(now - start), round(budget)) - bar.n)
        bar.set_postfix(step=step, loss=f"{ema:.3f}", lr=f"{lr:.1e}")
        if now - last_log >= 30 or step == 1:
            tqdm.write(f"step {step:5d}  {now - start:6.0f}s  loss {loss.item():.4f}  ema {ema:.4f}  lr {lr:.2e}")
            last_log = now
    bar.close()
    seconds = time.perf_counter() - start
    tqdm.write(
        f"trained {step} steps, {step * args.batch * args.seq_len:,} tokens in {seconds:.0f}s; "
        f"final loss (ema) {ema:.4f} nats/byte = {ema / math.log(2):.3f} bits/byte"
    )
    return {"steps": step, "tokens": step * args.batch * args.seq_len, "seconds": seconds, "final_loss": ema}


def eval_windows(ids: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    """``count`` non-overlapping windows of ``length`` tokens, evenly spread over ``ids``."""
    total = len(ids) // length
    if total < count:
        raise SystemExit(f"held-out text has {total} windows of {length} tokens; lower --eval-seqs or --holdout")
    picks = np.linspace(0, total - 1, count).round().astype(int)
    return [ids[i * length : (i + 1) * length] for i in picks]


def continuation_nll(logits: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of ``window[prefix+1:]`` from the continuation's logits ``[cont, vocab]``."""
    targets = window[-logits.shape[0] :]
    return F.cross_entropy(logits.float(), targets, reduction="none")


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: list[torch.Tensor], prefix: int, codecs: list[str]) -> list[Row]:
    """Continuation perplexity with fp32 prefix KV vs kvmem-reused prefix KV for each codec."""
    model.eval()
    ref_nll, ref_top1, bare_nll, bare_agree = [], [], [], []
    for w in windows:
        logits = model(input_ids=w[None, :-1]).logits[0, prefix:]
        ref_nll.append(continuation_nll(logits, w))
        ref_top1.append(logits.argmax(-1))
        bare = model(input_ids=w[None, prefix:-1]).logits[0]  # what the prefix is worth: no prefix at all
        bare_nll.append(continuation_nll(bare, w))
        bare_agree.append((bare.argmax(-1) == ref_top1[-1]).float())
    ref_ppl = math.exp(torch.cat(ref_nll).mean().item())
    bare_ppl = math.exp(torch.cat(bare_nll).mean().item())
    rows = [
        Row("fp32 (full forward)", ref_ppl, 0.0, 100.0, None, None),
        Row(
            "no prefix (fp32)",
            bare_ppl,
            100 * (bare_ppl / ref_ppl - 1),
            100 * torch.cat(bare_agree).mean().item(),
            None,
            None,
        ),
    ]
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="kvmem-tinylm-") as tmp, Memory(path=tmp) as memory:
        for codec in codecs:
            pc = PrefixCache(model, memory, block_size=BLOCK_SIZE, compression=codec)
            nll, agree, chunk_bytes = [], [], []
            for w, top1 in tqdm(list(zip(windows, ref_top1)), desc=f"eval {codec}", leave=False):
                pc.prefill(w[:prefix])
                pc.flush()
                result = pc.prefill(w[:-1])
                if result.reused_tokens != prefix:
                    raise RuntimeError(f"{codec}: reused {result.reused_tokens} tokens, expected {prefix}")
                logits = result.logits[0]
                nll.append(continuation_nll(logits, w))
                agree.append((logits.argmax(-1) == top1).float())
                for key in pc.chunk_keys(w[:prefix]):
                    info = memory.info(key, namespace=pc.namespace)
                    if info is not None:
                        chunk_bytes.append(info.stored_size)
            pc.close()
            ppl = math.exp(torch.cat(nll).mean().item())
            sizes[codec] = round(sum(chunk_bytes) / len(chunk_bytes))
            rows.append(
                Row(
                    f"kvmem {codec}",
                    ppl,
                    100 * (ppl / ref_ppl - 1),
                    100 * torch.cat(agree).mean().item(),
                    sizes[codec],
                    None,
                )
            )
    base = sizes.get("bf16")
    for row in rows:
        if base and row.bytes_per_chunk:
            row.ratio_vs_bf16 = base / row.bytes_per_chunk
    return rows


def print_table(rows: list[Row]) -> None:
    head = f"{'codec':<22}{'perplexity':>11}{'Δ% vs fp32':>12}{'top-1 agree':>13}{'bytes/chunk':>13}{'× vs bf16':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        size = f"{r.bytes_per_chunk:,}" if r.bytes_per_chunk else "-"
        ratio = f"{r.ratio_vs_bf16:.2f}" if r.ratio_vs_bf16 else "-"
        print(f"{r.codec:<22}{r.perplexity:>11.4f}{r.delta_pct:>+11.3f}%{r.top1_agree:>12.2f}%{size:>13}{ratio:>11}")


def figures(rows: list[Row]) -> list[dict[str, object]]:
    """The results record's figures: each codec's perplexity beside the full fp32 forward's, its top-1
    agreement, and its stored bytes per chunk beside bf16's."""
    full = rows[0]
    bf16 = next((r for r in rows if r.codec == "kvmem bf16"), None)
    out = []
    for r in rows[1:]:
        tag = records.slug(r.codec.removeprefix("kvmem "))
        out.append(
            records.figure(
                f"{tag}-ppl",
                f"{r.codec}: perplexity",
                "",
                r.perplexity,
                records.ref("fp32 (full forward)", full.perplexity, r.delta_pct, ratio_is="change against it, %"),
                group="quality",
                decimals=4,
            )
        )
        out.append(
            records.figure(
                f"{tag}-top1", f"{r.codec}: top-1 agreement with fp32", "%", r.top1_agree, group="quality", decimals=2
            )
        )
        if r.bytes_per_chunk:
            refs = [records.ref("bf16", bf16.bytes_per_chunk, r.ratio_vs_bf16)] if bf16 and bf16.bytes_per_chunk else []
            out.append(
                records.figure(
                    f"{tag}-bytes",
                    f"{r.codec}: bytes per chunk",
                    "B",
                    r.bytes_per_chunk,
                    *refs,
                    ratio="bf16 size / this size",
                    group="size",
                    decimals=0,
                )
            )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=4.0, help="training time budget (wall clock)")
    p.add_argument("--out", default="benchmarks/results/tiny-lm", help="where save_pretrained writes the model")
    p.add_argument("--model", default=None, help="evaluate this saved model instead of training one")
    p.add_argument(
        "--seq-len",
        type=int,
        default=1024,
        help="training sequence length (default: the eval window, so eval positions are in-distribution)",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--holdout", type=int, default=20, help="every N-th file (sorted) is held out")
    p.add_argument("--prefix", type=int, default=768, help="prefix tokens (a multiple of 256)")
    p.add_argument("--cont", type=int, default=256, help="continuation tokens scored")
    p.add_argument("--eval-seqs", type=int, default=32)
    p.add_argument("--codecs", default="none,bf16,int8,int4")
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) // 2),
        help="torch threads (default: half the cores; oversubscribed threads on a shared "
        "machine run several times slower)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if args.prefix % BLOCK_SIZE or args.prefix <= 0:
        p.error(f"--prefix {args.prefix}: must be a positive multiple of the block size {BLOCK_SIZE}")
    return args


def main() -> None:
    run = records.start("train_tiny_lm")
    args = parse_args()
    seed_everything(args.seed)
    torch.set_num_threads(args.threads)
    train_ids, eval_ids, eval_files = load_corpus(args.holdout)
    print(
        f"corpus: {len(train_ids):,} train bytes, {len(eval_ids):,} held-out bytes ({len(eval_files)} files); "
        f"torch {torch.__version__}, {args.threads} threads"
    )
    training: dict[str, float] = {}
    if args.model:
        model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        model = build_model(max(2048, args.prefix + args.cont))
        print(
            f"model: Llama {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
            f"seq {args.seq_len} x batch {args.batch}, {args.minutes:g} min"
        )
        training = train(model, train_ids, args)
        model.save_pretrained(args.out)
        Path(args.out, "training.json").write_text(
            json.dumps(
                {**training, **{k: v for k, v in vars(args).items() if k != "json"}, "held_out_files": eval_files},
                indent=1,
            )
        )
        print(f"saved to {args.out}")
    windows = eval_windows(eval_ids, args.prefix + args.cont + 1, args.eval_seqs)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    rows = evaluate(model, windows, args.prefix, codecs)
    print(
        f"\ncontinuation perplexity (bytes), {len(windows)} held-out windows: "
        f"{args.prefix}-token prefix KV + {args.cont} scored tokens, block_size {BLOCK_SIZE}"
    )
    print_table(rows)
    figs = figures(rows)
    records.write(
        run,
        figs,
        headline=[i for i in ("int4-bytes", "int4-ppl") if any(f["id"] == i for f in figs)],
        machine={"torch_threads": args.threads, "model": args.model or args.out},
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "training": training, "rows": [asdict(r) for r in rows]}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
