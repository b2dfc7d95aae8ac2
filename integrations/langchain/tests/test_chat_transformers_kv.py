"""ChatTransformersKV on a real tiny Llama (random weights) and a byte-level tokenizer built here, over a real
kvmem Memory: reuse across turns and agent steps, identity with a plain greedy decode, streaming, tool calls."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar

import pytest
import torch
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, AIMessageChunk, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import PrivateAttr
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import kvmem
from kvmem.errors import ConfigError, KVMemError
from kvmem.kv import PrefixCache
from langchain_kvmem import ChatTransformersKV, UnsupportedMessage
from langchain_kvmem._chat_format import parse_tool_calls

BLOCK = 16
SPECIALS = ["<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
# NOTE: renders assistant tool calls as the model is asked to write them, so a reply re-rendered is what it wrote
TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools -%}<|system|>Tools:{%- for t in tools %} {{ t | tojson }}{%- endfor -%}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' -%}<|user|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|tool|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}<|assistant|>{{ m.content }}"
    "{%- for c in m.tool_calls or [] -%}"
    '<tool_call>{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>'
    "{%- endfor -%}<|end|>"
    "{%- else -%}{{ raise_exception('unknown role ' + m.role) }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
SYSTEM = "You answer questions about orders of an online shop, briefly."
QUESTION = "What does order A17 cost?"
M = TypeVar("M", bound=ChatTransformersKV)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (byte-level BPE without merges: every text round-trips) plus the template's specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="<|end|>", pad_token="<|end|>")
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_tokenizer()


@pytest.fixture(scope="module")
def llama(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A 2-layer Llama, hidden 64, random weights (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


class Recording(ChatTransformersKV):
    """Records every token it picks (the end-of-sequence one included) and the logits it picked it from."""

    picked: list[int] = []
    logits: list[torch.Tensor] = []

    def _pick_token(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        token = super()._pick_token(logits, generated)
        self.picked.append(token)
        self.logits.append(logits.clone())
        return token


class Scripted(ChatTransformersKV):
    """Writes the given replies, one per call, in order; the model still prefills and decodes every token."""

    replies: list[str] = []
    _script: list[int] = PrivateAttr(default_factory=list)

    def _pick_token(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        if not generated:
            reply = self.replies.pop(0)
            self._script = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return self._script[len(generated)]


def chat(
    cls: type[M],
    llama: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    memory: kvmem.Memory,
    **kwargs: Any,
) -> M:
    return cls(model=llama, tokenizer=tok, memory=memory, block_size=BLOCK, compression="none", **kwargs)


def plain_greedy(
    model: LlamaForCausalLM, ids: list[int], max_new_tokens: int, eos: int
) -> tuple[list[int], torch.Tensor]:
    """``model.generate`` greedily over the whole prompt, no kvmem: its tokens up to and with the first
    end-of-sequence, and each one's logits (``[tokens, vocab]``)."""
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    tokens = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
    return tokens, torch.cat(out.logits)[: len(tokens)]


