"""A recommender feature cache on kvmem: item features by content hash, user histories as attention K/V.

A synthetic catalogue (items with a title, a description and a few attributes;
users with interaction histories and candidate lists) is scored by a small
two-tower-style ranker with random, seeded weights:

- the **item encoder** (hashed text tokens -> 2 transformer layers -> pooled,
  joined with category/brand/numeric attributes -> a 512-wide MLP -> a 128-d
  feature) is the costly part. Its outputs are cached under the hash of the
  item's *content*, in a namespace naming the encoder's weights: an edited item
  gets a new key, an unchanged one is never encoded again;
- the **user history** is cached as the per-head keys and values of the
  candidate-to-history attention layer (a KV cache of the user's history),
  under the user id and the hash of the history's item keys: a new interaction,
  or an edit to an item in the history, invalidates it by itself;
- candidates are scored by attention of each candidate over that K/V.

Pass 1 runs cold (encodes and stores), pass 2 runs again on the same
``Memory`` (loads instead of encoding), pass 3 on a new ``Memory`` opened on
the same directory (the disk tier only). ``store()`` is lossless, so the scores
of every pass must equal pass 1's bit for bit; the script checks it.

Usage (from the repository root)::

    python examples/recsys_feature_cache.py                       # temporary directory, removed after
    python examples/recsys_feature_cache.py --path /tmp/recsys --users 500 --items 5000 --seed 1 --fsync batch
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import random
import re
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

import kvmem
from kvmem.config import format_size

CATEGORIES = (
    "books",
    "music",
    "films",
    "games",
    "garden",
    "kitchen",
    "sports",
    "toys",
    "tools",
    "travel",
    "beauty",
    "office",
)
BRANDS = 40
MAX_TOKENS = 48  # hashed text tokens per item (unigrams, then bigrams), padded or cut to this
TOKEN_BUCKETS = 1 << 14  # bucket 0 is padding
FEATURE_DIM = 128
_SCORE_BATCH = 256  # users scored together
_MAX_HISTORY = 50  # interactions per generated user: 20 to this
_WORDS = (
    "red",
    "blue",
    "green",
    "black",
    "silver",
    "wooden",
    "steel",
    "cotton",
    "leather",
    "compact",
    "portable",
    "classic",
    "modern",
    "vintage",
    "deluxe",
    "lamp",
    "chair",
    "kettle",
    "novel",
    "album",
    "guitar",
    "racket",
    "puzzle",
    "drill",
    "tent",
    "camera",
    "brush",
    "stapler",
    "mug",
    "jacket",
    "blender",
    "lightweight",
    "durable",
    "handmade",
    "organic",
    "wireless",
    "ergonomic",
    "waterproof",
    "foldable",
    "rechargeable",
    "premium",
    "for",
    "with",
    "and",
    "the",
    "of",
    "in",
    "on",
    "daily",
    "travel",
    "home",
    "office",
    "kids",
    "adults",
    "outdoor",
    "winter",
    "summer",
    "gift",
    "set",
    "pack",
    "edition",
    "series",
    "collection",
    "bundle",
    "starter",
    "pro",
    "mini",
    "max",
    "ultra",
    "soft",
    "quiet",
    "fast",
    "bright",
    "warm",
)


# -- catalogue ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    """One catalogue item. Everything but ``item_id`` is content the encoder sees."""

    item_id: int
    title: str
    description: str
    category: str
    brand: int
    price: float
    year: int
    rating: float

    def content(self) -> str:
        """Canonical JSON of the item's content (not its id: same content, same features)."""
        return json.dumps(
            [self.title, self.description, self.category, self.brand, self.price, self.year, self.rating],
            ensure_ascii=False,
        )


@dataclass(frozen=True)
class User:
    """A user: the items interacted with (oldest first) and the items to rank (as many for every user)."""

    user_id: int
    history: tuple[int, ...]
    candidates: tuple[int, ...]


