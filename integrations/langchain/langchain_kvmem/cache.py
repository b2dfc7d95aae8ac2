"""``KVMemCache``: a LangChain LLM cache over kvmem, exact or semantic.

Exact (the default): a response list is stored under the content hash of
``(llm_string, prompt)``, so only the same prompt to the same model with the same
parameters hits.

Semantic (``semantic=True``): kvmem's :class:`~kvmem.semantic.SemanticCache` does
the work. What must match exactly never goes through embedding distance: the
``llm_string`` (model and parameters) and, for a chat model, every message but the
last human one are its exact partition. Only the last human message's text is
embedded, and a paraphrase of it hits when the strict verifier finds no differing
number, name, negation, ... (``capital of France`` never serves ``capital of
Germany``). A chat prompt whose last human message is not plain text (images,
content blocks) is cached exactly.

Chat models hand the cache their messages as ``langchain_core.load.dumps`` JSON;
it is read as plain JSON (no object is built from it). Responses are stored as
``dumps`` JSON and revived with ``loads(..., allowed_objects="core")``: never pickle.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from langchain_core.caches import RETURN_VAL_TYPE, BaseCache
from langchain_core.load import dumps, loads
from langchain_core.outputs import Generation

import kvmem
from kvmem.semantic import SemanticCache

__all__ = ["KVMemCache"]

log = logging.getLogger(__name__)

# metadata fields of the entries in the cache's own namespace; clear() reads them back
_KEY = "langchain_key"  # the entry's full key
_SEMANTIC_NAMESPACE = "semantic_namespace"  # registry entry: where a SemanticCache entry lives ...
_SEMANTIC_TEXT = "semantic_text"  # ... and its key (the embedded text)

Target = tuple[str | list[dict[str, str]], dict[str, Any]]  # (SemanticCache prompt, partition)


class KVMemCache(BaseCache):
    """A LangChain LLM cache (``set_llm_cache(...)`` or a model's ``cache=``) over a :class:`kvmem.Memory`.

    The async methods are ``BaseCache``'s defaults, which run the sync ones in the event
    loop's executor: embedding and disk I/O never block the loop.

    Args:
        memory: where responses are stored (default: :func:`kvmem.default_memory`).
        namespace: kvmem namespace of the exact entries; also folded into every semantic
            entry's partition, so caches on different namespaces never share entries.
        semantic: also serve verified paraphrases of a prompt (loads the embedder on first use).
        threshold: cosine floor of a semantic hit (``None``: the embedder's calibrated default).
        verify: run kvmem's strict verifier on semantic candidates (on by default).
    """

    def __init__(
        self,
        memory: kvmem.Memory | None = None,
        *,
        namespace: str = "langchain/llm-cache",
        semantic: bool = False,
        threshold: float | None = None,
        verify: bool = True,
    ) -> None:
        self.memory = memory if memory is not None else kvmem.default_memory()
        self.namespace = namespace
        self.semantic = (
            SemanticCache(self.memory, threshold=threshold, verify=verify, namespace=namespace) if semantic else None
        )

    def lookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        """The generations cached for ``prompt`` under ``llm_string`` (or a verified paraphrase), or ``None``."""
        semantic, target = self.semantic, self._semantic_target(prompt, llm_string)
        if semantic is None or target is None:
            loaded = self.memory.fetch(_exact_key(prompt, llm_string), namespace=self.namespace)
            raw = loaded.value if loaded is not None else None
        else:
            raw = semantic.get(*target)
        return _decode(raw)

    def update(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        """Cache ``return_val`` (a list of ``Generation``) for ``prompt`` under ``llm_string``."""
        raw = dumps(list(return_val))
        semantic, target = self.semantic, self._semantic_target(prompt, llm_string)
        if semantic is None or target is None:
            key = _exact_key(prompt, llm_string)
            self.memory.store(key, raw, namespace=self.namespace, metadata={_KEY: key})
            return
        prompt_or_chat, partition = target
        semantic.put(prompt_or_chat, raw, partition)
        # SemanticCache namespaces are hashes: record where the entry went, for clear()
        namespace, text = semantic.split(prompt_or_chat, partition)
        key = kvmem.content_hash(json.dumps([namespace, text]), "registry")
        self.memory.store(
            key,
            None,
            namespace=self.namespace,
            metadata={_KEY: key, _SEMANTIC_NAMESPACE: namespace, _SEMANTIC_TEXT: text},
        )

    def clear(self, **kwargs: Any) -> None:
        """Remove every entry of this cache (exact and semantic), for every process sharing the memory."""
        for entry in list(self.memory.entries(self.namespace)):
            meta = entry.metadata
            if isinstance(meta.get(_SEMANTIC_NAMESPACE), str) and isinstance(meta.get(_SEMANTIC_TEXT), str):
                self.memory.delete(meta[_SEMANTIC_TEXT], namespace=meta[_SEMANTIC_NAMESPACE])
            if isinstance(meta.get(_KEY), str):
                self.memory.delete(meta[_KEY], namespace=self.namespace)

    def __repr__(self) -> str:
        return (
            f"KVMemCache(path={self.memory.config.path!r}, namespace={self.namespace!r}, "
            f"semantic={self.semantic is not None})"
        )

    def _semantic_target(self, prompt: str, llm_string: str) -> Target | None:
        """``(prompt, partition)`` to hand the SemanticCache, or ``None`` when ``prompt`` is cached exactly."""
        if self.semantic is None:
            return None
        messages = _serialized_messages(prompt)
        if messages is None:  # a completion model's plain prompt: all of it is embedded
            return prompt, {"llm_string": llm_string}
        last = max((i for i, m in enumerate(messages) if m["kwargs"].get("type") == "human"), default=None)
        if last is None or not isinstance(messages[last]["kwargs"].get("content"), str):
            return None
        chat = [
            {"role": "user", "content": m["kwargs"]["content"]}
            if i == last
            # NOTE: roles are class names, never "user": SemanticCache embeds only the last "user" message
            else {"role": m["id"][-1], "content": _canonical(m)}
            for i, m in enumerate(messages)
        ]
        # the last human message's other fields (name, additional_kwargs, ...) are exact as well
        fields = {k: v for k, v in messages[last]["kwargs"].items() if k != "content"}
        return chat, {"llm_string": llm_string, "message": {"class": messages[last]["id"], "fields": fields}}


def _exact_key(prompt: str, llm_string: str) -> str:
    """The kvmem key of an exact entry: a hash of both strings, neither readable in the catalog."""
    return kvmem.content_hash(json.dumps([llm_string, prompt]), "exact")  # ASCII JSON: any str hashes


def _canonical(message: dict[str, Any]) -> str:
    """A serialized message as sorted JSON (an exact part of a partition)."""
    return json.dumps(message, sort_keys=True, separators=(",", ":"))


def _serialized_messages(prompt: str) -> list[dict[str, Any]] | None:
    """The messages of a chat model's prompt (``dumps`` of a message list) as parsed JSON, or ``None``."""
    if not prompt.startswith("["):
        return None
    try:
        data = json.loads(prompt)
    except ValueError:
        return None
    if not isinstance(data, list) or not data or not all(_is_message(m) for m in data):
        return None
    return data


def _is_message(item: object) -> bool:
    """Whether ``item`` is a ``dumps``-serialized LangChain message."""
    return (
        isinstance(item, dict)
        and item.get("lc") == 1
        and item.get("type") == "constructor"
        and isinstance(item.get("id"), list)
        and item["id"][:3] == ["langchain", "schema", "messages"]
        and all(isinstance(part, str) for part in item["id"])
        and isinstance(item.get("kwargs"), dict)
    )


def _decode(raw: object) -> list[Generation] | None:
    """Generations revived from a stored ``dumps`` string; anything else is a miss."""
    if not isinstance(raw, str):
        return None
    try:
        value = loads(raw, allowed_objects="core")
    except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
        # an entry this version cannot revive (e.g. written by a newer langchain) is a miss, not an error
        log.warning("langchain_kvmem: cached generations could not be loaded (%s); treated as a miss", exc)
        return None
    if not isinstance(value, Sequence) or not all(isinstance(g, Generation) for g in value):
        return None
    return list(value)
