"""A LangGraph ReAct agent on a local model, all its memory in kvmem: killed with ``kill -9`` mid-run, resumed.

The agent (``langchain.agents.create_agent``, a LangGraph graph) keeps:

- its thread, every step, in a ``KVMemSaver`` (the checkpointer);
- the orders its ``lookup`` tool reads, in a ``KVMemStore`` (long-term memory, ``("orders",)``);
- each prompt's KV in kvmem: its model is a ``ChatTransformersKV``, so a call loads every chunk of the
  prompt an earlier call (of this process or of one before it) stored, and computes only the rest.

All three on one ``kvmem.Memory`` directory. The model is a tiny Llama with random weights, built from a
config (nothing is downloaded); its tokenizer is byte-level BPE with one token per word of the agent's
vocabulary. A random model cannot choose tools, so each reply is half its own, half scripted: a thought of
a few words the model picks greedily (among the vocabulary's words), then the scripted call
``lookup(order-<n>)``, or after the last lookup a final answer. Every reply is decoded token by token on
the prefilled cache.

By default the script runs the agent in a child process, kills it (SIGKILL) once it has made
``--kill-after`` model calls, resumes the thread in a new process from its last checkpoint, and compares
the result with an uninterrupted run (on a directory of its own). By hand, from the repository root::

    pip install -e . -e integrations/langchain langchain
    python examples/langgraph_agent.py                                   # all of it, a temporary directory
    python examples/langgraph_agent.py --run --path /tmp/lg-agent --lookups 40 & sleep 12; kill -9 $!
    python examples/langgraph_agent.py --resume --path /tmp/lg-agent --lookups 40   # from the last checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from langchain.agents import create_agent
from langchain.tools import ToolRuntime, tool
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGenerationChunk
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph.state import CompiledStateGraph
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import kvmem
from langchain_kvmem import ChatTransformersKV, KVMemSaver, KVMemStore

THREAD = "order-audit"
SYSTEM = "You audit the orders of an online shop: look each order up, then answer."
QUESTION = "Check every order of this week and tell me which ones are late."
WORDS = (
    "the order customer shipped invoice refund carrier warehouse delivery address payment card account status "
    "item price total tax discount week day date email phone support ticket issue request tracking number return "
    "label box damaged missing replace check confirm update record search result found not yet again after before "
    "since until today tomorrow morning evening late early fast slow standard express policy rule limit amount "
    "euro dollar store online page link error code message reply wait call tool lookup answer question"
).split()
SPECIALS = ["<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
TEMPLATE = (  # NOTE: renders a reply's tool calls as the model wrote them, so its chunks are reused
    "{{ bos_token }}"
    "{%- if tools -%}<|system|>Tools:{%- for t in tools %} {{ t | tojson }}{%- endfor -%}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' -%}<|user|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|tool|>{{ m.content }}<|end|>"
    "{%- else -%}<|assistant|>{{ m.content }}"
    "{%- for c in m.tool_calls or [] -%}"
    '<tool_call>{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>'
    "{%- endfor -%}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


# -- the model ------------------------------------------------------------------------------------------------
def word_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE whose merges make each word of ``WORDS`` and of the agent's tool calls one token; any text
    round-trips."""
    split = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    corpus = " ".join(["", *WORDS, '<tool_call>{"name": "lookup", "arguments": {"id": "order-0"}}</tool_call>'])
    for word, _ in split.pre_tokenize_str(corpus):
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                vocab[word[:end]] = len(vocab)
                merges.append((word[: end - 1], word[end - 1]))
    raw = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    raw.pre_tokenizer = split
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="<|end|>", pad_token="<|end|>")
    tok.chat_template = TEMPLATE
    return tok


