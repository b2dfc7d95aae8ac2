"""``SemanticCache``: an LLM-response cache keyed by prompt meaning, partitioned exactly.

What must match *exactly* never goes through embedding distance: the partition
(model string, sampling parameters, system prompt, ... as a dict), the optional
user namespace and, for chat prompts, every message before the embedded part
are hashed canonically (sorted JSON, sha256 via :func:`kvmem.keys.content_hash`)
into the kvmem namespace an entry lives in. Lookups search only that namespace,
so two partitions can never see each other's entries.

What is embedded (and compared by similarity plus the strict verifier) is the
prompt text: a plain string as given, or for a chat prompt (a list of
``{"role", "content"}`` messages) the last user message, preceded by ``turns``
prior messages.

Each response is stored under the embedded text as its key, so an identical
prompt is found by an exact load without running the embedder; only a miss
there falls back to :meth:`Memory.lookup_similar`.

TTL: ``put(..., ttl=)`` records an absolute expiry (seconds on ``clock``) in the
entry's metadata; :meth:`SemanticCache.get` never returns an expired entry and
deletes it when met.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvmem.errors import ConfigError, UnsupportedValueError
from kvmem.keys import content_hash

if TYPE_CHECKING:
    from kvmem.api import Memory

__all__ = ["Message", "Prompt", "SemanticCache"]

Message = Mapping[str, str]
Prompt = str | Sequence[Message]

_EXPIRES = "kvmem_semcache_expires_at"
_NAMESPACE_PREFIX = "kvmem-semcache:"
_SIMILAR_CANDIDATES = 4


class SemanticCache:
    """Semantic cache of LLM responses over a :class:`~kvmem.api.Memory`.

    Args:
        memory: where entries (and their prompt vectors) are stored.
        threshold: cosine floor of a similar hit; ``None``: the embedder's calibrated default.
        verify: run the strict verifier (:mod:`kvmem.semantic.verify`) on similar candidates.
        turns: how many messages before the last user message of a chat prompt are
            embedded with it (the rest before them are an exact filter).
        namespace: user namespace (tenant), folded into every entry's partition.
        clock: seconds now, for TTLs (default :func:`time.time`; inject one in tests).
    """

    def __init__(
        self,
        memory: Memory,
        threshold: float | None = None,
        verify: bool = True,
        turns: int = 0,
        *,
        namespace: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if turns < 0:
            raise ConfigError(f"turns={turns}: accepted an integer >= 0")
        self.memory = memory
        self.threshold = threshold
        self.verify = verify
        self.turns = turns
        self.namespace = namespace or ""
        self.clock = clock

    # -- keys -----------------------------------------------------------------------
    def split(self, prompt: Prompt, partition: Mapping[str, Any] | None = None) -> tuple[str, str]:
        """The ``(kvmem namespace, embedded text)`` of ``prompt`` in ``partition``.

        Raises:
            UnsupportedValueError: a chat prompt without a user message, or a message without
                str ``role``/``content``.
            TypeError: a partition value that is not JSON-able.
        """
        if isinstance(prompt, str):
            text, history = prompt, []
        else:
            messages = [_message(m) for m in prompt]
            last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
            if last is None:
                raise UnsupportedValueError(
                    "chat prompt without a user message: accepted a str, or messages with at least one role 'user'"
                )
            first = max(0, last - self.turns)
            text = "\n".join(m["content"] for m in messages[first : last + 1])
            # messages after the last user message (rare) are exact context as well
            history = messages[:first] + messages[last + 1 :]
        exact = json.dumps(
            {"partition": dict(partition or {}), "history": history, "turns": self.turns},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )
        return _NAMESPACE_PREFIX + content_hash(exact, self.namespace), text

    # -- operations -----------------------------------------------------------------
    def put(
        self, prompt: Prompt, response: Any, partition: Mapping[str, Any] | None = None, ttl: float | None = None
    ) -> str:
        """Cache ``response`` (any value :meth:`Memory.store` takes, e.g. JSON) for ``prompt``.

        Args:
            prompt: a string, or chat messages (``[{"role": ..., "content": ...}, ...]``).
            response: the value returned by a later :meth:`get`.
            partition: exact filter, e.g. ``{"llm": "model-x", "system": system_prompt}``.
            ttl: seconds the entry may hit (``None``: until evicted or invalidated).

        Returns:
            The entry's storage key.
        """
        if ttl is not None and ttl < 0:
            raise ConfigError(f"ttl={ttl}: accepted seconds >= 0, or None for no expiry")
        namespace, text = self.split(prompt, partition)
        metadata = {_EXPIRES: self.clock() + ttl} if ttl is not None else {}
        return self.memory.store(text, response, metadata=metadata, namespace=namespace, text=text)

    def get(self, prompt: Prompt, partition: Mapping[str, Any] | None = None) -> Any | None:
        """The response cached for ``prompt`` (or a verified paraphrase of it) in ``partition``, or ``None``."""
        found = self._find(prompt, partition)
        return found[1] if found is not None else None

    async def aput(
        self, prompt: Prompt, response: Any, partition: Mapping[str, Any] | None = None, ttl: float | None = None
    ) -> str:
        """:meth:`put` in a worker thread (embedding and disk writes do not block the event loop)."""
        return await asyncio.to_thread(self.put, prompt, response, partition, ttl)

    async def aget(self, prompt: Prompt, partition: Mapping[str, Any] | None = None) -> Any | None:
        """:meth:`get` in a worker thread (embedding and disk reads do not block the event loop)."""
        return await asyncio.to_thread(self.get, prompt, partition)

    def invalidate(self, prompt: Prompt, partition: Mapping[str, Any] | None = None) -> bool:
        """Remove the entry :meth:`get` would return for ``prompt`` (e.g. a bad similar hit); whether one was."""
        found = self._find(prompt, partition)
        if found is None:
            return False
        namespace, _ = self.split(prompt, partition)
        return self.memory.delete(found[0], namespace=namespace)

    # -- internals --------------------------------------------------------------------
    def _find(self, prompt: Prompt, partition: Mapping[str, Any] | None) -> tuple[str, Any] | None:
        """``(stored prompt text, response)`` of the live entry for ``prompt``, exact before similar."""
        namespace, text = self.split(prompt, partition)
        value = self._live(text, namespace)
        if value is not None:
            return text, value[0]
        for match in self.memory.lookup_similar(
            text, _SIMILAR_CANDIDATES, namespace=namespace, threshold=self.threshold, verify=self.verify
        ):
            if match.text == text:
                continue  # the exact entry, already found expired (and deleted) above
            value = self._live(match.text, namespace)
            if value is not None:
                return match.text, value[0]
        return None

    def _live(self, text: str, namespace: str) -> tuple[Any] | None:
        """The value stored under ``text``, boxed, unless missing or expired (an expired one is deleted)."""
        loaded = self.memory.fetch(text, namespace=namespace)
        if loaded is None:
            return None
        expires = loaded.metadata.get(_EXPIRES)
        if expires is not None and self.clock() >= float(expires):
            self.memory.delete(text, namespace=namespace)
            return None
        return (loaded.value,)


def _message(message: Message) -> dict[str, str]:
    """A chat message reduced to its ``role`` and ``content`` strings."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
        raise UnsupportedValueError(f"chat message {dict(message)!r:.120}: expected str 'role' and 'content'")
    return {"role": role, "content": content}
