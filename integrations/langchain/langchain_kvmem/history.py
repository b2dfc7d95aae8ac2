"""``KVMemChatMessageHistory``: a legacy chat-history shim over kvmem agent sessions.

LangChain deprecated ``BaseChatMessageHistory`` in langchain-core 1.6.4 (removal in
2.0): new code keeps short-term memory in a LangGraph checkpointer and long-term
memory in a store (:class:`~langchain_kvmem.KVMemStore`). This class exists for
code that still takes a message history. Each message is one step of a
:class:`kvmem.agent.AgentSession` (role in ``thought``, the message serialized by
``langchain_core.load.dumps`` in ``observation``), so the history is a verified
hash chain in kvmem's catalog: it survives restarts, is shared by every process
on that catalog, and a concurrent writer gets ``SessionConflict`` instead of an
interleaved history.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Sequence

from langchain_core._api import LangChainDeprecationWarning
from langchain_core.load import dumps, loads
from langchain_core.messages import BaseMessage

import kvmem
from kvmem.agent import AgentSession

with warnings.catch_warnings():  # the deprecation is this shim's reason to exist; it is in the docstring
    warnings.simplefilter("ignore", LangChainDeprecationWarning)
    from langchain_core.chat_history import BaseChatMessageHistory

__all__ = ["KVMemChatMessageHistory"]


class KVMemChatMessageHistory(BaseChatMessageHistory):
    """A chat history stored as a kvmem agent session (legacy API; see the module docstring).

    Args:
        session_id: the session's name (sessions of :class:`kvmem.agent.AgentSession` share the space:
            use a prefix such as ``chat/`` to keep them apart).
        memory: whose catalog holds it (default: kvmem's default memory).
    """

    def __init__(self, session_id: str, memory: kvmem.Memory | None = None) -> None:
        self.session_id = session_id
        self.memory = memory if memory is not None else kvmem.default_memory()
        self._session = AgentSession(session_id, self.memory)

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        """The stored messages, oldest first, read back from the catalog (another process may have added some)."""
        self._session = AgentSession.resume(self.session_id, self.memory)
        return [loads(step.observation, allowed_objects="core") for step in self._session.steps]

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Append ``messages``, one step each.

        Raises:
            kvmem.errors.SessionConflict: another writer added messages since this object last read them.
        """
        for message in messages:
            self._session.append_step(thought=message.type, observation=dumps(message))

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None:
        await asyncio.to_thread(self.add_messages, messages)

    async def aget_messages(self) -> list[BaseMessage]:
        return await asyncio.to_thread(lambda: self.messages)

    def clear(self) -> None:
        """Delete the history (steps another session shares stay)."""
        self._session.delete()
        self._session = AgentSession(self.session_id, self.memory)

    async def aclear(self) -> None:
        await asyncio.to_thread(self.clear)
