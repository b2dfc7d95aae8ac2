"""The strict second stage: reject near misses that cosine similarity cannot separate.

Measured with all-MiniLM-L6-v2, "Is the store open on Sunday?" and "... closed ..."
score 0.95, "How many km is 10 miles?" and "How many miles is 10 km?" 0.99: no
threshold separates them from paraphrases (0.93-0.99). So a candidate that passes
the threshold must also agree with the query on its *protected tokens*.

The rule (:func:`differs`): tokenize both texts; a token is *protected* when it is

- a number (digits, or a number word up to twenty, hundred, thousand, million),
  bound to a unit that directly follows it into one quantity token ("10 mile");
- a unit (km, miles, kg, ...; plural and spelled-out forms normalized);
- a polar word (open/closed, before/after, up/down, ... a small lexicon);
- a capitalized word that is not a function word and does not start a sentence
  (a likely named entity: "France", "Python", "Alice"); case is compared folded.

Contractions are split first ("don't" -> "do n't"), and a possessive ``'s`` or a
trailing apostrophe is dropped ("France's" names France).
Negation words (not, no, never, n't, ...) collapse into one ``<neg>`` token, so
"not" and "never" agree but "include" and "not include" do not. The candidate is
rejected when some token protected in either text is missing from the other.

Known gaps (first cut): synonyms among protected tokens ("US"/"United States"),
argument order of a relation without numbers or units ("A beat B" / "B beat A"),
an entity that only ever starts a sentence ("France is ..." vs "Germany is ..."),
antonyms outside the lexicon. It errs strict: a paraphrase that swaps a unit's
spelling outside the normalization map is rejected, never a wrong answer returned.
"""

from __future__ import annotations

import itertools
import re
from typing import Protocol

__all__ = ["ProtectedTokenVerifier", "Verifier", "differs", "protected_tokens"]

_TOKEN = re.compile(r"n't|\d+(?:[.,]\d+)*|[A-Za-z][A-Za-z'-]*")
_CONTRACTION = re.compile(r"(?i)\b([a-z]+)n't\b")
_POSSESSIVE = re.compile(r"(?:'s|')$")
_NEGATIONS = frozenset({"not", "no", "never", "n't", "none", "nobody", "nothing", "neither", "nor", "without",
                        "cannot", "nowhere"})
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"])}
_NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "hundred": "100", "thousand": "1000",
                      "million": "1000000", "billion": "1000000000"})
_UNITS = {
    "km": "km", "kilometer": "km", "kilometre": "km", "mi": "mile", "mile": "mile", "m": "m", "meter": "m",
    "metre": "m", "cm": "cm", "mm": "mm", "ft": "foot", "foot": "foot", "feet": "foot", "inch": "inch",
    "inches": "inch", "yard": "yard", "kg": "kg", "kilogram": "kg", "g": "g", "gram": "g", "lb": "lb",
    "lbs": "lb", "pound": "lb", "ounce": "oz", "oz": "oz", "l": "l", "liter": "l", "litre": "l", "ml": "ml",
    "gallon": "gallon", "celsius": "celsius", "fahrenheit": "fahrenheit", "kelvin": "kelvin",
    "percent": "percent", "second": "second", "minute": "minute", "hour": "hour", "day": "day", "week": "week",
    "month": "month", "year": "year", "usd": "usd", "dollar": "usd", "eur": "eur", "euro": "eur",
    "gb": "gb", "mb": "mb", "kb": "kb", "tb": "tb", "mph": "mph", "kmh": "kmh",
}
_POLAR = frozenset(["open", "opened", "opening", "closed", "close", "closing", "off", "before", "after", "up", "down", "increase", "decrease", "increased", "decreased", "more", "less", "most", "least", "minimum", "maximum", "min", "max", "buy", "sell", "bought", "sold", "hot", "cold", "start", "stop", "enable", "disable", "enabled", "disabled", "allow", "deny", "allowed", "denied", "accept", "reject", "accepted", "rejected", "true", "false", "yes", "win", "lose", "won", "lost", "add", "remove", "added", "removed", "include", "exclude", "included", "excluded", "above", "below", "over", "under", "higher", "lower", "high", "low", "larger", "smaller", "bigger", "longest", "shortest", "fastest", "slowest", "best", "worst", "first", "last", "input", "output", "import", "export", "inside", "outside"])
_FUNCTION_WORDS = frozenset(["a", "an", "the", "what", "which", "who", "whom", "whose", "when", "where", "why", "how", "is", "are", "was", "were", "be", "been", "do", "does", "did", "can", "could", "should", "would", "will", "shall", "may", "might", "must", "i", "you", "he", "she", "it", "we", "they", "my", "your", "his", "her", "its", "our", "their", "me", "him", "us", "them", "this", "that", "these", "those", "there", "here", "in", "on", "at", "of", "to", "for", "from", "by", "with", "about", "and", "or", "but", "if", "then", "please", "tell", "give", "show", "explain", "list", "find"])