def tiny_llama(tokenizer: PreTrainedTokenizerFast, **sizes: int) -> LlamaForCausalLM:
    """A random-weight Llama (seeded: every process builds the same one), ``TINY`` unless ``sizes`` says."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=16384,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **(sizes or TINY),
    )
    return LlamaForCausalLM(config).eval()


class ScriptedReAct(ChatTransformersKV):
    """Each reply: ``thought_words`` words the model picks greedily, then the script's tool call or answer.

    Call *n* (``n`` tool results in its prompt, so a resumed thread goes on where it stopped) looks up
    ``order-<n>``; once ``lookups`` results are in, it answers.
    """

    lookups: int = 8
    thought_words: int = 6
    _script: list[int] = []
    _words: list[int] = []

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        n = sum(isinstance(m, ToolMessage) for m in messages)
        text = (
            f'<tool_call>{{"name": "lookup", "arguments": {{"id": "order-{n}"}}}}</tool_call>'
            if n < self.lookups
            else f" answer: {n} orders checked"
        )
        self._script = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        self._words = [self.tokenizer.convert_tokens_to_ids("Ġ" + w) for w in WORDS]
        return super()._stream(messages, stop, run_manager, **kwargs)

    def _pick_token(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        if len(generated) < self.thought_words:
            return self._words[int(logits[self._words].argmax())]
        return self._script[len(generated) - self.thought_words]


# -- the agent ------------------------------------------------------------------------------------------------
@tool
def lookup(id: str, runtime: ToolRuntime) -> str:
    """Look an order up by its id."""
    assert runtime.store is not None
    item = runtime.store.get(("orders",), id)
    return item.value["text"] if item else f"no order {id}"


def put_orders(store: KVMemStore, count: int) -> None:
    """``order-0`` .. ``order-<count-1>`` in the store: 40 to 120 words each (seeded)."""
    rng = random.Random(7)
    for n in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))
        store.put(("orders",), f"order-{n}", {"text": text})


def build_agent(
    model: ChatTransformersKV, memory: kvmem.Memory, checkpointer: BaseCheckpointSaver[Any] | None = None
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The ReAct agent: ``model`` with ``lookup``, its thread in ``checkpointer`` (default a ``KVMemSaver``),
    its store a ``KVMemStore``, both on ``memory``."""
    saver = checkpointer if checkpointer is not None else KVMemSaver(memory)
    return create_agent(model, tools=[lookup], system_prompt=SYSTEM, checkpointer=saver, store=KVMemStore(memory))


def config_of(thread: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread}, "recursion_limit": 1000}


def summary(messages: Sequence[BaseMessage]) -> list[list[Any]]:
    """Each message's type, text and tool calls (what two runs must agree on; ids differ)."""
    return [[m.type, str(m.content), [[c["name"], c["args"]] for c in getattr(m, "tool_calls", [])]] for m in messages]


def run(path: Path, thread: str, lookups: int, resume: bool, echo: bool = True) -> dict[str, Any]:
    """Run (or resume, from its last checkpoint) the agent's thread on ``path``; a line of JSON per model call
    (``echo``)."""
    tokenizer = word_tokenizer()
    with kvmem.Memory(str(path)) as memory:
        model = ScriptedReAct(
            model=tiny_llama(tokenizer), tokenizer=tokenizer, memory=memory, block_size=16, compression="none"
        )
        model.lookups = lookups
        put_orders(KVMemStore(memory), lookups)
        agent = build_agent(model, memory)
        start = None if resume else {"messages": [HumanMessage(QUESTION)]}
        calls = 0
        for update in agent.stream(start, config_of(thread), stream_mode="updates"):
            for reply in (update.get("model") or {}).get("messages", []):
                usage = reply.usage_metadata["input_token_details"]
                calls += 1
                if echo:
                    print(json.dumps({"pid": os.getpid(), "call": calls, **usage}), flush=True)
        messages = agent.get_state(config_of(thread)).values["messages"]
        model.close()
    return {"pid": os.getpid(), "calls": calls, "messages": summary(messages)}


# -- the demonstration ----------------------------------------------------------------------------------------
@dataclass
class Report:
    """What the example showed (tests read it)."""

    killed_pid: int = 0
    killed_after: int = 0  # model calls the killed process reported
    checkpoints_at_kill: int = 0  # checkpoints of the thread it left
    resumed_from_step: int = -1  # LangGraph step (metadata) of its last checkpoint
    answered_at_kill: int = 0  # model replies in that checkpoint's messages
    resumed: dict[str, Any] = field(default_factory=dict)  # the resuming process's run()
    resumed_usage: list[dict[str, int]] = field(default_factory=list)  # its calls' prompt tokens read / computed
    steps: list[int] = field(default_factory=list)  # the thread's checkpoints' steps, oldest first
    parents_chain: bool = False  # every checkpoint's parent is the one before it
    reference: dict[str, Any] = field(default_factory=dict)  # an uninterrupted run()