def test_second_turn_reuses_the_first_prompt_and_decodes_as_plain_generate(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    model = chat(Recording, llama, tokenizer, memory, max_new_tokens=12, picked=[], logits=[])
    turn1 = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    first = model.invoke(turn1)
    p1 = model.prompt_ids(turn1)
    assert first.usage_metadata is not None
    assert first.usage_metadata["input_tokens"] == len(p1)
    assert first.usage_metadata["input_token_details"] == {"cache_read": 0, "computed": len(p1)}

    turn2 = [*turn1, first, HumanMessage("And order B42?")]
    p2 = model.prompt_ids(turn2)
    assert p2[: len(p1)] == p1  # the template extends the conversation
    fed = p1 + model.picked[:-1]  # the first call's cache: its last pick (end of sequence, or the 12th) never fed
    same = next((i for i, (a, b) in enumerate(zip(p2, fed)) if a != b), min(len(p2), len(fed)))
    model.picked.clear()
    second = model.invoke(turn2)
    usage = second.usage_metadata
    assert usage is not None and usage["input_tokens"] == len(p2)
    details = usage["input_token_details"]
    # every whole chunk of the first prompt, and of its reply as far as the template re-renders it as decoded
    assert details["cache_read"] == min(same, len(p2) - 1) // BLOCK * BLOCK >= len(p1) // BLOCK * BLOCK > 0
    assert details["computed"] == len(p2) - details["cache_read"]  # type: ignore[typeddict-item]

    plain, logits = plain_greedy(llama, p2, 12, tokenizer.eos_token_id)
    assert len(plain) > 1 and model.picked == plain
    assert (torch.stack(model.logits[-len(plain) :]) - logits).abs().max() <= 1e-5  # fp32, as computed
    assert second.content == tokenizer.decode([t for t in plain if t != tokenizer.eos_token_id])
    assert usage["output_tokens"] == len([t for t in plain if t != tokenizer.eos_token_id])


def test_stream_yields_what_invoke_returns(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    model = chat(ChatTransformersKV, llama, tokenizer, memory, max_new_tokens=10)
    messages = [HumanMessage(QUESTION)]
    chunks = list(model.stream(messages))
    assert len(chunks) > 2  # token by token
    invoked = model.invoke(messages)
    assert "".join(str(c.content) for c in chunks) == invoked.content
    assert asyncio.run(model.ainvoke(messages)).content == invoked.content
    usages = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert len(usages) == 1 and usages[0]["output_tokens"] == 10  # on the reply's last chunk


def test_stream_holds_back_tool_calls(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    reply = 'Let me look. <tool_call>{"name": "lookup", "arguments": {"id": "A17"}}</tool_call>'
    model = chat(Scripted, llama, tokenizer, memory, replies=[reply, reply])
    chunks = list(model.stream([HumanMessage(QUESTION)]))
    assert "".join(str(c.content) for c in chunks) == "Let me look. "
    assert all("<" not in str(c.content) for c in chunks)
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    invoked = model.invoke([HumanMessage(QUESTION)])
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("lookup", {"id": "A17"})]
    assert [(c["name"], c["args"]) for c in invoked.tool_calls] == [("lookup", {"id": "A17"})]
    assert invoked.content == "Let me look. " and invoked.response_metadata["finish_reason"] == "tool_calls"


def test_a_stop_string_ends_the_reply_before_it(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    model = chat(Scripted, llama, tokenizer, memory, replies=["Answer: 42\nObservation: more text"])
    reply = model.invoke([HumanMessage(QUESTION)], stop=["Observation:"])
    assert reply.content == "Answer: 42\n" and reply.response_metadata["finish_reason"] == "stop"
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] == len("Answer: 42\nObservation:")


def test_parse_tool_calls() -> None:
    text = (
        'Checking both.\n<tool_call>{"name": "lookup", "arguments": {"id": "A17"}}</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3 * 12.5\\"}"}</tool_call>'
        '<tool_call>{"name": "lookup", "parameters": {"id": "B42"}}</tool_call>'
        '<tool_call>not json</tool_call><tool_call>{"arguments": {}}</tool_call>'
    )
    rest, calls = parse_tool_calls(text)
    assert [(c["name"], c["args"]) for c in calls] == [
        ("lookup", {"id": "A17"}),
        ("calculator", {"expression": "3 * 12.5"}),
        ("lookup", {"id": "B42"}),
    ]
    assert len({c["id"] for c in calls}) == 3
    assert rest == 'Checking both.\n\n<tool_call>not json</tool_call><tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls('<tool_call>{"name": "x", "arguments": {}}') == (
        '<tool_call>{"name": "x", "arguments": {}}',
        [],
    )


@tool
def lookup(id: str) -> str:
    """Look up an order of the shop by its id."""
    return {"A17": "3 x USB-C cable at 12.50", "B42": "1 x keyboard at 89.00"}.get(id.upper(), f"no order {id}")


def test_bind_tools_renders_them_and_past_calls_into_the_prompt(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    model = chat(ChatTransformersKV, llama, tokenizer, memory, max_new_tokens=2)
    bound = model.bind_tools([lookup])
    tools = bound.kwargs["tools"]  # type: ignore[attr-defined]
    messages = [
        HumanMessage(QUESTION),
        AIMessage("", tool_calls=[{"name": "lookup", "args": {"id": "A17"}, "id": "call_1"}]),
        ToolMessage("3 x USB-C cable at 12.50", tool_call_id="call_1"),
    ]
    prompt = model.render(messages, tools)
    assert '"name": "lookup"' in prompt and "Look up an order of the shop by its id." in prompt
    assert '<tool_call>{"name": "lookup", "arguments": {"id": "A17"}}</tool_call>' in prompt
    assert "<|tool|>3 x USB-C cable at 12.50<|end|>" in prompt
    assert "lookup" not in model.render(messages[:1])
    usage = bound.invoke(messages).usage_metadata
    assert usage is not None and usage["input_tokens"] == len(model.prompt_ids(messages, tools))
    with pytest.raises(ConfigError, match=r"tool_choice='any'.*None, 'auto' or 'none'"):
        model.bind_tools([lookup], tool_choice="any")


def test_agent_steps_reuse_the_previous_step(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    replies = [
        '<tool_call>{"name": "lookup", "arguments": {"id": "A17"}}</tool_call>',
        '<tool_call>{"name": "lookup", "arguments": {"id": "B42"}}</tool_call>',
        "A17 is 3 cables at 12.50, B42 a keyboard at 89.00.",
    ]
    model = chat(Scripted, llama, tokenizer, memory, replies=replies)
    agent = create_agent(model, tools=[lookup], system_prompt=SYSTEM)
    messages = agent.invoke({"messages": [HumanMessage("What do orders A17 and B42 cost?")]})["messages"]
    steps = [m for m in messages if isinstance(m, AIMessage)]
    observations = [m.content for m in messages if isinstance(m, ToolMessage)]
    assert observations == ["3 x USB-C cable at 12.50", "1 x keyboard at 89.00"]
    assert steps[-1].content == replies[-1] and len(steps) == 3
    usages = [s.usage_metadata for s in steps]
    assert usages[0] is not None and usages[0]["input_token_details"]["cache_read"] == 0
    for previous, usage in zip(usages, usages[1:]):
        assert previous is not None and usage is not None
        reused = usage["input_token_details"]["cache_read"]
        # every whole chunk of the step before, its reply included: computed are the tool result and the rest
        assert reused == (previous["input_tokens"] + previous["output_tokens"]) // BLOCK * BLOCK
        assert usage["input_tokens"] - reused < BLOCK + len("<|tool|>3 x USB-C cable at 12.50<|end|>")


def test_agent_streams_tokens_and_tool_calls_in_messages_mode(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    replies = ['Looking. <tool_call>{"name": "lookup", "arguments": {"id": "B42"}}</tool_call>', "Done."]
    agent = create_agent(chat(Scripted, llama, tokenizer, memory, replies=replies), tools=[lookup])
    streamed = list(agent.stream({"messages": [HumanMessage("B42?")]}, stream_mode="messages"))
    text = [str(m.content) for m, _ in streamed if isinstance(m, AIMessageChunk)]
    calls = [c for m, _ in streamed if isinstance(m, AIMessageChunk) for c in m.tool_call_chunks]
    assert "".join(text) == "Looking. Done." and text.count("") < len(text) // 2  # token by token
    assert [(c["name"], c["args"]) for c in calls] == [("lookup", '{"id": "B42"}')]
    assert [m.content for m, _ in streamed if isinstance(m, ToolMessage)] == ["1 x keyboard at 89.00"]


def test_bad_input_names_the_value_and_what_is_accepted(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    with pytest.raises(ConfigError, match=r"max_new_tokens=0.*>= 1"):
        chat(ChatTransformersKV, llama, tokenizer, memory, max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"temperature=-1.0"):
        chat(ChatTransformersKV, llama, tokenizer, memory, temperature=-1.0)
    with pytest.raises(ConfigError, match=r"max_new_tokens='many': Input should be a valid integer"):
        chat(ChatTransformersKV, llama, tokenizer, memory, max_new_tokens="many")
    other = LlamaForCausalLM(llama.config)
    with pytest.raises(ConfigError, match="PrefixCache over another model"):
        ChatTransformersKV(model=llama, tokenizer=tokenizer, memory=PrefixCache(other, memory))
    bare = byte_tokenizer()
    bare.chat_template = None
    with pytest.raises(ConfigError, match="no chat_template"):
        chat(ChatTransformersKV, llama, bare, memory)
    model = chat(ChatTransformersKV, llama, tokenizer, memory, max_new_tokens=2)
    with pytest.raises(UnsupportedMessage, match=r"message 1 is a ChatMessage.*AIMessage and ToolMessage"):
        model.invoke([HumanMessage("hi"), ChatMessage(role="critic", content="no")])
    image = HumanMessage([{"type": "image", "url": "https://example.com/a.png"}])
    with pytest.raises(UnsupportedMessage, match=r"content block of type 'image'.*text only"):
        model.invoke([image])
    with pytest.raises(ConfigError, match=r"unknown arguments \['top_k'\]"):
        model.invoke([HumanMessage("hi")], top_k=3)
    assert issubclass(UnsupportedMessage, KVMemError)


def test_sampling_with_a_seed_repeats_and_a_prefix_cache_may_be_shared(
    llama: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, memory: kvmem.Memory
) -> None:
    prefix = PrefixCache(llama, memory, block_size=BLOCK, compression="none")
    messages = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    replies = [
        ChatTransformersKV(
            model=llama, tokenizer=tokenizer, memory=prefix, temperature=1.0, seed=7, max_new_tokens=16
        ).invoke(messages)
        for _ in range(2)
    ]
    assert replies[0].content == replies[1].content  # the same seed, the same sample
    assert replies[0].usage_metadata and replies[0].usage_metadata["input_token_details"]["cache_read"] == 0
    assert replies[1].usage_metadata and replies[1].usage_metadata["input_token_details"]["cache_read"] > 0
    greedy = ChatTransformersKV(model=llama, tokenizer=tokenizer, memory=prefix, max_new_tokens=16)
    assert greedy.invoke(messages).content != replies[0].content
