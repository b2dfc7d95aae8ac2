"""Train a tiny Llama on a synthetic retrieval task whose answers need two documents (issue #36).

``bench_blend.py`` scores ``BlendCache`` on this task. A model that can answer without
its documents cannot tell a good blend from a bad one; here it cannot: every prompt
draws new entities, so nothing can be memorised, and every answer joins two facts
that sit in two different documents.

The task (word-level tokens, vocabulary below)::

    BOS  DOC f f f ...  DOC f f f ...  DOC ...  DOC ...  Q WHERE <person> -> <company> <city>

Each document holds ``facts`` facts of two kinds, ``WORKS <person> <company> .`` and
``IN <company> <city> .``. The facts come in chains (one person, one company, one
city): a chain's WORKS fact and its IN fact always sit in different documents, so
the question "where does <person> work?" needs the person's company from one
document and that company's city from another. Every other chain in the prompt is a
distractor of the same shape. People, companies and cities are drawn at random per
prompt from pools of ``PEOPLE``, ``COMPANIES`` and ``CITIES`` names, and the four
documents come in a random order. Without its documents a model can only guess:
chance is ``1 / (COMPANIES * CITIES)`` for the whole answer.

Training sequences carry several questions (each followed by its answer) after the
documents; the loss is on the answers only.

How to run (from the repository root)::

    python benchmarks/train_retrieval_lm.py                 # 20 min, saves to benchmarks/results/retrieval-lm
    python benchmarks/train_retrieval_lm.py --minutes 3 --out /tmp/retrieval-lm

Training is seeded but stops on wall-clock time (``train_tiny_lm.learning_rate``
schedule), so its step count depends on the machine's speed and load.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from train_tiny_lm import learning_rate, seed_everything
from transformers import LlamaConfig, LlamaForCausalLM

# The vocabulary: a few word tokens, then the name pools.
PAD, BOS, DOC, DOT, Q, WORKS, IN, WHERE = range(8)
PEOPLE, COMPANIES, CITIES = 512, 512, 64
PERSON0 = 16
COMPANY0 = PERSON0 + PEOPLE
CITY0 = COMPANY0 + COMPANIES
VOCAB = CITY0 + CITIES
FACT_TOKENS = 4
DOCS = 4


@dataclass
class World:
    """One prompt's documents and its chains ``(person, company, city)`` (token ids)."""

    docs: list[list[int]]
    chains: list[tuple[int, int, int]]

    def question(self, chain: int) -> tuple[list[int], list[int]]:
        """The question about ``chain``'s person and its answer (the company, then the city)."""
        person, company, city = self.chains[chain]
        return [Q, WHERE, person], [company, city]


def make_world(rng: random.Random, facts: int) -> World:
    """Four documents of ``facts`` facts each (``1 + 4 * facts`` tokens), ``2 * facts`` chains, each chain's
    two facts in two different documents."""
    n = 2 * facts
    people = rng.sample(range(PERSON0, COMPANY0), n)
    companies = rng.sample(range(COMPANY0, CITY0), n)
    cities = [rng.randrange(CITY0, VOCAB) for _ in range(n)]
    chains = list(zip(people, companies, cities))
    slots = [d for d in range(DOCS) for _ in range(facts)]  # chain i's facts go to slots 2i and 2i + 1
    rng.shuffle(slots)
    for i in range(n):
        while slots[2 * i] == slots[2 * i + 1]:  # swap the second with another chain's that fits both
            j = rng.randrange(n)
            if slots[2 * j + 1] != slots[2 * i] and slots[2 * i + 1] != slots[2 * j]:
                slots[2 * i + 1], slots[2 * j + 1] = slots[2 * j + 1], slots[2 * i + 1]
    docs: list[list[list[int]]] = [[] for _ in range(DOCS)]
    for i, (person, company, city) in enumerate(chains):
        docs[slots[2 * i]].append([WORKS, person, company, DOT])
        docs[slots[2 * i + 1]].append([IN, company, city, DOT])
    out = []
    for doc in docs:
        rng.shuffle(doc)
        out.append([DOC] + [t for fact in doc for t in fact])
    return World(out, chains)


