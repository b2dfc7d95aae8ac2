"""Request traces for cache benchmarks, generated from workload shapes, not from any policy's model.

Each trace is a list of :class:`Request`: the chunks a request reads (stored by earlier requests, or
before the trace starts) and the chunks it adds (its new turn or step, stored after it is served).
Every chunk is one cache entry of the same size; keys are plain strings. Nothing here knows how kvmem
predicts or evicts: the shapes follow what published serving traces report.

- :func:`chat`: multi-turn conversations. New conversations arrive at random; each has a long-tailed
  number of turns (geometric, mean ``turns``: ShareGPT-style logs average 3-6 turns with a long tail), and
  returns after a heavy-tailed gap (Pareto, shape 1.2: most users answer within a few requests of others,
  some after thousands). A turn reads the shared system prompt and the whole history and adds its own
  chunk(s).
- :func:`rag`: retrieval-augmented requests over a document collection. Each request reads 3-5 distinct
  documents drawn from a Zipf(0.9) popularity whose ranking drifts (every ``drift_every`` requests a share
  of the ranks is re-drawn: news, new products); documents are stored before the trace starts.
- :func:`agent`: tool-calling agents. Sessions of one of a few agent types (each with its own long system
  prompt and tool list) run interleaved; each step reads the type's prefix and the session's earlier
  steps and adds one step (a tool call and its result); sessions last a long-tailed number of steps.
- :func:`uniform`: documents drawn uniformly at random: nothing to learn, no reuse pattern to exploit.

Traces are seeded and deterministic; :func:`summary` gives their unique-chunk counts (the working set).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Request", "chat", "rag", "agent", "uniform", "summary", "TRACES", "pre_stored"]


@dataclass(frozen=True)
class Request:
    """One request: who sent it, the chunks it reads (in prompt order), the chunks it adds."""

    stream: str
    reads: tuple[str, ...]
    adds: tuple[str, ...] = field(default=())


def chat(n: int, seed: int, *, turns: float = 5.0, system_chunks: int = 2, gap_shape: float = 1.2) -> list[Request]:
    """``n`` turns of multi-turn conversations returning after heavy-tailed gaps (in requests)."""
    rng = random.Random(seed)
    system = tuple(f"chat/system/{i}" for i in range(system_chunks))
    history: dict[int, list[str]] = {}
    left: dict[int, int] = {}
    due: list[tuple[float, int]] = []  # (time the user comes back, conversation)
    out: list[Request] = []
    now, made = 0.0, 0
    while len(out) < n:
        # a new conversation about every second request; otherwise the user due soonest speaks again
        if not due or rng.random() < 0.4:
            conv, made = made, made + 1
            history[conv], left[conv] = [], 1 + _geometric(rng, turns - 1)
        else:
            t, conv = heapq.heappop(due)
            now = max(now, t)
        turn = len(history[conv])
        added = tuple(f"chat/{conv}/turn{turn}/{j}" for j in range(rng.choice((1, 1, 1, 2))))
        out.append(Request(f"chat{conv}", system + tuple(history[conv]), added))
        history[conv].extend(added)
        left[conv] -= 1
        now += 1
        if left[conv] > 0:
            heapq.heappush(due, (now + 2 * rng.paretovariate(gap_shape), conv))
        else:
            del history[conv], left[conv]
    return out


def rag(
    n: int,
    seed: int,
    *,
    docs: int = 400,
    chunks: int = 2,
    zipf: float = 0.9,
    drift_every: int = 200,
    drift_share: float = 0.1,
) -> list[Request]:
    """``n`` requests, each reading 3-5 of ``docs`` documents (``chunks`` chunks each) by drifting Zipf popularity."""
    rng = random.Random(seed)
    ranking = list(range(docs))
    rng.shuffle(ranking)
    weights = [1.0 / (rank + 1) ** zipf for rank in range(docs)]
    out: list[Request] = []
    for i in range(n):
        if i and i % drift_every == 0:  # a share of the ranks is taken by other documents
            moved = rng.sample(range(docs), max(2, int(docs * drift_share)))
            picked = [ranking[r] for r in moved]
            rng.shuffle(picked)
            for r, d in zip(moved, picked):
                ranking[r] = d
        chosen: list[int] = []
        while len(chosen) < rng.randint(3, 5):
            d = ranking[rng.choices(range(docs), weights)[0]]
            if d not in chosen:
                chosen.append(d)
        out.append(Request(f"user{rng.randrange(64)}", tuple(k for d in chosen for k in doc_chunks(d, chunks))))
    return out


def agent(
    n: int,
    seed: int,
    *,
    types: int = 4,
    prefix_chunks: int = 6,
    steps: float = 8.0,
    concurrent: int = 48,
) -> list[Request]:
    """``n`` steps of ``concurrent`` interleaved agent sessions; a step reads the prefix and earlier steps."""
    rng = random.Random(seed)
    prefixes = [tuple(f"agent/type{t}/prefix{i}" for i in range(prefix_chunks)) for t in range(types)]
    type_weights = [1.0 / (t + 1) for t in range(types)]
    sessions: dict[int, tuple[int, list[str], int]] = {}  # session -> (type, steps so far, steps left)
    made = 0
    out: list[Request] = []
    while len(out) < n:
        while len(sessions) < concurrent:
            kind = rng.choices(range(types), type_weights)[0]
            sessions[made] = (kind, [], 1 + _geometric(rng, steps - 1))
            made += 1
        s = rng.choice(list(sessions))
        kind, done, left = sessions[s]
        step = tuple(f"agent/{s}/step{len(done)}/{j}" for j in range(rng.choice((1, 1, 2))))
        out.append(Request(f"agent{s}", prefixes[kind] + tuple(done), step))
        done.extend(step)
        if left > 1:
            sessions[s] = (kind, done, left - 1)
        else:
            del sessions[s]
    return out


def uniform(n: int, seed: int, *, docs: int = 400, chunks: int = 2) -> list[Request]:
    """``n`` requests of one uniformly drawn document each."""
    rng = random.Random(seed)
    return [Request(f"user{rng.randrange(64)}", doc_chunks(rng.randrange(docs), chunks)) for _ in range(n)]


def doc_chunks(d: int, chunks: int) -> tuple[str, ...]:
    return tuple(f"doc{d}/chunk{i}" for i in range(chunks))


def pre_stored(trace: list[Request]) -> list[str]:
    """Chunks read before any request adds them (documents, system prompts): stored before the trace runs."""
    added: set[str] = set()
    first: dict[str, None] = {}
    for request in trace:
        for key in request.reads:
            if key not in added:
                first.setdefault(key)
        added.update(request.adds)
    return list(first)


def summary(trace: list[Request]) -> dict[str, int]:
    """Requests, chunk reads, and distinct chunks read or added (the working set, in chunks)."""
    reads = sum(len(r.reads) for r in trace)
    distinct = {k for r in trace for k in (*r.reads, *r.adds)}
    return {"requests": len(trace), "reads": reads, "chunks": len(distinct)}


def _geometric(rng: random.Random, mean: float) -> int:
    """A geometric count >= 0 with the given mean."""
    if mean <= 0:
        return 0
    p = 1.0 / (1.0 + mean)
    count = 0
    while rng.random() > p:
        count += 1
    return count


TRACES: dict[str, Callable[[int, int], list[Request]]] = {"chat": chat, "rag": rag, "agent": agent, "uniform": uniform}
