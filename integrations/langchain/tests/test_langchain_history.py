"""KVMemChatMessageHistory: messages round-trip through an agent session on disk, across processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

import kvmem
from kvmem.errors import SessionConflict
from langchain_kvmem import KVMemChatMessageHistory

PACKAGE = Path(__file__).resolve().parents[1]


def test_messages_round_trip_and_survive_a_second_process(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kvmem") as mem:
        history = KVMemChatMessageHistory("chat/1", memory=mem)
        sent = [
            SystemMessage("be brief"),
            HumanMessage("hi", id="h1"),
            AIMessage("hello", id="a1"),
            ToolMessage("42", tool_call_id="t1"),
        ]
        history.add_messages(sent)
        assert history.messages == sent
    code = (
        "import sys; import kvmem; from langchain_kvmem import KVMemChatMessageHistory\n"
        "from langchain_core.messages import HumanMessage\n"
        "with kvmem.Memory(sys.argv[1]) as mem:\n"
        "    h = KVMemChatMessageHistory('chat/1', memory=mem); h.add_messages([HumanMessage('again')])\n"
        "    print(len(h.messages))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "kvmem")], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "5"
    with kvmem.Memory(tmp_path / "kvmem") as mem:
        history = KVMemChatMessageHistory("chat/1", memory=mem)
        assert history.messages[-1] == HumanMessage("again") and len(history.messages) == 5
        asyncio.run(history.aadd_messages([AIMessage("ok")]))
        assert asyncio.run(history.aget_messages())[-1] == AIMessage("ok")
        history.clear()
        assert history.messages == [] and KVMemChatMessageHistory("chat/2", memory=mem).messages == []


def test_a_stale_writer_is_refused(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kvmem") as mem:
        first, second = KVMemChatMessageHistory("chat/x", memory=mem), KVMemChatMessageHistory("chat/x", memory=mem)
        first.add_messages([HumanMessage("one")])
        with pytest.raises(SessionConflict):
            second.add_messages([HumanMessage("two")])
        assert [m.content for m in second.messages] == ["one"]  # reading catches up
        second.add_messages([HumanMessage("two")])
        assert [m.content for m in first.messages] == ["one", "two"]
