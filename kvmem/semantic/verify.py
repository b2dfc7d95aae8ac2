"""The strict second stage: reject near misses that cosine similarity cannot separate.

Measured with all-MiniLM-L6-v2, "Is the store open on Sunday?" and "... closed ..."
score 0.95, "How do I convert miles to kilometers?" and its reverse 1.00: no
threshold separates them from paraphrases (0.4-0.99). So a candidate that passes
the threshold must also pass :func:`reason`, five cheap rules over both texts'
tokens (contractions split, possessives dropped, words stemmed with Snowball):

1. **protected**: numbers (digits or number words, "five-year-old" included,
   bound to a unit that follows into one quantity, "10 mile"), negations (not,
   never, n't, ... all one ``<neg>``) and likely names (a capitalized word that
   does not start a sentence, or a word with digits like "2FA") must each occur
   in the other text too. **unit**: each text names a unit the other lacks.
2. **opposite**: one text gains a word and the other its opposite: open/closed,
   in/out, cheap/pricey, ... (a lexicon of pairs) or a prefix negation
   (lock/unlock, legal/illegal). A polar word on one side only ("the *best* way
   to brew tea") is not an opposite.
3. **order**: the same content words in another order ("Did Brazil beat
   Germany?" / "Did Germany beat Brazil?"); "A of B" reads as "B A", and a
   phrase moved from the front to the back ("In Java, ..." / "... in Java") is
   not a reorder.
4. **substitution**: the texts are equal but for one block of one or two content
   words ("... toxic to cats?" / "... toxic to dogs?"): when everything else is
   the same, that block is what the question asks about. Synonym swaps
   ("make"/"create") are rejected too: the rules cannot tell them apart from
   co-hyponyms, and a miss is cheaper than a wrong answer.
5. **direction**: a word that follows "from" (or precedes "to" when there is no
   "from") in one text and follows "to"/"into" in the other.

Measured by ``benchmarks/bench_semantic.py`` on three sets: a development set
the rules were written against, a held-out set and a blind set (see their
generators under ``benchmarks/data/`` for how each was used). Known gaps:
synonyms among protected tokens ("US"/"United States", "Mac"/"macOS"); a name
typed in lower case that differs in more than two words; opposites outside the
lexicon ("antagonist"/"protagonist"). It errs strict: a rejected paraphrase is a
cache miss, a wrong answer is never returned knowingly.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

__all__ = ["Analysis", "RuleVerifier", "Verifier", "analyze", "differs", "reason"]

_TOKEN = re.compile(r"n't|\d+(?:[.,]\d+)*(?![A-Za-z])|\w*\d\w*|[A-Za-z][A-Za-z'-]*")
_CONTRACTION = re.compile(r"(?i)\b([a-z]+)n't\b")
_POSSESSIVE = re.compile(r"(?:'s|')$")
_NEGATIONS = frozenset(
    {"not", "no", "never", "n't", "none", "nobody", "nothing", "neither", "nor", "without", "cannot", "nowhere"}
)
_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}
_NUMBER_WORDS.update(
    {
        "thirty": "30",
        "forty": "40",
        "fifty": "50",
        "hundred": "100",
        "thousand": "1000",
        "million": "1000000",
        "billion": "1000000000",
    }
)
_UNITS = {
    "km": "km",
    "kilometer": "km",
    "kilometre": "km",
    "mi": "mile",
    "mile": "mile",
    "m": "m",
    "meter": "m",
    "metre": "m",
    "cm": "cm",
    "centimeter": "cm",
    "centimetre": "cm",
    "mm": "mm",
    "millimeter": "mm",
    "ft": "foot",
    "foot": "foot",
    "feet": "foot",
    "inch": "inch",
    "inches": "inch",
    "yard": "yard",
    "kg": "kg",
    "kilogram": "kg",
    "kilo": "kg",
    "g": "g",
    "gram": "g",
    "mg": "mg",
    "milligram": "mg",
    "lb": "lb",
    "lbs": "lb",
    "pound": "lb",
    "ounce": "oz",
    "oz": "oz",
    "ton": "ton",
    "tonne": "ton",
    "l": "l",
    "liter": "l",
    "litre": "l",
    "ml": "ml",
    "milliliter": "ml",
    "gallon": "gallon",
    "pint": "pint",
    "tablespoon": "tbsp",
    "tbsp": "tbsp",
    "teaspoon": "tsp",
    "tsp": "tsp",
    "celsius": "celsius",
    "fahrenheit": "fahrenheit",
    "kelvin": "kelvin",
    "percent": "percent",
    "second": "second",
    "minute": "minute",
    "hour": "hour",
    "hourly": "hour",
    "day": "day",
    "daily": "day",
    "week": "week",
    "weekly": "week",
    "month": "month",
    "monthly": "month",
    "year": "year",
    "yearly": "year",
    "annual": "year",
    "annually": "year",
    "quart": "quart",
    "acre": "acre",
    "hectare": "hectare",
    "usd": "usd",
    "dollar": "usd",
    "eur": "eur",
    "euro": "eur",
    "yen": "jpy",
    "gbp": "gbp",
    "sterling": "gbp",
    "gb": "gb",
    "gigabyte": "gb",
    "mb": "mb",
    "megabyte": "mb",
    "kb": "kb",
    "kilobyte": "kb",
    "tb": "tb",
    "terabyte": "tb",
    "mph": "mph",
    "kmh": "kmh",
    "watt": "watt",
    "volt": "volt",
    "calorie": "calorie",
    "kcal": "calorie",
}
# "what year" / "which day" ask "when": the unit there is not a quantity
_WHEN_WORDS = frozenset({"what", "which"})
_OPPOSITES = [
    ("open", "close"),
    ("opened", "closed"),
    ("on", "off"),
    ("in", "out"),
    ("up", "down"),
    ("before", "after"),
    ("increase", "decrease"),
    ("increase", "reduce"),
    ("more", "less"),
    ("more", "fewer"),
    ("most", "least"),
    ("minimum", "maximum"),
    ("min", "max"),
    ("minimize", "maximize"),
    ("buy", "sell"),
    ("bought", "sold"),
    ("hot", "cold"),
    ("warm", "cool"),
    ("start", "end"),
    ("begin", "end"),
    ("start", "finish"),
    ("allow", "deny"),
    ("allow", "forbid"),
    ("accept", "reject"),
    ("accept", "decline"),
    ("approve", "reject"),
    ("approve", "deny"),
    ("true", "false"),
    ("win", "lose"),
    ("won", "lost"),
    ("add", "remove"),
    ("add", "subtract"),
    ("multiply", "divide"),
    ("include", "exclude"),
    ("above", "below"),
    ("over", "under"),
    ("high", "low"),
    ("higher", "lower"),
    ("highest", "lowest"),
    ("raise", "lower"),
    ("large", "small"),
    ("larger", "smaller"),
    ("big", "small"),
    ("bigger", "smaller"),
    ("biggest", "smallest"),
    ("largest", "smallest"),
    ("long", "short"),
    ("longer", "shorter"),
    ("longest", "shortest"),
    ("fast", "slow"),
    ("faster", "slower"),
    ("fastest", "slowest"),
    ("quick", "slow"),
    ("best", "worst"),
    ("better", "worse"),
    ("good", "bad"),
    ("first", "last"),
    ("input", "output"),
    ("import", "export"),
    ("inside", "outside"),
    ("upload", "download"),
    ("login", "logout"),
    ("push", "pull"),
    ("arrive", "depart"),
    ("arrival", "departure"),
    ("north", "south"),
    ("east", "west"),
    ("left", "right"),
    ("cheap", "expensive"),
    ("cheapest", "expensive"),
    ("young", "old"),
    ("younger", "older"),
    ("youngest", "oldest"),
    ("new", "old"),
    ("light", "dark"),
    ("light", "heavy"),
    ("wet", "dry"),
    ("full", "empty"),
    ("early", "late"),
    ("earlier", "later"),
    ("earliest", "latest"),
    ("easy", "hard"),
    ("easy", "difficult"),
    ("safe", "dangerous"),
    ("pro", "con"),
    ("enable", "disable"),
    ("start", "stop"),
    ("allow", "block"),
    ("lock", "unlock"),
    ("positive", "negative"),
    ("plus", "minus"),
    ("encrypt", "decrypt"),
    ("encode", "decode"),
    ("charge", "drain"),
    ("gain", "lose"),
    ("gain", "loss"),
    ("profit", "loss"),
    ("rise", "fall"),
    ("attach", "detach"),
    ("enter", "exit"),
    ("send", "receive"),
    ("give", "take"),
    ("borrow", "lend"),
    ("private", "public"),
    ("male", "female"),
    ("man", "woman"),
    ("upper", "lower"),
    ("uppercase", "lowercase"),
    ("strength", "weakness"),
    ("day", "night"),
    ("morning", "evening"),
    ("summer", "winter"),
    ("sunrise", "sunset"),
    ("past", "future"),
    ("yesterday", "tomorrow"),
    ("always", "never"),
    ("upgrade", "downgrade"),
    ("ascending", "descending"),
    ("forward", "backward"),
    ("front", "back"),
    ("top", "bottom"),
    ("inner", "outer"),
    ("internal", "external"),
    ("expand", "collapse"),
    ("show", "hide"),
    ("visible", "hidden"),
    ("online", "offline"),
    ("join", "leave"),
    ("hire", "fire"),
    ("debit", "credit"),
    ("deposit", "withdraw"),
    ("success", "failure"),
    ("pass", "fail"),
    ("asleep", "awake"),
    ("inbound", "outbound"),
    ("inhale", "exhale"),
    ("overweight", "underweight"),
    ("hotter", "colder"),
    ("hottest", "coldest"),
    ("warm", "cold"),
    ("warmer", "colder"),
    ("warmest", "coldest"),
    ("cheap", "pricey"),
    ("cheaper", "pricier"),
    ("cheapest", "priciest"),
    ("wide", "narrow"),
    ("thick", "thin"),
    ("deep", "shallow"),
    ("strong", "weak"),
]
_ABBREVIATIONS = frozenset(
    {
        "dr",
        "mr",
        "mrs",
        "ms",
        "prof",
        "st",
        "jr",
        "sr",
        "vs",
        "mt",
        "ft",
        "no",
        "approx",
        "dept",
        "inc",
        "ltd",
        "co",
        "corp",
        "gen",
        "capt",
        "sgt",
        "rev",
        "hon",
    }
)
_ARTICLES = frozenset({"a", "an", "the"})
_NEGATING_PREFIXES = ("un", "dis", "in", "im", "il", "ir", "non", "de", "anti")
_STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "what",
        "which",
        "who",
        "whom",
        "whose",
        "when",
        "where",
        "why",
        "how",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "am",
        "do",
        "does",
        "did",
        "doing",
        "done",
        "can",
        "could",
        "should",
        "would",
        "will",
        "shall",
        "may",
        "might",
        "must",
        "i",
        "you",
        "he",
        "she",
        "it",
        "we",
        "they",
        "my",
        "your",
        "his",
        "her",
        "its",
        "our",
        "their",
        "me",
        "him",
        "us",
        "them",
        "mine",
        "yours",
        "this",
        "that",
        "these",
        "those",
        "there",
        "here",
        "in",
        "on",
        "at",
        "of",
        "to",
        "for",
        "from",
        "by",
        "with",
        "about",
        "into",
        "onto",
        "and",
        "or",
        "but",
        "if",
        "then",
        "so",
        "as",
        "than",
        "please",
        "tell",
        "give",
        "show",
        "explain",
        "list",
        "find",
        "way",
        "ways",
        "get",
        "got",
        "any",
        "some",
        "let",
        "know",
        "want",
        "need",
        "like",
        "just",
        "also",
        "really",
        "very",
        "there's",
        "it's",
        "i'm",
        "i've",
        "i'd",
        "you're",
        "let's",
        "whats",
        "hows",
        "wheres",
        "whos",
        "im",
        "ive",
        "youre",
        "theres",
    ]
)


class Verifier(Protocol):
    """Decides whether a candidate text may answer a query text."""

    def accepts(self, query: str, candidate: str) -> bool:
        """Whether ``candidate`` (already above the threshold) is a hit for ``query``."""
        ...


@dataclass(frozen=True)
class Analysis:
    """The tokens of one text that :func:`reason` compares.

    Attributes:
        protected: numbers/quantities, ``<neg>`` and likely names.
        units: units not bound to a number ("convert *miles* to km").
        vocabulary: every normalized token and its stem (what "occurs in the text" means).
        stems: stem counts of all words (for opposites).
        words: counts of all normalized words (for prefix negations, before stemming).
        content: stems of the content words in order (function words and negations left out).
        roles: content stem -> ``"src"`` / ``"dst"`` as placed by from/to/into.
    """

    protected: frozenset[str]
    units: frozenset[str]
    vocabulary: frozenset[str]
    stems: Counter[str]
    words: Counter[str]
    content: tuple[str, ...]
    roles: dict[str, frozenset[str]]


@lru_cache(maxsize=1)
def _stemmer() -> Any:
    """The Snowball English stemmer (imported here: ``kvmem.semantic`` imports without the extra)."""
    import snowballstemmer

    return snowballstemmer.stemmer("english")


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    return _stemmer().stemWord(word)


def _unit(word: str) -> str | None:
    """The canonical unit ``word`` names (plural ``s`` stripped), or ``None``."""
    low = word.lower()
    return _UNITS.get(low) or (_UNITS.get(low[:-1]) if low.endswith("s") and len(low) > 2 else None)


def _words(text: str) -> tuple[list[str], list[bool]]:
    """Raw tokens of ``text`` and, per token, whether it starts a sentence."""
    # split contractions ("don't" -> "do n't") before tokenizing, or the negation hides inside a word
    text = _CONTRACTION.sub(r"\1 n't", text)
    matches = list(_TOKEN.finditer(text))
    raw = [_POSSESSIVE.sub("", m.group()) or m.group() for m in matches]  # "France's" names France
    gaps = [text[: matches[0].start()] if matches else ""] + [
        text[a.end() : b.start()] for a, b in itertools.pairwise(matches)
    ]
    # hyphenated numbers are numbers ("five-year-old" -> five year old); other hyphens stay ("wi-fi")
    split_raw: list[str] = []
    split_gaps: list[str] = []
    for word, gap in zip(raw, gaps):
        parts = word.split("-")
        if len(parts) > 1 and any(p.lower() in _NUMBER_WORDS or p.isdigit() for p in parts):
            split_raw += [p for p in parts if p]
            split_gaps += [gap] + ["-"] * (len([p for p in parts if p]) - 1)
        else:
            split_raw.append(word)
            split_gaps.append(gap)
    initial = [
        i == 0 or any(c in "?!:" for c in gap) or ("." in gap and split_raw[i - 1].lower() not in _ABBREVIATIONS)
        for i, gap in enumerate(split_gaps)
    ]
    return split_raw, initial


@lru_cache(maxsize=16384)
def analyze(text: str) -> Analysis:
    """Tokenize and normalize ``text`` for :func:`reason` (cached: stored texts are compared often)."""
    raw, initial = _words(text)
    # Title Case Text capitalizes function words too ("How Do I Reset My Password"): capitals name nothing
    title_case = (
        sum(w[0].isupper() and w.lower() in _STOPWORDS and w != "I" and not first for w, first in zip(raw, initial))
        >= 2
    )
    protected: set[str] = set()
    units: set[str] = set()
    vocab: set[str] = set()
    stems: Counter[str] = Counter()
    words: Counter[str] = Counter()
    ordered: list[tuple[str, bool]] = []  # (token, is content)
    i = 0
    while i < len(raw):
        word, low = raw[i], raw[i].lower()
        number = (
            low.replace(",", "")
            if low[0].isdigit() and low.replace(",", "").replace(".", "").isdigit()
            else _NUMBER_WORDS.get(low)
        )
        if number is not None:
            nxt = _unit(raw[i + 1]) if i + 1 < len(raw) else None
            token = f"{number} {nxt}" if nxt else number
            i += 2 if nxt else 1
            protected.add(token)
            vocab.add(token)
            ordered.append((token, True))
            continue
        unit = _unit(word)
        if low in _NEGATIONS:
            token, content = "<neg>", False
            protected.add(token)
        elif unit is not None and not (i > 0 and raw[i - 1].lower() in _WHEN_WORDS):
            token, content = unit, True
            units.add(token)
        else:
            token = low
            content = low not in _STOPWORDS and unit is None
            if any(c.isdigit() for c in low) or (
                word[0].isupper() and not initial[i] and not title_case and low not in _STOPWORDS
            ):
                protected.add(token)
        stem = _stem(token.replace("-", ""))  # "wi-fi" is "wifi"
        vocab.update((token, stem, token.replace("-", "")))
        if token in _ARTICLES and token != "the":
            vocab.add("1")  # "a banana" is "one banana"
        stems[stem] += 1
        words[token] += 1
        ordered.append((stem, content))
        i += 1
    content_stems = _content_order(ordered)
    return Analysis(
        frozenset(protected), frozenset(units), frozenset(vocab), stems, words, content_stems, _roles(ordered)
    )


def _content_order(ordered: list[tuple[str, bool]]) -> tuple[str, ...]:
    """Content words in order, each "A of B" read as "B A" (so "ceiling of the chapel" = "chapel ceiling")."""
    out: list[str] = []
    run = 0  # content words at the end of ``out`` not separated by a function word
    i = 0
    while i < len(ordered):
        token, content = ordered[i]
        if token == "of" and run:
            j = i + 1
            while j < len(ordered) and ordered[j][0] in _ARTICLES:
                j += 1
            tail = []
            while j < len(ordered) and ordered[j][1]:
                tail.append(ordered[j][0])
                j += 1
            if tail:
                out[len(out) - run : len(out) - run] = tail
                run += len(tail)
                i = j
                continue
        if content:
            out.append(token)
            run += 1
        else:
            run = 0
        i += 1
    return tuple(out)


def _roles(ordered: list[tuple[str, bool]]) -> dict[str, frozenset[str]]:
    """Place content words as sources or destinations of from/to/into."""
    tokens = [t for t, _ in ordered]
    has_from = "from" in tokens
    roles: dict[str, set[str]] = {}

    def place(start: int, step: int, role: str) -> None:
        j = start
        while 0 <= j < len(ordered):
            if ordered[j][1]:
                roles.setdefault(ordered[j][0], set()).add(role)
                return
            if ordered[j][0] in ("from", "to", "into"):
                return
            j += step

    for i, token in enumerate(tokens):
        if token == "from":
            place(i + 1, 1, "src")
        elif token in ("to", "into"):
            place(i + 1, 1, "dst")
            if not has_from:
                place(i - 1, -1, "src")
    return {k: frozenset(v) for k, v in roles.items()}


@lru_cache(maxsize=1)
def _opposite_stems() -> list[tuple[str, str]]:
    return [(_stem(a), _stem(b)) for a, b in _OPPOSITES]


def _gain(q: Counter[str], c: Counter[str]) -> dict[str, int]:
    """How many more times each token occurs in ``q`` than in ``c`` (nonzero only)."""
    return {w: q[w] - c[w] for w in q.keys() | c.keys() if q[w] != c[w]}


def _opposite(q: Analysis, c: Analysis) -> str | None:
    """A word one text gains while the other gains its opposite, as ``"a/b"``; else ``None``."""
    gain = _gain(q.stems, c.stems)
    for a, b in _opposite_stems():
        if gain.get(a, 0) * gain.get(b, 0) < 0:
            return f"{a}/{b}"
    gain = _gain(q.words, c.words)
    for word, d in gain.items():
        for prefix in _NEGATING_PREFIXES:
            base = word[len(prefix) :]
            if word.startswith(prefix) and len(base) >= 3 and gain.get(base, 0) * d < 0:
                return f"{base}/{word}"
    return None


def _occurs(token: str, vocabulary: frozenset[str]) -> bool:
    """Whether ``token`` or a morphological variant of a name ("Pythagoras"/"Pythagorean") is in ``vocabulary``."""
    if token in vocabulary or token.replace("-", "") in vocabulary:
        return True
    if len(token) < 6 or not token.isalpha():
        return False
    # 80 % of the shorter word and at least 6 letters: Austria/Australia and Java/JavaScript stay apart
    return any(
        len(other) >= 6
        and other.isalpha()
        and len(os.path.commonprefix([token, other])) >= 0.8 * min(len(token), len(other))
        for other in vocabulary
    )


def _rotated(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether ``b`` is ``a`` with a leading block moved to the end ("In Java, how ..." / "How ... in Java")."""
    return len(a) > 2 and any(a[k:] + a[:k] == b for k in range(1, len(a)))


