"""A LangChain agent with kvmem memory: facts kept in a ``KVMemStore`` across processes, answers in a ``KVMemCache``.

Run 1 (this process) builds an agent with ``langchain.agents.create_agent`` and
``store=KVMemStore(memory)``; its tool ``save_memory`` writes what the user
asked it to remember into the store (namespace ``("memories", user)``). Run 2 is
a second process on the same kvmem directory: its agent's ``recall`` tool
searches the store by meaning (its ``fact`` field is embedded with the memory's
embedder, kvmem's offline all-MiniLM-L6-v2) and finds what run 1 saved.

Then a chat model behind ``KVMemCache(memory, semantic=True)`` answers four
questions: the first is computed, the repeat is an exact hit, a paraphrase is a
semantic hit, and a near miss (another country) is computed, never served the
cached answer.

The chat model is a scripted fake (``GenericFakeChatModel``), so nothing is
downloaded and every run prints the same: the point is the memory, not the model.

Usage (from the repository root)::

    pip install -e ".[semantic]" -e integrations/langchain langchain
    python examples/langchain_agent_memory.py                  # both runs, a temporary kvmem directory
    python examples/langchain_agent_memory.py --path /tmp/kv   # keep the directory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain.agents import create_agent
from langchain.tools import ToolRuntime, tool
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage

import kvmem
from langchain_kvmem import KVMemCache, KVMemStore

USER = "user-7"
FACTS = ["My favourite colour is teal.", "I am allergic to peanuts.", "I live in Lyon and work night shifts."]
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of France?",
    "What's the capital city of France?",
    "What is the capital of Germany?",
]


class ScriptedChat(GenericFakeChatModel):
    """A fake chat model that replays scripted messages and accepts tools (it never reads them)."""

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChat:
        return self


@tool
def save_memory(fact: str, runtime: ToolRuntime) -> str:
    """Save a fact about the user for later conversations."""
    runtime.store.put(("memories", USER), f"fact-{zlib.crc32(fact.encode()):08x}", {"fact": fact})
    return "saved"


@tool
def recall(query: str, runtime: ToolRuntime) -> str:
    """Find what was saved about the user, by meaning."""
    found = runtime.store.search(("memories", USER), query=query, limit=1)
    return found[0].value["fact"] if found else "nothing saved"


def open_store(memory: kvmem.Memory) -> KVMemStore:
    return KVMemStore(memory, index={"fields": ["fact"]})  # NOTE: embedded by the memory's embedder


def calls(*messages: AIMessage) -> Iterator[AIMessage]:
    return iter(messages)


def run_agent(memory: kvmem.Memory, model: ScriptedChat, question: str) -> list[str]:
    agent = create_agent(model, tools=[save_memory, recall], store=open_store(memory))
    out = agent.invoke({"messages": [{"role": "user", "content": question}]})
    return [f"{m.type}: {m.content}" for m in out["messages"]]


def remember(memory: kvmem.Memory) -> list[str]:
    model = ScriptedChat(
        messages=calls(
            AIMessage(
                "",
                tool_calls=[
                    {"name": "save_memory", "args": {"fact": fact}, "id": f"call-{i}"} for i, fact in enumerate(FACTS)
                ],
            ),
            AIMessage("Noted, I will remember that."),
        )
    )
    return run_agent(memory, model, "Please remember: " + " ".join(FACTS))


def recall_in_this_process(memory: kvmem.Memory) -> list[str]:
    model = ScriptedChat(
        messages=calls(
            AIMessage(
                "", tool_calls=[{"name": "recall", "args": {"query": "what should the user not eat?"}, "id": "call-1"}]
            ),
            AIMessage("You told me you are allergic to peanuts."),
        )
    )
    return run_agent(memory, model, "Is there any food I should avoid?")


@dataclass
class Report:
    """What the example showed (tests read it)."""

    run1: list[str] = field(default_factory=list)
    saved: int = 0  # facts in the store after run 1
    run2: dict[str, Any] = field(default_factory=dict)
    cache: list[tuple[str, str, bool]] = field(default_factory=list)  # question, answer, served from the cache


class CountingChat(GenericFakeChatModel):
    """A fake chat model that counts the calls that reach it (a cache hit never does)."""

    calls: int = 0

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super()._generate(*args, **kwargs)


def ask_with_cache(memory: kvmem.Memory) -> list[tuple[str, str, bool]]:
    """Each question through a cached chat model: (question, answer, served from the cache)."""
    model = CountingChat(
        messages=iter([AIMessage("Paris."), AIMessage("Berlin.")]), cache=KVMemCache(memory, semantic=True)
    )
    rows = []
    for question in QUESTIONS:
        before = model.calls
        answer = str(model.invoke(question).content)
        rows.append((question, answer, model.calls == before))
    return rows


def main(argv: Sequence[str] | None = None) -> Report:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", type=Path, default=None, help="kvmem directory (default: a temporary one)")
    ap.add_argument("--recall", action="store_true", help="run 2 only: recall from --path and print JSON")
    args = ap.parse_args(argv)
    report = Report()
    if args.recall:
        with kvmem.Memory(str(args.path)) as memory:
            transcript = recall_in_this_process(memory)
        print(json.dumps({"pid": os.getpid(), "transcript": transcript}))
        return report
    with tempfile.TemporaryDirectory(prefix="kvmem-langchain-") as tmp:
        path = args.path or Path(tmp)
        with kvmem.Memory(str(path)) as memory:
            report.run1 = remember(memory)
            report.saved = len(open_store(memory).search(("memories", USER), limit=10))
        print(f"run 1 (pid {os.getpid()}):\n  " + "\n  ".join(report.run1))
        out = subprocess.run(
            [sys.executable, __file__, "--recall", "--path", str(path)], capture_output=True, text=True, check=True
        )
        report.run2 = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"run 2 (pid {report.run2['pid']}, a second process):\n  " + "\n  ".join(report.run2["transcript"]))
        with kvmem.Memory(str(path)) as memory:
            report.cache = ask_with_cache(memory)
        print("LLM cache (KVMemCache, semantic=True):")
        for question, answer, cached in report.cache:
            print(f"  {'hit ' if cached else 'miss'}  {question!r:40} -> {answer}")
    return report


if __name__ == "__main__":
    main()