def child(path: Path, lookups: int, *mode: str) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, *mode, "--path", str(path), "--lookups", str(lookups)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def run_and_kill(path: Path, lookups: int, kill_after: int) -> tuple[int, int]:
    """A child running the agent, SIGKILLed after its ``kill_after``-th model call; its pid, the calls it reported."""
    proc = child(path, lookups, "--run")
    assert proc.stdout is not None
    seen = 0
    for line in proc.stdout:
        seen = json.loads(line)["call"]
        if seen >= kill_after:
            os.kill(proc.pid, signal.SIGKILL)  # NOTE: mid-run: the next call is under way
            break
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"the agent process ended with {proc.returncode} before it was killed")
    return proc.pid, seen


def history(path: Path) -> list[Any]:
    """The thread's checkpoints, oldest first."""
    with kvmem.Memory(str(path)) as memory:
        return list(reversed(list(KVMemSaver(memory).list(config_of(THREAD)))))


def kill_and_resume(path: Path, lookups: int, kill_after: int, report: Report) -> None:
    """Run the thread in a child, kill it, resume it in another; fill ``report`` in."""
    report.killed_pid, report.killed_after = run_and_kill(path, lookups, kill_after)
    before = history(path)
    last = before[-1]
    report.checkpoints_at_kill, report.resumed_from_step = len(before), last.metadata["step"]
    report.answered_at_kill = sum(isinstance(m, AIMessage) for m in last.checkpoint["channel_values"]["messages"])
    print(
        f"process {report.killed_pid} killed (SIGKILL) after {report.killed_after} model calls: {len(before)} "
        f"checkpoints, the last at step {report.resumed_from_step} with {report.answered_at_kill} model replies"
    )
    out, _ = child(path, lookups, "--resume").communicate()
    lines = [json.loads(line) for line in out.splitlines()]
    report.resumed = lines[-1]
    report.resumed_usage = [{k: line[k] for k in ("cache_read", "computed")} for line in lines[:-1]]
    print(f"resumed in process {report.resumed['pid']}: {report.resumed['calls']} more model calls")
    for n, usage in enumerate(report.resumed_usage, report.answered_at_kill + 1):
        print(f"  call {n}: prompt tokens read from kvmem {usage['cache_read']}, computed {usage['computed']}")
    after = history(path)
    report.steps = [c.metadata["step"] for c in after]
    report.parents_chain = all(
        c.parent_config is not None and c.parent_config["configurable"]["checkpoint_id"] == p.checkpoint["id"]
        for p, c in zip(after, after[1:])
    )


def main(argv: Sequence[str] | None = None) -> Report:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", type=Path, default=None, help="kvmem directory (default: a temporary one)")
    ap.add_argument("--lookups", type=int, default=8, help="orders the agent looks up before it answers (default 8)")
    ap.add_argument("--kill-after", type=int, default=4, help="model calls before the kill (default 4)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--run", action="store_true", help="only run the agent's thread on --path")
    mode.add_argument("--resume", action="store_true", help="only resume the thread on --path from its last checkpoint")
    args = ap.parse_args(argv)
    report = Report()
    if args.run or args.resume:
        if args.path is None:
            ap.error("--run and --resume need --path")
        print(json.dumps(run(args.path, THREAD, args.lookups, args.resume)), flush=True)
        return report
    with tempfile.TemporaryDirectory(prefix="kvmem-langgraph-") as tmp:
        kill_and_resume(args.path or Path(tmp) / "agent", args.lookups, args.kill_after, report)
        report.reference = run(Path(tmp) / "reference", THREAD, args.lookups, resume=False, echo=False)
    same = report.reference["messages"] == report.resumed["messages"]
    print(
        f"thread: checkpoints at steps {report.steps[0]}..{report.steps[-1]}; its final messages are "
        f"{'those' if same else 'NOT those'} of an uninterrupted run ({len(report.reference['messages'])} messages)"
    )
    return report


if __name__ == "__main__":
    main()