@dataclass(frozen=True)
class Catalogue:
    """Items (``items[i].item_id == i``) and users."""

    items: tuple[Item, ...]
    users: tuple[User, ...]


def _make_item(item_id: int, rng: random.Random) -> Item:
    title = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 6))).capitalize()
    description = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(15, 30)))
    return Item(
        item_id,
        title,
        description,
        rng.choice(CATEGORIES),
        rng.randrange(BRANDS),
        round(math.exp(rng.uniform(1.0, 6.5)), 2),
        rng.randint(2010, 2024),
        round(rng.uniform(1.0, 5.0), 1),
    )


def _make_user(user_id: int, items: Sequence[Item], n_candidates: int, rng: random.Random) -> User:
    liked = set(rng.sample(CATEGORIES, 2))
    preferred = [it.item_id for it in items if it.category in liked]
    history = [
        rng.choice(preferred) if preferred and rng.random() < 0.7 else rng.randrange(len(items))
        for _ in range(rng.randint(20, _MAX_HISTORY))
    ]
    seen = set(history)
    unseen = [it.item_id for it in items if it.item_id not in seen]
    return User(user_id, tuple(history), tuple(rng.sample(unseen, n_candidates)))


def make_catalogue(n_items: int, n_users: int, n_candidates: int, seed: int) -> Catalogue:
    """A deterministic synthetic catalogue: the same arguments give the same items and users anywhere."""
    rng = random.Random(seed)
    items = tuple(_make_item(i, rng) for i in range(n_items))
    n_candidates = min(n_candidates, n_items - _MAX_HISTORY)  # NOTE: every user has this many unseen items
    return Catalogue(items, tuple(_make_user(u, items, n_candidates, rng) for u in range(n_users)))


def edit_item(catalogue: Catalogue, item_id: int, description: str) -> Catalogue:
    """The catalogue with one item's description replaced."""
    items = list(catalogue.items)
    items[item_id] = replace(items[item_id], description=description)
    return replace(catalogue, items=tuple(items))


def add_interaction(catalogue: Catalogue, user_id: int, item_id: int) -> Catalogue:
    """The catalogue with ``item_id`` appended to one user's history."""
    users = list(catalogue.users)
    users[user_id] = replace(users[user_id], history=(*users[user_id].history, item_id))
    return replace(catalogue, users=tuple(users))


# -- model ----------------------------------------------------------------------------------------------------------
def tokenize(item: Item) -> list[int]:
    """Hashed unigram and bigram ids of the title and description (crc32: the same in every process)."""
    words = re.findall(r"[a-z0-9]+", f"{item.title} {item.description}".lower())
    grams = words + [f"{a}_{b}" for a, b in itertools.pairwise(words)]
    return [zlib.crc32(g.encode()) % (TOKEN_BUCKETS - 1) + 1 for g in grams[:MAX_TOKENS]]


class ItemEncoder(nn.Module):
    """Item tower: hashed text tokens through a small transformer, pooled, joined with attributes, then an MLP."""

    def __init__(self, text_dim: int = 128, layers: int = 2, hidden: int = 512, depth: int = 3) -> None:
        super().__init__()
        self.tokens = nn.Embedding(TOKEN_BUCKETS, text_dim, padding_idx=0)
        self.position = nn.Parameter(torch.randn(MAX_TOKENS, text_dim) * 0.02)
        block = nn.TransformerEncoderLayer(text_dim, 4, 4 * text_dim, dropout=0.0, batch_first=True, norm_first=True)
        self.text = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.category = nn.Embedding(len(CATEGORIES), 64)
        self.brand = nn.Embedding(BRANDS, 64)
        self.numeric = nn.Linear(3, 64)
        mlp: list[nn.Module] = [nn.Linear(text_dim + 192, hidden), nn.GELU()]
        for _ in range(depth - 1):
            mlp += [nn.Linear(hidden, hidden), nn.GELU()]
        self.mlp = nn.Sequential(*mlp, nn.Linear(hidden, FEATURE_DIM))

    def forward(self, items: Sequence[Item]) -> torch.Tensor:
        """L2-normalised ``[len(items), FEATURE_DIM]`` features."""
        ids = torch.zeros(len(items), MAX_TOKENS, dtype=torch.long)
        for row, item in enumerate(items):
            tokens = tokenize(item)
            ids[row, : len(tokens)] = torch.tensor(tokens)
        mask = ids != 0
        x = self.text(self.tokens(ids) + self.position, src_key_padding_mask=~mask)
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        numeric = torch.tensor([[math.log1p(it.price) / 7, (it.year - 2017) / 7, (it.rating - 3) / 2] for it in items])
        attrs = [
            self.category(torch.tensor([CATEGORIES.index(it.category) for it in items])),
            self.brand(torch.tensor([it.brand for it in items])),
            self.numeric(numeric),
        ]
        return F.normalize(self.mlp(torch.cat([pooled, *attrs], dim=-1)), dim=-1)


