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
documents; the loss is on the answers only. Trained on that alone, a small model
stalls at guessing a name of the right kind from the prompt: the lookup needs an
induction head (find the person earlier in the prompt, copy the token after it),
and an answer is too sparse a signal for one to form in CPU minutes. So training
starts with ``--copy-steps`` steps of copying (a random sequence of names, then the
same sequence again at a distance that varies, the loss on the repeat: every token
is an induction target), and keeps a ``--copy-mix`` share of copying batches after
that; the task's lookup is then learned in a minute or two.

A deep model still learns it too slowly here, and ``BlendCache``'s TTFT gain needs
depth: its first layer is computed for every token, so a 2-layer model gains
nothing. So the model grows (function-preserving, as Net2Net's deeper networks,
Chen et al. 2016): ``--start-layers`` layers learn the task, then (once the progress
check answers 90 % right, at the latest at ``--grow-at`` of the time budget)
``--layers - --start-layers`` layers are added on top, each starting
as the identity (its attention and MLP output projections zero), and the whole
model trains on.

How to run (from the repository root)::

    python benchmarks/train_retrieval_lm.py --threads 2     # 16 min, saves to benchmarks/results/retrieval-lm
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
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

# The vocabulary: a few word tokens, then the name pools.
PAD, BOS, DOC, DOT, Q, WORKS, IN, WHERE = range(8)
PEOPLE, COMPANIES, CITIES = 128, 128, 64
PERSON0 = 16
COMPANY0 = PERSON0 + PEOPLE
CITY0 = COMPANY0 + COMPANIES
VOCAB = CITY0 + CITIES
FACT_TOKENS = 4
DOCS = 4
COPY_LENGTH = 32  # names per copying sequence (then repeated)
GROW_ACCURACY = 90.0  # the progress check's accuracy (%) at which the model grows before --grow-at


@dataclass
class World:
    """One prompt's documents and its chains ``(person, company, city)`` (token ids)."""

    docs: list[list[int]]
    chains: list[tuple[int, int, int]]

    def question(self, chain: int) -> tuple[list[int], list[int]]:
        """The question about ``chain``'s person and its answer (the company, then the city)."""
        person, company, city = self.chains[chain]
        return [Q, WHERE, person], [company, city]


def make_world(rng: random.Random, facts: int, *, distinct: bool = True) -> World:
    """Four documents of ``facts`` facts each (``1 + 4 * facts`` tokens), ``2 * facts`` chains, each chain's
    two facts in two different documents; ``distinct``: no two chains share a person or a company (else they
    may: for documents longer than the pools have names, whose questions can have several answers)."""
    n = 2 * facts
    draw = rng.sample if distinct else lambda names, k: rng.choices(names, k=k)
    people = draw(range(PERSON0, COMPANY0), n)
    companies = draw(range(COMPANY0, CITY0), n)
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


