"""A griffe extension for the API reference: the docstrings' Sphinx roles as Markdown.

kvmem's docstrings are Google style with Sphinx cross-reference roles (``:class:`Memory```,
``:meth:`~Memory.load```), which Markdown would print as written. Each role becomes inline code
wrapped in an *optional* autorefs link to the object the name resolves to from the docstring's own
scope: a link where that object is on a reference page, plain code where it is not (a private
module, a name outside the documented surface), never a broken link.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|mod|attr|data|exc|obj):`(?P<target>[^`]+)`")


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """The full path ``name`` means in ``obj``'s scope, or None."""
    name = name.lstrip(".")
    head, _, rest = name.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            path = scope.resolve(head)
        except (griffe.NameResolutionError, ValueError, KeyError, AttributeError):
            path = None
        if path:
            return f"{path}.{rest}" if rest else path
        scope = scope.parent
    return name if "." in name else None


def _rewrite(obj: griffe.Object, text: str) -> str:
    def one(match: re.Match[str]) -> str:
        target = match["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~")
        shown = target.rsplit(".", 1)[-1] if short else target
        if match["role"] in ("meth", "func"):
            shown += "()"
        code = f"<code>{html.escape(shown)}</code>"
        path = _resolve(obj, target)
        if not path:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    return _ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring's Sphinx roles once its object is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":`" in obj.docstring.value:
            obj.docstring.value = _rewrite(obj, obj.docstring.value)