class HistoryAttention(nn.Module):
    """Candidate-to-history attention: each candidate attends over the user's history, then is scored."""

    def __init__(self, dim: int = FEATURE_DIM, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.heads, -1).transpose(0, 1).contiguous()  # [heads, n, head_dim]

    def encode_history(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        """The history's per-head keys and values, ``[heads, len(history), head_dim]`` each."""
        return {"k": self._split(self.k(features)), "v": self._split(self.v(features))}

    def score(self, histories: Sequence[dict[str, torch.Tensor]], candidates: torch.Tensor) -> torch.Tensor:
        """Scores ``[users, n]`` of each user's candidates ``[users, n, dim]`` against that user's history K/V.

        Histories of different lengths are padded to the longest and the padding masked out.
        """
        lengths = [h["k"].shape[1] for h in histories]
        longest = max(lengths)
        k, v = (
            torch.stack([F.pad(h[name], (0, 0, 0, longest - n)) for h, n in zip(histories, lengths)])
            for name in ("k", "v")
        )
        mask = (torch.arange(longest) < torch.tensor(lengths)[:, None])[:, None, None, :]  # [users, 1, 1, longest]
        users, n, dim = candidates.shape
        q = self.q(candidates).view(users, n, self.heads, -1).transpose(1, 2)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [users, heads, n, head_dim]
        interest = self.out(context.transpose(1, 2).reshape(users, n, dim))
        return (interest * candidates).sum(-1)


def weights_fingerprint(module: nn.Module) -> str:
    """sha256 of every parameter's name, shape and bytes (the model is small: hash it all)."""
    h = hashlib.sha256(type(module).__name__.encode())
    for name, tensor in sorted(module.state_dict().items()):
        h.update(f"{name}{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class Recommender:
    """The two models and the namespaces their outputs are cached in (each names the weights that made them)."""

    encoder: ItemEncoder
    attention: HistoryAttention
    item_namespace: str
    user_namespace: str

    @classmethod
    def build(cls, seed: int) -> Recommender:
        """Random weights drawn from ``seed`` (the global RNG is left as it was)."""
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            encoder, attention = ItemEncoder().eval(), HistoryAttention().eval()
        item_fp = weights_fingerprint(encoder)
        # NOTE: a user's K/V depends on both models, so its namespace names both.
        return cls(
            encoder,
            attention,
            f"recsys/item-features/{item_fp[:16]}",
            f"recsys/user-history/{item_fp[:16]}-{weights_fingerprint(attention)[:16]}",
        )


def item_key(item: Item) -> str:
    """An item's cache key: the hash of its content."""
    return kvmem.content_hash(item.content(), "recsys-item")


def history_key(user: User, item_keys: Sequence[str]) -> str:
    """A user's history key: the user id and the hash of the history's item keys, in order."""
    return f"user/{user.user_id}/{kvmem.content_hash(''.join(item_keys), 'recsys-history')}"


# -- one scoring pass ------------------------------------------------------------------------------------------------
@dataclass
class PassResult:
    """What one scoring pass did and produced."""

    name: str
    seconds: float = 0.0
    item_lookups: int = 0
    item_hits: int = 0
    user_lookups: int = 0
    user_hits: int = 0
    encoder_calls: int = 0  # item-encoder forward passes (batches)
    encoded_items: list[int] = field(default_factory=list)  # ids of the items run through the encoder
    encoded_users: list[int] = field(default_factory=list)  # ids of the users whose history K/V was computed
    tiers: Counter[str] = field(default_factory=Counter)  # tier that served each hit
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # user id -> one score per candidate
    phase_seconds: Counter[str] = field(default_factory=Counter)  # "load" / "encode" / "store" -> seconds in it

    @property
    def hit_rate(self) -> float:
        """Share of item-feature and user-history lookups served from kvmem."""
        lookups = self.item_lookups + self.user_lookups
        return (self.item_hits + self.user_hits) / lookups if lookups else 0.0

    @property
    def compute_seconds(self) -> float:
        """Wall time less the time spent in kvmem: what the pass costs with no cache at all when it is cold."""
        return self.seconds - self.phase_seconds["load"] - self.phase_seconds["store"]


@contextmanager
def _clock(result: PassResult, phase: str) -> Iterator[None]:
    """Add the wall time spent inside to ``result.phase_seconds[phase]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        result.phase_seconds[phase] += time.perf_counter() - start


def _load_users(
    mem: kvmem.Memory, model: Recommender, users: Sequence[User], keys: dict[int, str], result: PassResult
) -> dict[int, dict[str, torch.Tensor]]:
    """Cached history K/V by user id (the misses are absent)."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    with _clock(result, "load"):
        for user in users:
            loaded = mem.fetch(keys[user.user_id], namespace=model.user_namespace)
            if loaded is not None:
                found[user.user_id] = loaded.value
                result.tiers[loaded.tier] += 1
    result.user_lookups += len(users)
    result.user_hits += len(found)
    return found


def item_features(
    mem: kvmem.Memory, model: Recommender, items: Sequence[Item], result: PassResult, batch_size: int = 256
) -> dict[str, torch.Tensor]:
    """Features by content key for ``items``: loaded when stored, else encoded in batches and stored.

    Items with the same content share one key and are looked up (and encoded) once.
    """
    by_key = {item_key(item): item for item in items}
    keys = list(by_key)
    features: dict[str, torch.Tensor] = {}
    with _clock(result, "load"):
        for key, present in zip(keys, mem.contains_many(keys, namespace=model.item_namespace)):
            loaded = mem.fetch(key, namespace=model.item_namespace) if present else None
            if loaded is not None:  # NOTE: contains_many does not check CRCs: a corrupt copy is a miss here
                features[key] = loaded.value
                result.tiers[loaded.tier] += 1
    missing = [k for k in keys if k not in features]
    result.item_lookups += len(keys)
    result.item_hits += len(keys) - len(missing)
    for start in range(0, len(missing), batch_size):
        batch = missing[start : start + batch_size]
        with _clock(result, "encode"), torch.no_grad():
            encoded = model.encoder([by_key[k] for k in batch])
        result.encoder_calls += 1
        for key, row in zip(batch, encoded):
            features[key] = row.clone()  # NOTE: a row of its own, not a view that keeps the batch alive
            with _clock(result, "store"):
                mem.store(key, features[key], namespace=model.item_namespace, metadata={"item": by_key[key].item_id})
            result.encoded_items.append(by_key[key].item_id)
    return features


def score_users(mem: kvmem.Memory, model: Recommender, catalogue: Catalogue, name: str) -> PassResult:
    """Score every user's candidates, loading what ``mem`` holds and computing (and storing) the rest.

    Args:
        mem: where item features and user-history K/V are cached.
        model: the encoder and the attention layer.
        catalogue: items and users as they are now (edited items get new keys).
        name: label of the pass in the report.

    Returns:
        The pass's counters, timing and scores.
    """
    result = PassResult(name)
    start = time.perf_counter()
    keys_of = {item.item_id: item_key(item) for item in catalogue.items}
    user_keys = {u.user_id: history_key(u, [keys_of[i] for i in u.history]) for u in catalogue.users}
    histories = _load_users(mem, model, catalogue.users, user_keys, result)
    stale = [u for u in catalogue.users if u.user_id not in histories]
    needed = sorted({i for u in catalogue.users for i in u.candidates} | {i for u in stale for i in u.history})
    features = item_features(mem, model, [catalogue.items[i] for i in needed], result)
    table = torch.stack([features[keys_of[i]] for i in needed])  # NOTE: row n holds item needed[n]
    row_of = {item_id: n for n, item_id in enumerate(needed)}
    with torch.no_grad():
        for user in stale:
            rows = torch.tensor([row_of[i] for i in user.history])
            histories[user.user_id] = _encode_history(mem, model, table[rows], user_keys[user.user_id], result)
            result.encoded_users.append(user.user_id)
        for first in range(0, len(catalogue.users), _SCORE_BATCH):
            users = catalogue.users[first : first + _SCORE_BATCH]
            candidates = table[torch.tensor([[row_of[i] for i in u.candidates] for u in users])]  # [users, n, dim]
            scores = model.attention.score([histories[u.user_id] for u in users], candidates)
            result.scores.update((u.user_id, row) for u, row in zip(users, scores))
    result.seconds = time.perf_counter() - start
    return result


def _encode_history(
    mem: kvmem.Memory, model: Recommender, features: torch.Tensor, key: str, result: PassResult
) -> dict[str, torch.Tensor]:
    """One user's history K/V from its item features ``[len(history), dim]``, stored under ``key``."""
    with _clock(result, "encode"):
        history = model.attention.encode_history(features)
    with _clock(result, "store"):
        mem.store(key, history, namespace=model.user_namespace)
    return history


def same_scores(a: PassResult, b: PassResult) -> bool:
    """Whether two passes gave every user the same scores, bit for bit."""
    return a.scores.keys() == b.scores.keys() and all(torch.equal(a.scores[u], b.scores[u]) for u in a.scores)


# -- report ---------------------------------------------------------------------------------------------------------
def render_passes(passes: Sequence[PassResult]) -> str:
    """The per-pass table: wall time and its split, encoder work, hit rate, serving tiers, speed-up over pass 1."""
    head = (
        f"{'pass':<11} {'wall':>10} {'encode':>10} {'store':>10} {'load':>10} {'encoder calls':>13} "
        f"{'items encoded':>13} {'users encoded':>13} {'hit rate':>8}  {'served by':<10} {'speed-up':>8}"
    )
    lines = [head, "-" * len(head)]
    for p in passes:
        tiers = ", ".join(f"{t} {n}" for t, n in sorted(p.tiers.items())) or "-"
        # NOTE: milliseconds: a warm pass can take less than the 5 ms that "0.00 s" would hide
        split = " ".join(f"{p.phase_seconds[phase] * 1e3:>7.1f} ms" for phase in ("encode", "store", "load"))
        lines.append(
            f"{p.name:<11} {p.seconds * 1e3:>7.1f} ms {split} {p.encoder_calls:>13} {len(p.encoded_items):>13} "
            f"{len(p.encoded_users):>13} {p.hit_rate:>8.1%}  {tiers:<10} "
            f"{passes[0].seconds / p.seconds:>7.1f}x"
        )
    return "\n".join(lines)


def _check(first: PassResult, other: PassResult) -> tuple[bool, str]:
    n = sum(s.numel() for s in first.scores.values())
    ok = same_scores(first, other)
    verdict = "==" if ok else "!="
    return ok, (
        f"{'OK' if ok else 'FAILED'}: {other.name} scores {verdict} {first.name} scores "
        f"({len(first.scores)} users, {n} candidate scores, bit for bit)"
    )


def _top_items(catalogue: Catalogue, result: PassResult, user_id: int, k: int = 3) -> str:
    user = catalogue.users[user_id]
    best = result.scores[user_id].topk(min(k, len(user.candidates)))
    return "; ".join(
        f"#{user.candidates[i]} {catalogue.items[user.candidates[i]].title!r} ({s:+.3f})"
        for s, i in zip(best.values.tolist(), best.indices.tolist())
    )


@contextmanager
def data_dir(path: str | None) -> Iterator[str]:
    """``path``, or a temporary directory removed afterwards."""
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kvmem-recsys-") as tmp:
        yield tmp


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description="A recommender feature cache on kvmem: cold, warm and reopened passes."
    )
    parser.add_argument("--path", help="kvmem data directory (default: a temporary one, removed after)")
    parser.add_argument("--users", type=int, default=200, help="users to score (default: 200)")
    parser.add_argument("--items", type=int, default=2000, help="catalogue items (default: 2000)")
    parser.add_argument("--candidates", type=int, default=100, help="candidates ranked per user (default: 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the catalogue and the weights (default: 0)")
    parser.add_argument(
        "--fsync",
        choices=("always", "batch", "never"),
        default="never",
        help="kvmem's fsync setting (default: never, as fits a cache of values that can be recomputed)",
    )
    args = parser.parse_args(argv)
    if args.users < 1 or args.items < 60 or args.candidates < 1:
        parser.error("need --users >= 1, --items >= 60 (histories hold up to 50 items), --candidates >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three passes, print the report; 0 when every pass gave pass 1's scores."""
    args = parse_args(argv)
    catalogue = make_catalogue(args.items, args.users, args.candidates, args.seed)
    model = Recommender.build(args.seed)
    params = sum(p.numel() for p in model.encoder.parameters()) / 1e6
    interactions = sum(len(u.history) for u in catalogue.users)
    print(
        f"catalogue   {len(catalogue.items)} items, {len(catalogue.users)} users, {interactions} interactions, "
        f"{len(catalogue.users[0].candidates)} candidates per user (seed {args.seed})"
    )
    print(
        f"encoder     text transformer 2x128 + MLP 3x512 -> {FEATURE_DIM}-d, {params:.1f}M params "
        f"({model.item_namespace})"
    )
    with data_dir(args.path) as path:
        print(f"data        {path}{'' if args.path else ' (temporary)'}, fsync={args.fsync}")
        # NOTE: features can be recomputed, so a cache may skip fsync: an entry a crash tears fails its CRC
        # on load and is a miss, recomputed like any other.
        with kvmem.Memory(path, fsync=args.fsync) as mem:
            passes = [score_users(mem, model, catalogue, "1 cold"), score_users(mem, model, catalogue, "2 warm")]
            stats = mem.stats()
        with kvmem.Memory(path, fsync=args.fsync) as mem:  # NOTE: as a new process would: only the disk survives
            passes.append(score_users(mem, model, catalogue, "3 reopened"))
    print(f"stored      {stats.entries} entries, {format_size(stats.stored_size)}\n")
    print(render_passes(passes) + "\n")
    if passes[0].item_hits or passes[0].user_hits:
        print(f"note: {args.path} already held entries of this catalogue, so pass 1 was not cold")
    else:
        baseline = passes[0].compute_seconds
        print(
            f"no cache    {baseline:.2f} s a pass (pass 1 less its kvmem time: encode + score only); "
            + ", ".join(f"pass {p.name} {baseline / p.seconds:.1f}x faster" for p in passes[1:])
        )
    print(f"user 0 top  {_top_items(catalogue, passes[0], 0)}")
    checks = [_check(passes[0], p) for p in passes[1:]]
    for _, line in checks:
        print(line)
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
