"""Item filters and namespace match conditions for :class:`~langchain_kvmem.KVMemStore`: InMemoryStore's rules."""

from __future__ import annotations

import operator
from typing import Any

from langgraph.store.base import MatchCondition

__all__ = ["does_match", "matches"]


def matches(value: dict[str, Any], filter: dict[str, Any]) -> bool:
    """Whether ``value`` passes every condition of ``filter`` (``$eq``, ``$ne``, ``$gt``, ... or equality)."""
    return all(_compare(_field(value, key), wanted) for key, wanted in filter.items())


def _field(value: dict[str, Any], key: str) -> Any:
    """``value[key]``, else the nested field a dotted ``key`` names (as newer InMemoryStore), else None."""
    if key in value or "." not in key:
        return value.get(key)
    node: Any = value
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _compare(value: Any, wanted: Any) -> bool:
    if isinstance(wanted, dict):
        if any(k.startswith("$") for k in wanted):
            return all(_apply(value, op, operand) for op, operand in wanted.items())
        return isinstance(value, dict) and all(_compare(value.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, (list, tuple)):
        return (
            isinstance(value, (list, tuple))
            and len(value) == len(wanted)
            and all(_compare(v, w) for v, w in zip(value, wanted))
        )
    return bool(value == wanted)


_ORDER = {"$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le}


def _apply(value: Any, op: str, operand: Any) -> bool:
    if op == "$eq":
        return bool(value == operand)
    if op == "$ne":
        return bool(value != operand)
    compare = _ORDER.get(op)
    if compare is None:
        raise ValueError(f"Unsupported operator: {op}; accepted $eq, $ne, $gt, $gte, $lt, $lte")
    try:
        return bool(compare(float(value), float(operand)))
    except (TypeError, ValueError):
        # InMemoryStore raises here; a missing or non-numeric field just fails the filter
        return isinstance(value, str) and isinstance(operand, str) and bool(compare(value, operand))


def does_match(condition: MatchCondition, namespace: tuple[str, ...]) -> bool:
    """Whether ``namespace`` starts (``prefix``) or ends (``suffix``) with ``condition.path`` ("*": any label)."""
    path = tuple(condition.path)
    if len(namespace) < len(path):
        return False
    if condition.match_type == "prefix":
        part = namespace[: len(path)]
    elif condition.match_type == "suffix":
        part = namespace[len(namespace) - len(path) :]
    else:
        raise ValueError(f"Unsupported match type: {condition.match_type}; accepted prefix, suffix")
    return all(p == "*" or p == label for p, label in zip(path, part))
