"""``PrefixCache``: skip prefill for prompt prefixes whose KV is already stored.

The prompt is cut into ``block_size``-token chunks with prefix-chained hashes
(:func:`kvmem.keys.chunk_hashes`) in a namespace naming the model (config and a
weight fingerprint), the KV dtype, the codec and the block size. ``prefill``
loads the longest run of stored chunks, runs the model on the rest only, and
stores the new chunks from a background thread.

NOTE: at least the last prompt token is always computed, never loaded: the
logits of the last position are needed, and ``generate()`` given a cache that
covers the whole prompt re-feeds it and goes wrong.
"""

from __future__ import annotations

import inspect
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvmem.api import Memory, default_memory
from kvmem.codecs import parse_codec
from kvmem.errors import InvalidKeyError, UnsupportedModelError
from kvmem.keys import chunk_hashes
from kvmem.kv.fingerprint import model_fingerprint
from kvmem.kv.layout import cache_argument, chunk_value, install_prefix, new_cache, trim_sliding_layers
from kvmem.pipeline import Prefetcher, WriteBehind

__all__ = ["PrefixCache", "PrefillResult"]


@dataclass
class PrefillResult:
    """What :meth:`PrefixCache.prefill` computed.

    Attributes:
        cache: a transformers ``DynamicCache`` holding the whole prompt, ready for decoding.
        logits: logits of the computed positions only, ``[1, computed_tokens, vocab]``.
        reused_tokens: leading tokens whose KV was loaded instead of computed.
        computed_tokens: tokens the model ran on.
    """

    cache: DynamicCache
    logits: torch.Tensor
    reused_tokens: int
    computed_tokens: int