class Verifier(Protocol):
    """Decides whether a candidate text may answer a query text."""

    def accepts(self, query: str, candidate: str) -> bool:
        """Whether ``candidate`` (already above the threshold) is a hit for ``query``."""
        ...


def _unit(word: str) -> str | None:
    """The canonical unit ``word`` names (plural ``s`` stripped), or ``None``."""
    low = word.lower()
    return _UNITS.get(low) or (_UNITS.get(low[:-1]) if low.endswith("s") and len(low) > 2 else None)


def protected_tokens(text: str) -> tuple[set[str], set[str]]:
    """Split ``text`` into its protected tokens and all its (case-folded) tokens.

    Returns:
        ``(protected, vocabulary)``: both normalized (numbers as digits, units
        canonical, negations as ``<neg>``, quantities as ``"<number> <unit>"``).
    """
    # NOTE: split contractions ("don't" -> "do n't") before tokenizing, or the negation hides inside a word
    text = _CONTRACTION.sub(r"\1 n't", text)
    matches = list(_TOKEN.finditer(text))
    raw = [_POSSESSIVE.sub("", m.group()) or m.group() for m in matches]  # "France's" names France
    # a token starts a sentence when it is the first, or the gap before it holds . ? ! or :
    gaps = [text[:matches[0].start()] if matches else ""] + [
        text[a.end():b.start()] for a, b in itertools.pairwise(matches)]
    initial = [i == 0 or any(c in ".?!:" for c in gap) for i, gap in enumerate(gaps)]
    protected: set[str] = set()
    vocab: set[str] = set()
    i = 0
    while i < len(raw):
        word, low = raw[i], raw[i].lower()
        number = low.replace(",", "") if low[0].isdigit() else _NUMBER_WORDS.get(low)
        unit = _unit(word)
        if number is not None:
            nxt = _unit(raw[i + 1]) if i + 1 < len(raw) else None
            token = f"{number} {nxt}" if nxt else number
            i += 2 if nxt else 1
            protected.add(token)
            vocab.add(token)
            continue
        if low in _NEGATIONS:
            token = "<neg>"
            protected.add(token)
        elif unit is not None:
            token = unit
            protected.add(token)
        else:
            token = low
            if low in _POLAR or (word[0].isupper() and not initial[i] and low not in _FUNCTION_WORDS):
                protected.add(token)
        vocab.add(token)
        i += 1
    return protected, vocab


def differs(query: str, candidate: str) -> bool:
    """Whether ``query`` and ``candidate`` disagree on a protected token (see the module docstring)."""
    q_prot, q_vocab = protected_tokens(query)
    c_prot, c_vocab = protected_tokens(candidate)
    return bool((q_prot - c_vocab) or (c_prot - q_vocab))


class ProtectedTokenVerifier:
    """The default :class:`Verifier`: accept unless :func:`differs`."""

    def accepts(self, query: str, candidate: str) -> bool:
        """See :meth:`Verifier.accepts`."""
        return not differs(query, candidate)
