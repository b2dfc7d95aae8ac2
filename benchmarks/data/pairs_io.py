"""Writing a pair set: what the ``make_semantic_*.py`` generators share."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

__all__ = ["write_pairs"]


def write_pairs(rows: Sequence[dict[str, str]], path: Path) -> None:
    """Write ``rows`` to ``path`` as JSON lines and print how many of each label and kind."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} pairs to {path}")
    print("labels:", dict(sorted(Counter(row["label"] for row in rows).items())))
    print("kinds: ", dict(sorted(Counter(row["kind"] for row in rows).items())))