def _substitution(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, str] | None:
    """The one block of at most two content words ``b`` puts in place of ``a``'s, the rest equal; else ``None``."""
    start = len(os.path.commonprefix([a, b]))
    end = len(os.path.commonprefix([a[start:][::-1], b[start:][::-1]]))
    x, y = a[start : len(a) - end], b[start : len(b) - end]
    if not x or not y or len(x) > 2 or len(y) > 2 or start + end < 2:
        return None
    x_word, y_word = " ".join(x), " ".join(y)
    if len(x) == len(y) == 1 and len(os.path.commonprefix([x_word, y_word])) >= max(
        4, 0.8 * min(len(x_word), len(y_word))
    ):
        return None  # the same word in another form ("game"/"gameplay")
    return x_word, y_word


def reason(query: str, candidate: str) -> str | None:
    """Why ``candidate`` may not answer ``query`` (e.g. ``"opposite: open/close"``), or ``None`` if it may.

    The rule names (the text before ``:``) are ``protected``, ``unit``, ``opposite``, ``order``,
    ``substitution`` and ``direction``; see the module docstring.
    """
    q, c = analyze(query), analyze(candidate)
    missing = sorted(
        {t for t in q.protected if not _occurs(t, c.vocabulary)}
        | {t for t in c.protected if not _occurs(t, q.vocabulary)}
    )
    if missing:
        return f"protected: {', '.join(missing)}"
    q_units, c_units = q.units - c.vocabulary, c.units - q.vocabulary
    if q_units and c_units:
        return f"unit: {', '.join(sorted(q_units))} / {', '.join(sorted(c_units))}"
    opposite = _opposite(q, c)
    if opposite is not None:
        return f"opposite: {opposite}"
    if q.content != c.content and Counter(q.content) == Counter(c.content) and not _rotated(q.content, c.content):
        return f"order: {' '.join(q.content)} / {' '.join(c.content)}"
    swapped = _substitution(q.content, c.content)
    if swapped is not None:
        return f"substitution: {swapped[0]}/{swapped[1]}"
    for word in q.roles.keys() & c.roles.keys():
        if not q.roles[word] & c.roles[word]:
            return f"direction: {word}"
    return None


def differs(query: str, candidate: str) -> bool:
    """Whether :func:`reason` rejects ``candidate`` for ``query``."""
    return reason(query, candidate) is not None


class RuleVerifier:
    """The default :class:`Verifier`: accept unless :func:`reason` finds a difference."""

    def accepts(self, query: str, candidate: str) -> bool:
        """See :meth:`Verifier.accepts`."""
        return reason(query, candidate) is None
