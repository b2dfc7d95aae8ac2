"""Which stored prefixes tend to come next: a small model of a request stream, fitted online.

A request is named by its *head*, the first of its chunk keys (chunk keys are
prefix-chained, so the turns of one conversation and every prompt opening with
one document share a head). Per namespace the model keeps:

- *transitions*: how often a stream's request with head ``a`` was followed by
  one with another head ``b`` (a stream is a session, a user: whatever orders
  requests; what is learnt from one stream predicts for all streams of the
  namespace), decayed by age in departures from ``a`` (half-life
  ``successor_half_life``): what follows ``a`` ages as ``a`` is left, so a head
  requested once an hour keeps what it taught as well as one requested every
  second. A stream asking for the head it just had (a session continuing on the
  same document or conversation) is no transition: its chunks were just served,
  the tier holds them, there is nothing to warm;
- *popularity*: how often each head was requested, decayed by age in requests of
  that namespace (half-life ``half_life``).

The chance that a stream's next head is ``x``, after a request with head ``h``, is
``λ·P(x | h) + (1 − λ)·B(x)``, with ``λ = n_h / (n_h + prior)`` growing with the
(decayed) number ``n_h`` of transitions seen out of ``h``: a head seen rarely is
predicted mostly by ``B``, what the namespace as a whole says:

- for ``h``'s likeliest successor so far, the namespace's *foresight*: how often
  (decayed, in requests) a head was left for its likeliest successor, over all
  heads (``f / (tries + prior)``). In a namespace whose streams follow their paths
  (documents read in sequence) one sighting of ``h -> x`` is then evidence enough
  to warm ``x``; in one whose requests follow no path it stays near 0, and a
  transition seen once predicts nothing;
- for the other candidates (or if higher), popularity ``P(x)``.

(Without foresight ``λ·P(x | h)`` is ``c / (n_h + prior)`` for a transition seen ``c``
times: with the defaults, one sighting (0.2) is not enough to predict ``x``, two in
a row (0.33) are.) Candidates are ``h``'s successors and the most popular heads;
those at or above ``min_probability`` are returned, likeliest first.

Cost: ``observe`` and ``predict`` are O(``max_successors`` + ``popular``); memory is
bounded by ``max_heads`` heads per namespace (least recently requested forgotten
first), ``max_successors`` successors per head and ``max_streams`` streams.
No I/O and no clock: ages are counted in requests, so the model is deterministic.

Each count is kept as a *weight* on its clock's current scale (forward decay): a
tick multiplies the clock's scale by ``1 / factor``, an event adds the scale to
its count, and a count is its weight over the scale. Counts on one clock compare
and divide as their weights, so neither call raises a factor to a power, and a
count is one float (``observe`` and ``predict`` run right after a request's I/O,
when little of the model is in the CPU's caches: the fewer objects and operations
they touch, the less they cost). When a scale passes ``2**_RESCALE_BITS`` its
clock's weights are divided by it and it starts again at 1 (every few thousand
ticks: O(heads) for a namespace, O(``max_successors``) for a head).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmem.errors import ConfigError

__all__ = ["Prediction", "RequestPatterns"]

_RESCALE_BITS = 256
_RESCALE_AT = 2.0**_RESCALE_BITS  # a scale past it is brought back to 1 (a weight stays below ~2**266)


@dataclass(frozen=True)
class Prediction:
    """A head the model expects next.

    Attributes:
        head: its first chunk key.
        keys: the chunk keys of the last request seen with this head (what to warm).
        probability: the model's estimate that the stream's next request has this head.
    """

    head: str
    keys: tuple[str, ...]
    probability: float


class _Head:
    """One head: its keys, its popularity (on the namespace's clock), and what followed it (on its own)."""

    __slots__ = ("keys", "seen", "scale", "out", "successors", "likeliest")

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.seen = 0.0  # requests with this head, a weight on the namespace's scale
        self.scale = 1.0  # of this head's clock: it ticks once per transition out of it
        self.out = 0.0  # transitions out of this head, a weight on its scale
        self.successors: dict[str, float] = {}  # head -> transitions to it, weights on this head's scale
        self.likeliest: str | None = None  # the successor seen most (decayed; of equals, the latest)

    def tick(self, growth: float) -> None:
        """One more transition out of this head: its clock ticks (its weights rescaled when due)."""
        if self.scale > _RESCALE_AT:
            self.out /= self.scale
            for successor in self.successors:
                self.successors[successor] /= self.scale
            self.scale = 1.0
        self.scale *= growth


@dataclass(slots=True)
class _Space:
    """One namespace's model; ``total`` ... ``peak`` are weights on its clock's ``scale``."""

    scale: float = 1.0  # of the namespace's clock: it ticks once per request
    total: float = 0.0  # requests
    tries: float = 0.0  # transitions out of a head with a successor already
    foreseen: float = 0.0  # ... to its likeliest successor
    floor: float = 0.0  # at most the least popular head's count, once full
    peak: float = 0.0  # at least the most requested head's count
    heads: OrderedDict[str, _Head] = field(default_factory=OrderedDict)  # least recently requested first
    popular: set[str] = field(default_factory=set)
    last: OrderedDict[str, str] = field(default_factory=OrderedDict)  # stream -> its last head

    def tick(self, growth: float) -> None:
        """One more request: the clock ticks (its weights rescaled when due)."""
        if self.scale > _RESCALE_AT:
            s = self.scale
            self.total, self.tries, self.foreseen, self.floor, self.peak = (
                self.total / s,
                self.tries / s,
                self.foreseen / s,
                self.floor / s,
                self.peak / s,
            )
            for node in self.heads.values():
                node.seen /= s
            self.scale = 1.0
        self.scale *= growth


class RequestPatterns:
    """Decayed transition counts between consecutive heads of a stream, and decayed popularity, per namespace.

    Args:
        half_life: requests (of one namespace) after which a request weighs half in popularity.
        successor_half_life: transitions out of a head after which one weighs half.
        min_probability: predictions below this are not returned (a structureless stream yields none).
        prior: transitions out of a head needed before they weigh as much as popularity.
        max_heads: heads remembered per namespace.
        max_successors: successors remembered per head (the least likely forgotten).
        popular: how many of the most popular heads are candidates.
        max_streams: streams whose last head is remembered per namespace.

    Raises:
        ConfigError: a parameter outside its range (named, with what is accepted).

    NOTE: not thread-safe; one thread observes and predicts (the prefetcher's worker).
    """

    def __init__(
        self,
        *,
        half_life: float = 512.0,
        successor_half_life: float = 16.0,
        min_probability: float = 0.3,
        prior: float = 4.0,
        max_heads: int = 4096,
        max_successors: int = 8,
        popular: int = 8,
        max_streams: int = 4096,
    ) -> None:
        if not half_life >= 1:
            raise ConfigError(f"half_life={half_life!r}: accepted a number of requests >= 1")
        if not successor_half_life >= 1:
            raise ConfigError(f"successor_half_life={successor_half_life!r}: accepted a number of transitions >= 1")
        if not 0.0 < min_probability <= 1.0:
            raise ConfigError(f"min_probability={min_probability!r}: accepted a probability in (0, 1]")
        if not prior > 0:
            raise ConfigError(f"prior={prior!r}: accepted a number > 0")
        for name, value in (("max_heads", max_heads), ("max_successors", max_successors)):
            if value < 1:
                raise ConfigError(f"{name}={value!r}: accepted an integer >= 1")
        for name, value in (("popular", popular), ("max_streams", max_streams)):
            if value < 0:
                raise ConfigError(f"{name}={value!r}: accepted an integer >= 0")
        self.growth = 2.0 ** (1.0 / half_life)  # a tick of a namespace's clock multiplies its scale by this
        self.successor_growth = 2.0 ** (1.0 / successor_half_life)  # ... of a head's clock
        self.min_probability = min_probability
        self.prior = prior
        self.max_heads = max_heads
        self.max_successors = max_successors
        self.max_popular = popular
        self.max_streams = max_streams
        self._spaces: dict[str, _Space] = {}

    def observe(self, namespace: str, keys: Sequence[str], stream: str = "") -> None:
        """Learn from one request: its chunk keys (``keys[0]`` is its head), in ``namespace``, of ``stream``.

        A request with no keys (shorter than one chunk) teaches nothing.
        """
        if not keys:
            return
        space = self._spaces.get(namespace)
        if space is None:  # NOTE: not setdefault, which would build a _Space on every request
            space = self._spaces[namespace] = _Space()
        space.tick(self.growth)
        head = keys[0]
        node = self._head(space, head, tuple(keys))
        node.seen += space.scale
        space.total += space.scale
        if node.seen > space.peak:
            space.peak = node.seen
        previous = space.last.get(stream)
        space.last[stream] = head
        space.last.move_to_end(stream)
        if len(space.last) > self.max_streams:
            space.last.popitem(last=False)
        if previous is not None and previous != head:
            source = space.heads.get(previous)
            if source is not None:
                self._transition(space, source, head)
        self._rank(space, head, node)

    def predict(self, namespace: str, stream: str = "", limit: int = 4) -> list[Prediction]:
        """The heads ``stream``'s next request in ``namespace`` likely opens with, likeliest first.

        Args:
            namespace: as observed.
            stream: as observed; a stream never seen is predicted by popularity alone.
            limit: most predictions returned.

        Returns:
            Up to ``limit`` predictions with probability ≥ ``min_probability`` (none for an unknown namespace).
        """
        space = self._spaces.get(namespace)
        if space is None:
            return []
        total = space.total
        peak = space.peak / total if total else 0.0  # no head has a larger share of requests
        # a head that is only popular scores at most its share of requests, so at most the peak's share
        popular = space.popular if peak >= self.min_probability else set()
        last = space.heads.get(space.last.get(stream, ""))
        if last is None or last.likeliest is None:
            out, after, likeliest, weight, foresight = 0.0, {}, None, 0.0, 0.0
        else:
            out, likeliest, after = last.out, last.likeliest, last.successors
            transitions = out / last.scale
            weight = transitions / (transitions + self.prior)
            foresight = space.foreseen / (space.tries + self.prior * space.scale)
            best = after[likeliest] / out
            if not popular and weight * best + (1.0 - weight) * max(foresight, peak) < self.min_probability:
                return []  # NOTE: no successor can score more: the common case where nothing can be learnt
        scored = []
        for head in popular | after.keys():
            node = space.heads.get(head)
            if node is None:
                continue
            p_next = after.get(head, 0.0) / out if out else 0.0
            p_pop = node.seen / total if total else 0.0
            base = max(foresight, p_pop) if head == likeliest else p_pop
            p = weight * p_next + (1.0 - weight) * base
            if p >= self.min_probability:
                scored.append(Prediction(head, node.keys, p))
        scored.sort(key=lambda pred: (-pred.probability, pred.head))
        return scored[:limit]

    # -- internals ---------------------------------------------------------------
    def _head(self, space: _Space, head: str, keys: tuple[str, ...]) -> _Head:
        """``head``'s node, created (forgetting the least recently requested head past ``max_heads``) or
        moved to most recent, its keys replaced by this request's."""
        node = space.heads.get(head)
        if node is None:
            if len(space.heads) >= self.max_heads:
                gone, _ = space.heads.popitem(last=False)
                space.popular.discard(gone)
            node = space.heads[head] = _Head(keys)
        else:
            node.keys = keys
            space.heads.move_to_end(head)
        return node

    def _transition(self, space: _Space, source: _Head, head: str) -> None:
        """Count ``source -> head`` (and whether the likeliest successor foresaw it); past ``max_successors``,
        the least likely successor is forgotten."""
        if source.likeliest is not None:
            space.tries += space.scale
            if head == source.likeliest:
                space.foreseen += space.scale
        source.tick(self.successor_growth)
        source.out += source.scale
        successors = source.successors
        count = successors.get(head)
        if count is None:
            if len(successors) >= self.max_successors:
                weakest = min(successors, key=successors.__getitem__)
                del successors[weakest]
                if weakest == source.likeliest:  # all were equal: the new one is the latest
                    source.likeliest = None
            count = 0.0
        count = successors[head] = count + source.scale
        # every successor decays alike: only the one just counted can overtake the likeliest
        if source.likeliest is None or count >= successors.get(source.likeliest, 0.0):
            source.likeliest = head

    def _rank(self, space: _Space, head: str, node: _Head) -> None:
        """Keep ``space.popular`` the ``popular`` heads requested most (decayed), ``head`` just requested."""
        if head in space.popular or not self.max_popular:
            return
        if len(space.popular) >= self.max_popular:
            if node.seen <= space.floor:  # NOTE: the common case, decided without looking at each
                return
            weakest = min(space.popular, key=lambda h: space.heads[h].seen)
            if node.seen <= space.heads[weakest].seen:
                space.floor = space.heads[weakest].seen
                return
            space.popular.discard(weakest)
        space.popular.add(head)
        if len(space.popular) >= self.max_popular:  # every count only grows against the common decay
            space.floor = min(space.heads[h].seen for h in space.popular)