def _as_ids(input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0 or ids.dtype not in (torch.int64, torch.int32):
        raise InvalidKeyError(f"input_ids of shape {tuple(ids.shape)} and dtype {ids.dtype}: expected one "
                              "non-empty sequence of integer token ids, [n] or [1, n]")
    return ids.long()


class PrefixCache:
    """Prefix KV reuse for a transformers causal LM.

    Args:
        model: any transformers causal LM whose cache is a ``DynamicCache`` of full or
            sliding-window attention layers (Llama, Qwen2, Mistral, GPT-2, ...).
        memory: where chunks live (the module default when ``None``).
        block_size: tokens per chunk (default ``memory.config.block_size``).
        compression: codec for the chunks (default ``memory.config.compression``;
            ``fp16`` leaves 16-bit models' KV exact and halves fp32 KV).
        namespace: an extra scope (e.g. a tenant); the model identity is always folded in.
    """

    def __init__(self, model: torch.nn.Module, memory: Memory | None = None, *, block_size: int | None = None,
                 compression: str | None = None, namespace: str = "") -> None:
        self.model = model
        self.memory = memory if memory is not None else default_memory()
        self.block_size = block_size or self.memory.config.block_size
        self.codec = str(parse_codec(compression or self.memory.config.compression))
        self.fingerprint = model_fingerprint(model)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.namespace = f"kv/{self.fingerprint}/{dtype}/{self.codec}/{self.block_size}/{namespace}"
        self._cache_arg = cache_argument(model)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._writer = WriteBehind()
        self._prefetcher = Prefetcher(self._warm, self.memory.config.prefetch_depth,
                                      self.memory.metrics.prefetch_seconds.observe)

    # -- keys ---------------------------------------------------------------------
    def chunk_keys(self, input_ids: torch.Tensor | list[int]) -> list[str]:
        """Keys of the full chunks of ``input_ids``."""
        return chunk_hashes(_as_ids(input_ids)[0], self.block_size, self.namespace)

    def lookup(self, input_ids: torch.Tensor | list[int]) -> int:
        """How many leading tokens of ``input_ids`` are stored (a multiple of ``block_size``)."""
        found = self.memory.contains_many(self.chunk_keys(input_ids), namespace=self.namespace)
        return (found.index(False) if False in found else len(found)) * self.block_size

    # -- prefill -----------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor | list[int], *, logits_to_keep: int = 0) -> PrefillResult:
        """Run the model on ``input_ids`` with every stored prefix chunk loaded, not computed.

        New full chunks are stored in the background (see :meth:`flush`).

        Args:
            input_ids: one sequence, ``[n]`` or ``[1, n]``.
            logits_to_keep: return logits of the last this many positions only (0: every
                computed position). ``1`` is what serving needs, and skips a
                ``[tokens, vocab]`` projection on a long miss.
        """
        start = time.perf_counter()
        ids = _as_ids(input_ids).to(self._device)
        keys = self.chunk_keys(ids)
        cache, reused, loaded = self._load_prefix(keys, ids.shape[1] - 1)
        extra = {"logits_to_keep": logits_to_keep} if logits_to_keep and self._keeps_logits else {}
        out = self.model(ids[:, reused:], use_cache=True, **{self._cache_arg: cache}, **extra)
        self._store_new_chunks(ids, cache, keys, first=loaded)
        self._count_tokens(ids.shape[1], reused)
        self.memory.metrics.ttft_seconds.observe(time.perf_counter() - start)
        logits = out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits
        return PrefillResult(cache, logits, reused, ids.shape[1] - reused)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | list[int], **generate_kwargs: object) -> torch.Tensor:
        """``model.generate`` with the stored prefix loaded; same tokens, less prefill.

        The chunks of the prompt *and* of the generated text are stored afterwards,
        so a follow-up turn that extends this conversation reuses all of it.
        """
        ids = _as_ids(input_ids).to(self._device)
        keys = self.chunk_keys(ids)
        cache, reused, loaded = self._load_prefix(keys, ids.shape[1] - 1)
        self._count_tokens(ids.shape[1], reused)
        out = self.model.generate(ids, use_cache=True, **{self._cache_arg: cache}, **generate_kwargs)
        seq = out.sequences if hasattr(out, "sequences") else out
        if seq.shape[0] == 1:
            self._store_new_chunks(seq, cache, self.chunk_keys(seq), first=loaded)
        return out

    def store(self, input_ids: torch.Tensor | list[int], cache: DynamicCache, *, wait: bool = True) -> int:
        """Store the full chunks of a cache you computed yourself for ``input_ids``.

        Returns:
            How many chunks were queued for storing (chunks the cache no longer holds are skipped).
        """
        ids = _as_ids(input_ids)
        keys = self.chunk_keys(ids)
        count = self._store_new_chunks(ids, cache, keys, first=0, trim=False)
        if wait:
            self.flush()
        return count

    def prefetch(self, input_ids: torch.Tensor | list[int]) -> Future[int]:
        """Start warming the stored chunks of ``input_ids`` into the CPU tier; the future gives chunks found."""
        return self._prefetcher.prefetch(self.chunk_keys(input_ids))

    def flush(self) -> None:
        """Wait for background chunk stores to finish."""
        self._writer.flush()

    def close(self) -> None:
        """Finish background work."""
        self._writer.close()
        self._prefetcher.close()

    # -- internals ---------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _load_prefix(self, keys: list[str], limit: int) -> tuple[DynamicCache, int, int]:
        """A cache holding the longest stored run of ``keys``, cut to at most ``limit`` tokens.

        Returns:
            ``(cache, tokens it holds, chunks loaded)``. NOTE: a chunk cut by ``limit``
            still counts as loaded: it is stored already, so it must not be stored again.
        """
        cache = new_cache(self.model)
        found = self.memory.contains_many(keys, namespace=self.namespace)
        chunks = []
        for key, present in zip(keys, found):
            if not present:
                break
            loaded = self.memory.fetch(key, namespace=self.namespace, device=self._device)
            if loaded is None:  # evicted or corrupt since the probe: reuse stops here
                break
            self.memory.metrics.kv_chunk_hits.labels(tier=loaded.tier).inc()
            chunks.append(loaded.value)
        reused = min(len(chunks) * self.block_size, limit)
        if reused:
            for i in range(len(cache.layers)):
                k = torch.cat([c[i]["k"] for c in chunks], dim=-2)[:, :, :reused]
                v = torch.cat([c[i]["v"] for c in chunks], dim=-2)[:, :, :reused]
                install_prefix(cache, i, k, v)
        return cache, reused, len(chunks)

    def _store_new_chunks(self, ids: torch.Tensor, cache: DynamicCache, keys: list[str], first: int,
                          trim: bool = True) -> int:
        """Queue chunks ``first..`` that the cache holds for storing; then trim sliding layers."""
        held = cache.get_seq_length()
        jobs = []
        for i in range(first, min(len(keys), held // self.block_size)):
            try:
                jobs.append((keys[i], chunk_value(cache, i * self.block_size, (i + 1) * self.block_size)))
            except UnsupportedModelError:
                continue  # a sliding layer of a cache we did not build no longer holds this chunk
        if trim:
            trim_sliding_layers(cache)
        for key, value in jobs:
            self._writer.submit(lambda key=key, value=value: self._store_chunk(key, value))
        return len(jobs)

    def _store_chunk(self, key: str, value: list[dict[str, torch.Tensor]]) -> None:
        self.memory.store(key, value, namespace=self.namespace, compression=self.codec)

    def _warm(self, key: str) -> bool:
        return self.memory.tiers.warm(self.memory.storage_key(key, self.namespace))

    def _count_tokens(self, requested: int, reused: int) -> None:
        m = self.memory.metrics
        m.kv_tokens.labels(kind="requested").inc(requested)
        m.kv_tokens.labels(kind="reused").inc(reused)
        m.kv_tokens.labels(kind="computed").inc(requested - reused)
