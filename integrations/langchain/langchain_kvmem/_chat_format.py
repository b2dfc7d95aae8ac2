"""LangChain messages to chat-template turns, and tool calls out of a model's text (``ChatTransformersKV``).

Tool calls follow the Hermes / Qwen convention that many chat templates render and many open models write:
``<tool_call>{"name": "lookup", "arguments": {"id": "A17"}}</tool_call>``, one JSON object per block, after
any text. An assistant message's tool calls are handed to the template as ``tool_calls``
(``[{"type": "function", "function": {"name": ..., "arguments": {...}}}]``), a tool result as a ``tool`` turn.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall, tool_call

from kvmem.errors import KVMemError

__all__ = ["TOOL_CALL_OPEN", "UnsupportedMessage", "parse_tool_calls", "streamable", "to_template_messages"]

TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ROLES: dict[type[BaseMessage], str] = {
    SystemMessage: "system",
    HumanMessage: "user",
    AIMessage: "assistant",
    ToolMessage: "tool",
}


class UnsupportedMessage(KVMemError, TypeError):
    """A message ``ChatTransformersKV`` cannot render through a chat template."""


def to_template_messages(messages: Sequence[BaseMessage]) -> list[dict[str, object]]:
    """Chat-template turns (``role``, ``content``, and ``tool_calls`` / ``tool_call_id``) of ``messages``.

    Raises:
        UnsupportedMessage: a message of another type than system, human, AI and tool (their chunks
            included), or content blocks other than text.
    """
    return [_turn(i, message) for i, message in enumerate(messages)]


def _turn(index: int, message: BaseMessage) -> dict[str, object]:
    role = next((r for cls, r in _ROLES.items() if isinstance(message, cls)), None)
    if role is None:
        raise UnsupportedMessage(
            f"message {index} is a {type(message).__name__} (type {message.type!r}): ChatTransformersKV renders "
            "SystemMessage, HumanMessage, AIMessage and ToolMessage only"
        )
    turn: dict[str, object] = {"role": role, "content": _text(index, message)}
    if isinstance(message, AIMessage) and message.tool_calls:
        turn["tool_calls"] = [
            {"type": "function", "function": {"name": call["name"], "arguments": call["args"]}}
            for call in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        turn["tool_call_id"] = message.tool_call_id
        if message.name:
            turn["name"] = message.name
    return turn


def _text(index: int, message: BaseMessage) -> str:
    """A message's content as text: a string, or a list of strings and ``{"type": "text"}`` blocks."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        else:
            raise UnsupportedMessage(
                f"message {index} holds a content block of type {block.get('type')!r}: ChatTransformersKV "
                "renders text only (a string, or blocks of type 'text')"
            )
    return "".join(parts)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split a model's output into its text and its ``<tool_call>{json}</tool_call>`` blocks.

    A block is a tool call when it holds a JSON object with a string ``name`` and an ``arguments`` (or
    ``parameters``) object, or a JSON string of one; any other block (unclosed, not JSON) stays in the text.

    Returns:
        ``(the text without the tool-call blocks, the calls)``, each call with a fresh id.
    """
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        call = _tool_call(match[1])
        if call is None:
            return match[0]
        calls.append(call)
        return ""

    rest = _TOOL_CALL.sub(take, text)
    return rest, calls


def _tool_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
        args = value.get("arguments", value.get("parameters", {})) if isinstance(value, dict) else None
        if isinstance(args, str):
            args = json.loads(args)
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict) or not isinstance(value.get("name"), str):
        return None
    return tool_call(name=value["name"], args=args, id=f"call_{uuid.uuid4().hex[:24]}")


def streamable(text: str, stops: Sequence[str] = ()) -> int:
    """How many leading characters of a growing output may be streamed as text: those before the first
    ``<tool_call>`` (or stop string), less a tail that may be the start of one."""
    markers = [TOOL_CALL_OPEN, *(s for s in stops if s)]
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found)
    for keep in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-keep:]) for m in markers):
            return len(text) - keep
    return len(text)