def copy_batch(size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` sequences of ``length`` random names, then other random names (0 to ``length`` of them), then
    the first names again, then more random names to ``3 * length`` tokens; labels on the repeat, from its
    second name (its first cannot be told from what comes before).

    NOTE: the repeat starts at a distance that differs per sequence, so copying needs an induction head; at
    one fixed distance a head that attends ``length`` tokens back learns it and the task gains nothing.
    """
    seq = torch.randint(PERSON0, VOCAB, (size, 3 * length))
    labels = torch.full((size, 3 * length), -100)
    for row, gap in enumerate(torch.randint(0, length + 1, (size,)).tolist()):
        start = length + gap
        seq[row, start : start + length] = seq[row, :length]
        labels[row, start : start + length - 1] = seq[row, start + 1 : start + length]
    return seq[:, :-1], labels[:, :-1]


def build_model(max_positions: int, layers: int, width: int) -> LlamaForCausalLM:
    """A Llama over the task's vocabulary: ``layers`` decoder layers of ``width``, heads of 32."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=width // 32,
        num_key_value_heads=width // 32,
        intermediate_size=2 * width,
        max_position_embeddings=max_positions,
        bos_token_id=BOS,
        eos_token_id=PAD,
        pad_token_id=PAD,
        tie_word_embeddings=True,  # copying a name from the documents is then the identity to learn
        attention_bias=True,  # a constant query or key part: a head that attends to the previous token is easy
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def grow(model: LlamaForCausalLM, layers: int) -> None:
    """Add decoder layers on top of ``model`` up to ``layers``, each the identity until trained: its residual
    branches' output projections start at zero, so the model computes what it computed before."""
    config = model.config
    for idx in range(config.num_hidden_layers, layers):
        layer = LlamaDecoderLayer(config, idx)
        layer.apply(model._init_weights)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.layers.append(layer)
    config.num_hidden_layers = layers


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
    step, ema, learned = 0, float("nan"), False
    model.train()
    while (elapsed := time.perf_counter() - start) < budget:
        if model.config.num_hidden_layers < args.layers and (learned or elapsed >= args.grow_at * budget):
            grow(model, args.layers)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
            model.train()
            print(f"step {step:5d}  {elapsed:5.0f}s  grown to {args.layers} layers", flush=True)
        for group in opt.param_groups:
            group["lr"] = learning_rate(elapsed / budget, args.lr)
        if step < args.copy_steps or rng.random() < args.copy_mix:
            ids, labels = copy_batch(args.batch, COPY_LENGTH)
        else:
            ids, labels = batch(rng, args.batch, rng.randint(args.min_facts, args.max_facts), args.questions)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        if elapsed - last_log >= (60 if learned else 20) or step == 1:
            model.eval()
            acc = accuracy(model, args.eval_facts, 50, seed=10_000 + step)
            model.train()
            learned = learned or acc >= GROW_ACCURACY
            print(f"step {step:5d}  {elapsed:5.0f}s  loss {ema:.3f}  accuracy {acc:5.1f} %", flush=True)
            last_log = elapsed
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - start, "final_loss": ema}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=16.0, help="training time budget (wall clock)")
    p.add_argument("--out", default="benchmarks/results/retrieval-lm", help="where save_pretrained writes the model")
    p.add_argument("--layers", type=int, default=16, help="decoder layers of the trained model")
    p.add_argument("--start-layers", type=int, default=2, help="decoder layers before it grows (see above)")
    p.add_argument("--grow-at", type=float, default=0.6, help="share of the time budget before it grows")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--questions", type=int, default=16, help="questions per training sequence")
    p.add_argument("--min-facts", type=int, default=1, help="fewest facts per document in training")
    p.add_argument("--max-facts", type=int, default=4, help="most facts per document in training")
    p.add_argument("--eval-facts", type=int, default=4, help="facts per document of the progress check")
    p.add_argument("--copy-steps", type=int, default=400, help="copying steps before the task (see above)")
    p.add_argument("--copy-mix", type=float, default=0.1, help="share of copying batches after those")
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


def train_and_save(args: argparse.Namespace) -> LlamaForCausalLM:
    """A model trained as ``args`` say (a new one, or ``args.resume`` trained further), saved at ``args.out``
    with its ``training.json``."""
    seed_everything(args.seed)
    if args.resume:  # more minutes on a saved model: a new schedule, the same task
        model = LlamaForCausalLM.from_pretrained(args.resume, dtype=torch.float32)
    else:
        model = build_model(max_positions=8192, layers=min(args.start_layers, args.layers), width=args.width)
    layers = model.config.num_hidden_layers
    growth = f" (grows to {args.layers})" if layers < args.layers else ""
    print(f"Llama of {layers} layers{growth} x {args.width}; {args.minutes:g} min, {torch.get_num_threads()} threads")
    training = train(model, args)
    final = accuracy(model, args.eval_facts, 400, seed=99)
    print(f"trained {training['steps']} steps; accuracy at {args.eval_facts} facts/document: {final:.1f} %")
    model.save_pretrained(args.out)
    Path(args.out, "training.json").write_text(json.dumps({**training, **vars(args), "accuracy": final}, indent=1))
    print(f"saved to {args.out}")
    return model


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    train_and_save(args)


if __name__ == "__main__":
    main()