def training_example(rng: random.Random, facts: int, questions: int) -> tuple[list[int], list[int]]:
    """A sequence (BOS, the documents, ``questions`` questions each followed by its answer) and the
    positions whose next token is an answer's."""
    world = make_world(rng, facts)
    ids = [BOS] + [t for doc in world.docs for t in doc]
    targets = []
    for _ in range(questions):
        q, answer = world.question(rng.randrange(len(world.chains)))
        ids += q
        targets += [len(ids) - 1, len(ids)]
        ids += answer
    return ids, targets


def batch(rng: random.Random, size: int, facts: int, questions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` training examples as ``(input ids, labels)``; labels are -100 except at answers."""
    examples = [training_example(rng, facts, questions) for _ in range(size)]
    length = len(examples[0][0])
    ids = torch.tensor([e[0] for e in examples])
    labels = torch.full((size, length), -100)
    for row, (seq, targets) in enumerate(examples):
        for t in targets:
            labels[row, t] = seq[t + 1]
    return ids[:, :-1], labels[:, :-1]


def build_model(max_positions: int, layers: int, width: int) -> LlamaForCausalLM:
    """A Llama over the task's vocabulary: ``layers`` decoder layers of ``width``, heads of 32."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=width // 32,
        num_key_value_heads=width // 32,
        intermediate_size=4 * width,
        max_position_embeddings=max_positions,
        bos_token_id=BOS,
        eos_token_id=PAD,
        pad_token_id=PAD,
        tie_word_embeddings=True,  # copying a name from the documents is then the identity to learn
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def accuracy(model: LlamaForCausalLM, facts: int, count: int, seed: int) -> float:
    """Exact-match accuracy (%) of the answer (both tokens, teacher-forced) on ``count`` fresh prompts."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(count):
        world = make_world(rng, facts)
        q, answer = world.question(rng.randrange(len(world.chains)))
        ids = torch.tensor([[BOS] + [t for d in world.docs for t in d] + q + answer])
        guess = model(ids, logits_to_keep=3).logits[0, :2].argmax(-1)
        hits += guess.tolist() == answer
    return 100 * hits / count


def train(model: LlamaForCausalLM, args: argparse.Namespace) -> dict[str, float]:
    """AdamW on fresh synthetic batches until ``args.minutes`` have passed (the answers' loss only)."""
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    budget, start, last_log = args.minutes * 60.0, time.perf_counter(), 0.0
    step, ema = 0, float("nan")
    model.train()
    while (elapsed := time.perf_counter() - start) < budget:
        for group in opt.param_groups:
            group["lr"] = learning_rate(elapsed / budget, args.lr)
        facts = rng.randint(args.min_facts, args.max_facts)
        ids, labels = batch(rng, args.batch, facts, args.questions)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        if elapsed - last_log >= 60 or step == 1:
            model.eval()
            acc = accuracy(model, args.eval_facts, 50, seed=10_000 + step)
            model.train()
            print(f"step {step:5d}  {elapsed:5.0f}s  loss {ema:.3f}  accuracy {acc:5.1f} %", flush=True)
            last_log = elapsed
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - start, "final_loss": ema}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="training time budget (wall clock)")
    p.add_argument("--out", default="benchmarks/results/retrieval-lm", help="where save_pretrained writes the model")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--questions", type=int, default=16, help="questions per training sequence")
    p.add_argument("--min-facts", type=int, default=1, help="fewest facts per document in training")
    p.add_argument("--max-facts", type=int, default=4, help="most facts per document in training")
    p.add_argument("--eval-facts", type=int, default=4, help="facts per document of the progress check")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared machine, threads that wait for each other run several times slower)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default=None, help="train this saved model further instead of a new one")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    seed_everything(args.seed)
    torch.set_num_threads(args.threads)
    if args.resume:  # more minutes on a saved model: a new schedule, the same task
        model = LlamaForCausalLM.from_pretrained(args.resume, dtype=torch.float32)
    else:
        model = build_model(max_positions=8192, layers=args.layers, width=args.width)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"Llama {params:.2f}M params, {args.layers} layers x {args.width}; {args.minutes:g} min, {args.threads} threads"
    )
    training = train(model, args)
    final = accuracy(model, args.eval_facts, 400, seed=99)
    print(f"trained {training['steps']} steps; accuracy at {args.eval_facts} facts/document: {final:.1f} %")
    model.save_pretrained(args.out)
    Path(args.out, "training.json").write_text(json.dumps({**training, **vars(args), "accuracy": final}, indent=1))
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
