"""``ChatTransformersKV``: a LangChain chat model over a local transformers causal LM, its prompts prefilled
through kvmem's :class:`~kvmem.kv.PrefixCache`.

Each call renders the messages (and the bound tools) with the tokenizer's chat template, loads every stored
full chunk of the prompt instead of computing it, computes the rest, and decodes on the cache the prefill
returned. In an agent loop each prompt extends the previous one, so a call computes little more than what
was added since (the tool result, the new turn): ``usage_metadata["input_token_details"]`` says how many
prompt tokens were read from kvmem (``cache_read``) and how many were computed (``computed``).

Tool calls are read from the output in the Hermes / Qwen convention (``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, see :func:`~langchain_kvmem._chat_format.parse_tool_calls`): the model's chat template
should render ``tools`` and assistant ``tool_calls`` that way, as Qwen2.5's and Hermes' do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, PrivateAttr, ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import kvmem
from kvmem.errors import ConfigError
from kvmem.kv import PrefillResult, PrefixCache
from kvmem.kv.layout import cache_argument
from langchain_kvmem._chat_format import parse_tool_calls, streamable, to_template_messages

__all__ = ["ChatTransformersKV"]

_TOOL_CHOICES = (None, "auto", "none")


class ChatTransformersKV(BaseChatModel):
    """A chat model over a local causal LM whose every prompt prefix stored in kvmem is loaded, not computed.

    Args:
        model: a transformers causal LM, already loaded (nothing is downloaded).
        tokenizer: its tokenizer, with a chat template.
        memory: where the prompt chunks live: a :class:`kvmem.Memory` (a :class:`~kvmem.kv.PrefixCache` is
            made over it, with ``block_size`` and ``compression``), or a ``PrefixCache`` over ``model``.
        max_new_tokens: at most this many tokens per reply (at least 1).
        temperature: 0 (the default) decodes greedily; above 0 samples, seeded by ``seed``.
        seed: the sampler's seed (``None``: torch's default generator).
        block_size: tokens per chunk of a ``PrefixCache`` made here (default: the memory's).
        compression: its codec (default: the memory's); ``"none"`` reproduces a plain decode token for token.
        **kwargs: fields of ``BaseChatModel`` (``callbacks``, ``tags``, ``metadata``, ...) or of a subclass.

    Raises:
        ConfigError: ``max_new_tokens`` below 1, a negative ``temperature``, a tokenizer without a chat
            template, a ``PrefixCache`` over another model, or a value of the wrong type.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    memory: kvmem.Memory | PrefixCache
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None
    block_size: int | None = None
    compression: str | None = None

    _prefix: PrefixCache = PrivateAttr()
    _owns_prefix: bool = PrivateAttr(default=False)
    _stops: frozenset[int] = PrivateAttr(default=frozenset())
    _generator: torch.Generator | None = PrivateAttr(default=None)
    _cache_arg: str = PrivateAttr(default="past_key_values")

    def __init__(
        self,
        *,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        memory: kvmem.Memory | PrefixCache,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        block_size: int | None = None,
        compression: str | None = None,
        **kwargs: Any,
    ) -> None:
        fields: dict[str, Any] = {
            "model": model,
            "tokenizer": tokenizer,
            "memory": memory,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            "block_size": block_size,
            "compression": compression,
        }
        try:
            super().__init__(**fields, **kwargs)
        except ValidationError as exc:
            bad = (f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"ChatTransformersKV: {'; '.join(bad)}") from None
        self._check()
        if isinstance(self.memory, PrefixCache):
            self._prefix = self.memory
        else:
            self._prefix = PrefixCache(
                self.model, self.memory, block_size=self.block_size, compression=self.compression
            )
            self._owns_prefix = True
        self._cache_arg = cache_argument(self.model)
        self._stops = frozenset(_eos_ids(self.model, self.tokenizer))
        if self.seed is not None:
            self._generator = torch.Generator(device=self.model.device).manual_seed(self.seed)

    def _check(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r}: a reply needs at least 1 token (an int >= 1)")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature!r}: 0 decodes greedily, above 0 samples")
        if not self.tokenizer.chat_template:
            raise ConfigError(
                f"tokenizer {type(self.tokenizer).__name__} has no chat_template: ChatTransformersKV renders "
                "messages with one (set tokenizer.chat_template to a Jinja template)"
            )
        if isinstance(self.memory, PrefixCache) and self.memory.model is not self.model:
            raise ConfigError("memory is a PrefixCache over another model: pass one over this model, or a Memory")

    @property
    def prefix_cache(self) -> PrefixCache:
        """The :class:`~kvmem.kv.PrefixCache` every prompt is prefilled through."""
        return self._prefix

    @property
    def _llm_type(self) -> str:
        return "transformers-kvmem"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model.name_or_path,
            "namespace": self._prefix.namespace,  # the model's weights fingerprint, dtype, codec, block size
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
        }

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """The model with ``tools`` (converted by ``convert_to_openai_tool``) rendered into every prompt.

        Raises:
            ConfigError: a ``tool_choice`` other than ``None``, ``"auto"`` or ``"none"`` (a local model's
                choice of tool cannot be forced here).
        """
        if tool_choice not in _TOOL_CHOICES:
            raise ConfigError(f"tool_choice={tool_choice!r}: ChatTransformersKV accepts None, 'auto' or 'none'")
        formatted = [] if tool_choice == "none" else [convert_to_openai_tool(tool) for tool in tools]
        return super().bind(tools=formatted, **kwargs)

    def render(self, messages: Sequence[BaseMessage], tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` (and ``tools``, OpenAI tool dicts) by the chat template.

        Raises:
            UnsupportedMessage: a message the template cannot be given (see ``to_template_messages``).
        """
        text = self.tokenizer.apply_chat_template(
            cast(Any, to_template_messages(messages)),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
        return str(text)

    def prompt_ids(self, messages: Sequence[BaseMessage], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of :meth:`render`'s prompt (the template writes any special tokens itself)."""
        ids = self.tokenizer(self.render(messages, tools), add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    def close(self) -> None:
        """Finish the background chunk stores of a ``PrefixCache`` made here (one passed in is left open)."""
        if self._owns_prefix:
            self._prefix.close()

    # -- generation ----------------------------------------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # NOTE: invoke is the stream merged, so the two never differ
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        tools = kwargs.pop("tools", None)
        if kwargs:
            raise ConfigError(f"unknown arguments {sorted(kwargs)}: ChatTransformersKV accepts stop and tools")
        ids = self.prompt_ids(messages, tools)
        result = self._prefill(ids)
        out: list[int] = []
        text, sent, reason = "", 0, "length"
        for token in self._tokens(result, out):
            out.append(token)
            text = str(self.tokenizer.decode(out, skip_special_tokens=True))
            end = _stop_at(text, stop)
            if end is not None:
                text, reason = text[:end], "stop"
                break
            ready = min(
                streamable(text, stop or ()), len(text.rstrip("\ufffd"))
            )  # NOTE: a partial UTF-8 char may change
            if ready > sent:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=text[sent:ready]))
                if run_manager:
                    run_manager.on_llm_new_token(text[sent:ready], chunk=chunk)
                yield chunk
                sent = ready
        else:
            reason = "length" if len(out) >= self.max_new_tokens else "stop"
        self._store_reply(ids, out, result)
        yield self._last_chunk(text[sent:], len(ids), len(out), result.reused_tokens, reason)

    def _prefill(self, ids: list[int]) -> PrefillResult:
        """The prompt ``ids`` prefilled through the ``PrefixCache`` (the last position's logits kept).

        A subclass may override it, with :meth:`_store_reply`: a benchmark's plain reference computes the whole
        prompt and stores nothing.
        """
        return self._prefix.prefill(ids, logits_to_keep=1)

    def _tokens(self, result: PrefillResult, out: list[int]) -> Iterator[int]:
        """The reply's tokens, decoded on ``result.cache`` (its end-of-sequence token left out)."""
        logits = result.logits[0, -1]
        while len(out) < self.max_new_tokens:
            token = self._pick_token(logits, out)
            if token in self._stops:
                return
            yield token
            if len(out) >= self.max_new_tokens:
                return
            step = torch.tensor([[token]], device=self.model.device)
            with torch.no_grad():
                cache = {self._cache_arg: result.cache}
                logits = self.model(input_ids=step, use_cache=True, **cache).logits[0, -1]

    def _store_reply(self, prompt: list[int], reply: list[int], result: PrefillResult) -> None:
        """Store the full chunks decoded since the prefill (which stored the prompt's), and wait for both.

        NOTE: stored when the call returns, so the next call of the conversation, whose prompt re-renders this
        reply, reuses them as far as the template writes the reply as the model did, token for token.
        """
        fed = (prompt + reply)[: result.cache.get_seq_length()]  # the last token picked was never fed
        self._prefix.store(fed, result.cache, wait=False, start=len(prompt) // self._prefix.block_size)
        self._prefix.flush()

    def _pick_token(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        """The next token from the last position's ``logits`` (``generated``: the reply's tokens so far).

        Greedy at ``temperature=0``, else sampled; a subclass may override it (e.g. to constrain the output).
        """
        if self.temperature == 0:
            return int(logits.argmax(-1))
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator))

    def _last_chunk(self, rest: str, prompt: int, output: int, reused: int, reason: str) -> ChatGenerationChunk:
        """The reply's last chunk: the text not streamed yet less its tool calls, the calls, the usage."""
        content, calls = parse_tool_calls(rest)
        details = cast(InputTokenDetails, {"cache_read": reused, "computed": prompt - reused})
        usage = UsageMetadata(
            input_tokens=prompt, output_tokens=output, total_tokens=prompt + output, input_token_details=details
        )
        message = AIMessageChunk(
            content=content,
            tool_call_chunks=[
                tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                for i, c in enumerate(calls)
            ],
            usage_metadata=usage,
            response_metadata={
                "model_name": self.model.name_or_path,
                "finish_reason": "tool_calls" if calls else reason,
            },
        )
        return ChatGenerationChunk(message=message)


def _stop_at(text: str, stop: Sequence[str] | None) -> int | None:
    """Where the first stop string in ``text`` begins (``None``: none there)."""
    found = [i for i in (text.find(s) for s in stop or () if s) if i >= 0]
    return min(found) if found else None


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The model's end-of-sequence ids (generation config, config) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
