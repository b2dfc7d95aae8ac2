"""KVMemCache with LangChain's fake models over a real Memory on disk, exact and semantic (real embedder)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_core.globals import get_llm_cache, set_llm_cache
from langchain_core.language_models.fake import FakeListLLM
from langchain_core.language_models.fake_chat_models import FakeListChatModel, GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, Generation

import kvmem
from langchain_kvmem.cache import KVMemCache, _exact_key

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # integrations/langchain: what `import langchain_kvmem` needs
SYSTEM = SystemMessage("Answer in one word.")


@pytest.fixture
def global_cache() -> Iterator[None]:
    """Restores the process-wide LLM cache after a test that sets it."""
    before = get_llm_cache()
    yield
    set_llm_cache(before)


def chat_model(cache: KVMemCache) -> FakeListChatModel:
    """A fake chat model answering "r0", "r1", ... in turn: its ``i`` counts the calls that reached it."""
    return FakeListChatModel(responses=[f"r{i}" for i in range(20)], cache=cache)


def ask(model: FakeListChatModel, *messages: BaseMessage | str) -> str:
    return str(model.invoke([HumanMessage(m) if isinstance(m, str) else m for m in messages]).content)


# -- exact ---------------------------------------------------------------------------------------------


def test_global_cache_serves_a_repeated_completion_and_misses_other_params(
    memory: kvmem.Memory, global_cache: None
) -> None:
    set_llm_cache(KVMemCache(memory))
    llm = FakeListLLM(responses=["first", "second", "third", "fourth"])
    assert llm.invoke("What is 2 + 2?") == "first"
    assert llm.invoke("What is 2 + 2?") == "first" and llm.i == 1  # the fake was not called again
    assert llm.invoke("What is 2 + 2?", stop=["\n"]) == "second"  # another llm_string
    assert llm.invoke("What is 2 + 3?") == "third"
    assert llm.i == 3


def test_model_cache_serves_repeated_chat_and_keeps_message_objects(memory: kvmem.Memory) -> None:
    cache = KVMemCache(memory)
    model = GenericFakeChatModel(
        messages=iter([AIMessage("Paris", response_metadata={"n": 1}), AIMessage("x")]), cache=cache
    )
    first = model.invoke([SYSTEM, HumanMessage("Capital of France?")])
    again = model.invoke([SYSTEM, HumanMessage("Capital of France?")])
    assert isinstance(again, AIMessage) and again.content == first.content == "Paris"
    assert again.response_metadata.get("n") == 1
    assert next(model.messages).content == "x"  # the iterator was advanced once only


def test_exact_cache_never_matches_paraphrases_or_other_history(memory: kvmem.Memory) -> None:
    model = chat_model(KVMemCache(memory))
    assert ask(model, SYSTEM, "What is the capital of France?") == "r0"
    assert ask(model, SYSTEM, "What is the capital of France?") == "r0"
    assert ask(model, SYSTEM, "What's the capital city of France?") == "r1"
    assert ask(model, "What is the capital of France?") == "r2"


def test_async_calls_hit_and_run_off_the_event_loop_thread(
    memory: kvmem.Memory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = KVMemCache(memory)
    model = chat_model(cache)
    threads: list[int] = []
    lookup = cache.lookup

    def recording_lookup(prompt: str, llm_string: str) -> object:
        threads.append(threading.get_ident())
        return lookup(prompt, llm_string)

    monkeypatch.setattr(cache, "lookup", recording_lookup)

    async def main() -> list[str]:
        return [str((await model.ainvoke("hello")).content) for _ in range(2)]

    assert asyncio.run(main()) == ["r0", "r0"]
    assert len(threads) == 2 and threading.get_ident() not in threads


def test_cache_is_truthy_when_empty(memory: kvmem.Memory) -> None:
    assert bool(KVMemCache(memory)) and bool(KVMemCache(memory, semantic=True))


def test_namespaces_are_isolated_and_clear_only_its_own(memory: kvmem.Memory) -> None:
    one, two = KVMemCache(memory, namespace="one"), KVMemCache(memory, namespace="two")
    one.update("p", "llm", [Generation(text="from one")])
    two.update("p", "llm", [Generation(text="from two")])
    assert one.lookup("p", "llm") == [Generation(text="from one")]
    one.clear()
    assert one.lookup("p", "llm") is None
    assert two.lookup("p", "llm") == [Generation(text="from two")]


def test_chat_generations_round_trip(memory: kvmem.Memory) -> None:
    cache = KVMemCache(memory)
    generations = [
        ChatGeneration(
            message=AIMessage("hi", tool_calls=[{"name": "f", "args": {"x": 1}, "id": "1"}]),
            generation_info={"finish_reason": "stop"},
        )
    ]
    cache.update("prompt", "llm", generations)
    assert cache.lookup("prompt", "llm") == generations


def test_an_entry_that_cannot_be_revived_is_a_miss(memory: kvmem.Memory) -> None:
    cache = KVMemCache(memory)
    for bad in ["not json", '{"lc": 1, "type": "constructor", "id": ["os", "system"], "kwargs": {}}', 42, ["x"]]:
        memory.store(_exact_key("p", "llm"), bad, namespace=cache.namespace)
        assert cache.lookup("p", "llm") is None


def test_another_process_is_served_from_the_cache(memory: kvmem.Memory, tmp_path: Path) -> None:
    KVMemCache(memory).update("What is 2 + 2?", "fake-llm", [Generation(text="4")])
    memory.flush()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")])}
    code = (
        "import kvmem\n"
        "from langchain_kvmem.cache import KVMemCache\n"
        f"with kvmem.Memory({str(tmp_path / 'kvmem')!r}) as mem:\n"
        "    cache = KVMemCache(mem)\n"
        "    print(cache.lookup('What is 2 + 2?', 'fake-llm'), cache.lookup('What is 2 + 2?', 'other-llm'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[Generation(text='4')] None"


# -- semantic ------------------------------------------------------------------------------------------


def test_semantic_paraphrase_hits_and_a_near_miss_does_not(semantic_memory: kvmem.Memory) -> None:
    model = chat_model(KVMemCache(semantic_memory, semantic=True))
    assert ask(model, SYSTEM, "What is the capital of France?") == "r0"
    assert ask(model, SYSTEM, "What is the capital of France?") == "r0"
    assert ask(model, SYSTEM, "what's the capital city of France?") == "r0"
    assert ask(model, SYSTEM, "What is the capital of Germany?") == "r1"
    assert ask(model, SYSTEM, "How many legs does a spider have?") == "r2"
    assert ask(model, SYSTEM, "How many legs do spiders have?") == "r2"
    assert ask(model, SYSTEM, "How many legs does an ant have?") == "r3"
    assert model.i == 4


def test_semantic_never_hits_across_earlier_messages_or_llm_params(semantic_memory: kvmem.Memory) -> None:
    model = chat_model(KVMemCache(semantic_memory, semantic=True))
    question = "What is the capital of France?"
    assert ask(model, SYSTEM, question) == "r0"
    assert ask(model, SystemMessage("Answer at length."), question) == "r1"
    assert ask(model, question) == "r2"
    assert ask(model, SYSTEM, "Hi", AIMessage("Hello!"), question) == "r3"
    assert ask(model, SYSTEM, "Hi", AIMessage("Hey there!"), question) == "r4"
    assert ask(model, SYSTEM, HumanMessage(question, name="bob")) == "r5"
    assert str(model.invoke([SYSTEM, HumanMessage(question)], stop=["."]).content) == "r6"
    assert ask(model, SYSTEM, "Hi", AIMessage("Hello!"), "what's the capital city of France?") == "r3"


def test_semantic_completion_prompts_are_embedded_whole(semantic_memory: kvmem.Memory, global_cache: None) -> None:
    set_llm_cache(KVMemCache(semantic_memory, semantic=True))
    llm = FakeListLLM(responses=["8", "6", "unknown"])
    assert llm.invoke("How many legs does a spider have?") == "8"
    assert llm.invoke("How many legs do spiders have?") == "8"
    assert llm.invoke("How many legs does an insect have?") == "6"
    assert llm.i == 2


def test_semantic_cache_treats_content_blocks_exactly(semantic_memory: kvmem.Memory) -> None:
    model = chat_model(KVMemCache(semantic_memory, semantic=True))

    def blocks(text: str) -> HumanMessage:
        return HumanMessage([{"type": "text", "text": text}])

    assert ask(model, SYSTEM, blocks("What is the capital of France?")) == "r0"
    assert ask(model, SYSTEM, blocks("What is the capital of France?")) == "r0"
    assert ask(model, SYSTEM, blocks("what's the capital city of France?")) == "r1"


def test_semantic_clear_removes_every_entry(semantic_memory: kvmem.Memory) -> None:
    cache = KVMemCache(semantic_memory, semantic=True)
    model = chat_model(cache)
    ask(model, SYSTEM, "What is the capital of France?")
    ask(model, SYSTEM, HumanMessage([{"type": "text", "text": "Capital of Spain?"}]))
    cache.update("How many legs does a spider have?", "llm", [Generation(text="8")])
    cache.clear()
    assert list(semantic_memory.entries()) == []
    assert cache.lookup("How many legs does a spider have?", "llm") is None
    assert ask(model, SYSTEM, "What is the capital of France?") == "r2"


def test_semantic_async_calls_hit(semantic_memory: kvmem.Memory) -> None:
    model = chat_model(KVMemCache(semantic_memory, semantic=True))

    async def main() -> list[str]:
        return [
            str((await model.ainvoke([SYSTEM, HumanMessage(q)])).content)
            for q in ["What is the capital of France?", "what's the capital city of France?"]
        ]

    assert asyncio.run(main()) == ["r0", "r0"]
