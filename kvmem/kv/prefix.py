"""``PrefixCache``: skip prefill for prompt prefixes whose KV is already stored.

The prompt is cut into ``block_size``-token chunks with prefix-chained hashes
(:func:`kvmem.keys.chunk_hashes`) in a namespace naming the model (config and a
weight fingerprint), the KV dtype, the codec and the block size. ``prefill``
loads the longest run of stored chunks, runs the model on the rest only, and
stores the new chunks from a background thread once no request is in flight on
the memory (after the first token; see :class:`~kvmem.kv.background.WriteBehind`).

NOTE: at least the last prompt token is always computed, never loaded: the
logits of the last position are needed, and ``generate()`` given a cache that
covers the whole prompt re-feeds it and goes wrong.

A prompt whose KV depends on more than its token ids (a multimodal prompt,
whose image placeholder ids are the same for every image while the embeddings
at those positions are the image's) is prefilled from ``inputs_embeds`` and
keyed with a ``scope`` naming what else went into the embeddings (the image's
content hash and the encoder's identity): the scope is folded into every chunk
hash, so two images never share a chunk, while two turns about one image do.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

import torch
from transformers import DynamicCache, GenerationMixin

from kvmem.api import Memory, default_memory
from kvmem.codecs import parse_codec
from kvmem.errors import ConfigError, InvalidKeyError, UnsupportedModelError
from kvmem.keys import chunk_hashes, content_hash
from kvmem.kv.background import Prefetcher, WriteBehind
from kvmem.kv.fingerprint import model_fingerprint
from kvmem.kv.layout import (
    HeldLayers,
    cache_argument,
    held_layers,
    holds,
    new_cache,
    slice_chunk,
    trim_sliding_layers,
)
from kvmem.kv.predict import PredictivePrefetcher
from kvmem.kv.stream import ChunkLoadError, ChunkSource, LayerwiseLoader, StreamingCache

__all__ = ["PrefillResult", "PrefixCache"]

T = TypeVar("T")


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
        raise InvalidKeyError(
            f"input_ids of shape {tuple(ids.shape)} and dtype {ids.dtype}: expected one "
            "non-empty sequence of integer token ids, [n] or [1, n]"
        )
    return ids.long()


def _as_embeds(inputs_embeds: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
    """``inputs_embeds`` as ``[1, n, hidden]`` on ``ids``' device, checked against ``ids`` (``[1, n]``)."""
    if inputs_embeds is None:
        return None
    embeds = inputs_embeds.unsqueeze(0) if inputs_embeds.ndim == 2 else inputs_embeds
    if embeds.ndim != 3 or embeds.shape[:2] != ids.shape or not embeds.is_floating_point():
        raise InvalidKeyError(
            f"inputs_embeds of shape {tuple(inputs_embeds.shape)} and dtype {inputs_embeds.dtype}: "
            f"expected floating point [{ids.shape[1]}, hidden] or [1, {ids.shape[1]}, hidden], "
            "one vector per token of input_ids"
        )
    return embeds.to(ids.device)


def _check_scope(scope: str) -> str:
    if not isinstance(scope, str):
        raise InvalidKeyError(f"scope={scope!r:.80}: expected a str (e.g. an image's content hash)")
    return scope


class PrefixCache:
    """Prefix KV reuse for a transformers causal LM.

    Args:
        model: any transformers causal LM whose cache is a ``DynamicCache`` of full or
            sliding-window attention layers (Llama, Qwen2, Mistral, GPT-2, ...), or an
            image-text model whose language model is one (``LlavaForConditionalGeneration``:
            prefill it with ``inputs_embeds`` and a ``scope``, see :meth:`prefill`).
        memory: where chunks live (the module default when ``None``).
        block_size: tokens per chunk (default ``memory.config.block_size``).
        compression: codec for the chunks (default ``memory.config.compression``;
            ``fp16`` leaves 16-bit models' KV exact and halves fp32 KV, whose logits then differ slightly:
            ``none`` reproduces them exactly).
        namespace: an extra scope (e.g. a tenant); the model identity is always folded in.
        layerwise: stream the prefix in layer by layer behind the forward pass (default);
            ``False`` loads all of it before the forward pass starts.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        memory: Memory | None = None,
        *,
        block_size: int | None = None,
        compression: str | None = None,
        namespace: str = "",
        layerwise: bool = True,
    ) -> None:
        self.model = model
        self.layerwise = layerwise
        self.memory = memory if memory is not None else default_memory()
        self.block_size = block_size or self.memory.config.block_size
        self.codec = str(parse_codec(compression or self.memory.config.compression))
        self.fingerprint = model_fingerprint(model)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.namespace = f"kv/{self.fingerprint}/{dtype}/{self.codec}/{self.block_size}/{namespace}"
        self._cache_arg = cache_argument(model)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._writer = WriteBehind(activity=self.memory.activity)
        self.memory.add_writer(self._writer)
        self._prefetcher = Prefetcher(
            self._warm, self.memory.config.prefetch_depth, self.memory.metrics.prefetch_seconds.observe
        )
        self._predictor = PredictivePrefetcher(self.memory) if self.memory.config.predictive_prefetch else None

    # -- keys ---------------------------------------------------------------------
    def chunk_keys(self, input_ids: torch.Tensor | list[int], *, scope: str = "") -> list[str]:
        """Keys of the full chunks of ``input_ids`` in ``scope`` (see :meth:`prefill`)."""
        return chunk_hashes(_as_ids(input_ids)[0], self.block_size, self._chunk_namespace(scope))

    def lookup(self, input_ids: torch.Tensor | list[int], *, scope: str = "") -> int:
        """How many leading tokens of ``input_ids`` (in ``scope``) are stored (a multiple of ``block_size``)."""
        found = self.memory.contains_many(self.chunk_keys(input_ids, scope=scope), namespace=self.namespace)
        return (found.index(False) if False in found else len(found)) * self.block_size

    def _chunk_namespace(self, scope: str) -> str:
        """What the chunk hashes fold in: the namespace, and the scope when there is one.

        NOTE: a digest of both, not a concatenation, so no (namespace, scope) pair spells
        another; it is hex and never starts with ``kv/``, so no scoped key equals an unscoped one.
        """
        return content_hash(scope, self.namespace, "prefix-scope") if _check_scope(scope) else self.namespace

    # -- prefill -----------------------------------------------------------------
    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor | list[int],
        *,
        inputs_embeds: torch.Tensor | None = None,
        scope: str = "",
        logits_to_keep: int = 0,
    ) -> PrefillResult:
        """Run the model on ``input_ids`` with every stored prefix chunk loaded, not computed.

        New full chunks are stored in the background once no request is in flight on the memory, at most
        50 ms later (see :meth:`flush`).

        Args:
            input_ids: one sequence, ``[n]`` or ``[1, n]``; the chunks are keyed by them.
            inputs_embeds: what the model runs on instead of ``input_ids`` (``[n, hidden]`` or
                ``[1, n, hidden]``), e.g. text embeddings with image features at the image
                placeholder positions; the computed positions' rows are fed as ``inputs_embeds``.
            scope: folded into every chunk key. NOTE: the KV of a chunk must be a function
                of its prefix's ids and the scope: with ``inputs_embeds`` that are not the
                model's own embeddings of the ids, ``scope`` must name what else they depend
                on (the image's content hash and the encoder's identity), or another image's
                prefix would be reused.
            logits_to_keep: return logits of the last this many positions only (0: every
                computed position). ``1`` is what serving needs, and skips a
                ``[tokens, vocab]`` projection on a long miss.
        """
        start = time.perf_counter()
        ids = _as_ids(input_ids).to(self._device)
        embeds = _as_embeds(inputs_embeds, ids)
        keys = self.chunk_keys(ids, scope=scope)
        extra = {"logits_to_keep": logits_to_keep} if logits_to_keep and self._keeps_logits else {}

        def forward(cache: DynamicCache, reused: int) -> torch.Tensor:
            inputs = {"input_ids": ids[:, reused:]} if embeds is None else {"inputs_embeds": embeds[:, reused:]}
            out = self.model(**inputs, use_cache=True, **{self._cache_arg: cache}, **extra)
            return out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits

        # NOTE: the request ends as it returns: its stores, queued here, start then. A store started earlier
        # competes with this thread while it returns, for the interpreter lock and, on a small host, for the
        # cores torch's threads spin on after the forward pass
        with self.memory.activity:
            logits, cache, reused, loaded = self._with_prefix(keys, ids.shape[1], forward)
            self._store_new_chunks(ids, cache, keys, first=loaded)
            self._count_tokens(ids.shape[1], reused)
            self.memory.metrics.ttft_seconds.observe(time.perf_counter() - start)
            self._observed(keys)  # served: learning from it is not part of its time to first token
        return PrefillResult(cache, logits, reused, ids.shape[1] - reused)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | list[int], *, scope: str = "", **generate_kwargs: Any) -> Any:
        """``model.generate`` with the stored prefix (in ``scope``) loaded; less prefill, and the same tokens
        when the chunks are lossless (``compression="none"``, or ``fp16``/``bf16`` of a 16-bit model's KV).

        The chunks of the prompt *and* of the generated text are stored afterwards,
        so a follow-up turn that extends this conversation reuses all of it.
        """
        ids = _as_ids(input_ids).to(self._device)
        keys = self.chunk_keys(ids, scope=scope)

        def run(cache: DynamicCache, reused: int) -> Any:
            # a causal LM (the class's model) mixes in GenerationMixin; nn.Module types it as Tensor | Module
            model = cast(GenerationMixin, self.model)
            return model.generate(ids, use_cache=True, **{self._cache_arg: cache}, **generate_kwargs)

        out, cache, reused, loaded = self._with_prefix(keys, ids.shape[1], run)
        self._count_tokens(ids.shape[1], reused)
        seq = out.sequences if hasattr(out, "sequences") else out
        if seq.shape[0] == 1:
            stored = self.chunk_keys(seq, scope=scope)
            self._store_new_chunks(seq, cache, stored, first=loaded)
            self._observed(stored)
        return out

    def store(
        self,
        input_ids: torch.Tensor | list[int],
        cache: DynamicCache,
        *,
        scope: str = "",
        wait: bool = True,
        start: int = 0,
    ) -> int:
        """Store the full chunks of a cache you computed yourself for ``input_ids`` (in ``scope``).

        E.g. a prefill's cache after decoding on it: ``input_ids`` the prompt and the tokens fed since,
        ``start`` the prompt's full chunks (the prefill stored them already).

        Args:
            start: the first chunk to store; those before it are known stored and not queued again.

        Returns:
            How many chunks were queued for storing (chunks the cache no longer holds are skipped).
        """
        if start < 0:
            raise ConfigError(f"start={start!r}: a chunk index >= 0")
        ids = _as_ids(input_ids)
        keys = self.chunk_keys(ids, scope=scope)
        count = self._store_new_chunks(ids, cache, keys, first=start, trim=False)
        if wait:
            self.flush()
        return count

    def prefetch(self, input_ids: torch.Tensor | list[int], *, scope: str = "") -> Future[int]:
        """Warm the stored chunks of ``input_ids`` (in ``scope``) into the CPU tier; the future gives chunks found."""
        return self._prefetcher.prefetch(self.chunk_keys(input_ids, scope=scope))

    def flush(self) -> None:
        """Wait for background chunk stores (and predictive prefetch rounds) to finish."""
        self._writer.flush()
        if self._predictor is not None:
            self._predictor.flush()

    def close(self) -> None:
        """Finish background work."""
        self._writer.close()
        self._prefetcher.close()
        if self._predictor is not None:
            self._predictor.close()

    # -- internals ---------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _with_prefix(
        self, keys: list[str], total: int, run: Callable[[DynamicCache, int], T]
    ) -> tuple[T, DynamicCache, int, int]:
        """``run(cache, reused)`` with the stored prefix of a ``total``-token prompt streaming in.

        On a chunk that fails (corrupt, or its tier failed: see :meth:`_chunk_failed`), ``run``
        again on a fresh cache with the chunks before it only. NOTE: a layer-wise ``run``
        that took earlier layers with the longer prefix is abandoned, never completed, so
        no result ever mixes two prefix lengths.

        Returns:
            ``(run's result, cache, tokens reused, chunks known stored)``.
        """
        limit = total - 1  # NOTE: the last prompt token is always computed (see the module docstring)
        with self.memory.activity:  # a request in flight: predictive prefetch waits for its end
            while True:
                try:
                    cache, reused, sources = self._load_prefix(keys, limit, total)
                    result = run(cache, reused)
                except ChunkLoadError as exc:
                    self._chunk_failed(exc)
                    limit = min(limit, exc.index * self.block_size)  # strictly shorter: the loop ends
                    continue
                self._count_chunks(keys[: self._chunks_within(total - 1)], sources)
                return result, cache, reused, len(sources)

    def _load_prefix(self, keys: list[str], limit: int, total: int) -> tuple[DynamicCache, int, list[ChunkSource]]:
        """A cache set up to receive the longest stored run of ``keys``, at most ``limit`` tokens.

        The bytes stream in layer by layer behind the forward pass (or all before it
        with ``layerwise=False``); int8/int4 layers leave room for the rest of the
        ``total``-token prompt, which the first forward pass computes.

        Returns:
            ``(cache, tokens it will hold, the chunks' sources)``. NOTE: a chunk cut by
            ``limit`` (the last prompt token is always computed) is still a source: it is
            stored already, so it must not be stored again.
        """
        cache = new_cache(self.model, StreamingCache)
        store = self.memory.chunk_store()
        wanted = keys[: self._chunks_within(limit)]
        # NOTE: the first chunk alone first: a prompt that shares nothing stored (a miss) pays one lookup
        found = self.memory.contains_many(wanted[:1], namespace=self.namespace)
        if any(found):
            found += self.memory.contains_many(wanted[1:], namespace=self.namespace)
        sources: list[ChunkSource] = []
        for key, present in zip(keys, found):
            skey = self.memory.storage_key(key, self.namespace)
            tier = store.locate(skey) if present else None
            if tier is None:  # not stored, or gone since the probe: reuse stops here
                break
            sources.append(ChunkSource(skey, tier))
        reused = min(len(sources) * self.block_size, limit)
        if reused:
            assert isinstance(cache, StreamingCache)
            cache.loader = LayerwiseLoader(
                store, sources, cache, self.block_size, reused, self._device, room=total - reused
            )
            if not self.layerwise:
                cache.loader.wait_all(install=False)
        return cache, reused, sources

    def _chunks_within(self, limit: int) -> int:
        """How many chunks hold the first ``limit`` tokens (the last one possibly in part)."""
        return -(-limit // self.block_size)

    def _count_chunks(self, wanted: list[str], sources: list[ChunkSource]) -> None:
        """Count a hit per loaded chunk (per tier) and a miss per ``wanted`` chunk not loaded; warm the
        chunks served from below the top tier.

        A wanted chunk after the first one missing is a miss even when stored: the prompt
        computed it. So a cold and a warm run of one prompt read a hit rate of 0.5.
        """
        for src in sources:
            self.memory.metrics.kv_chunk_hits.labels(tier=src.tier).inc()
            self.memory.record_hits([src.key], src.tier)
        if len(wanted) > len(sources):
            self.memory.metrics.miss("tree", len(wanted) - len(sources))
        top = self.memory.chunk_store().top
        below = [key for key, src in zip(wanted, sources) if src.tier != top]
        if below:
            self._prefetcher.prefetch(below)

    def _chunk_failed(self, exc: ChunkLoadError) -> None:
        """Quarantine a corrupt chunk (counted).

        A tier that failed to serve one was counted and backed off by the store already.
        """
        if exc.corrupt and exc.key:
            self.memory.chunk_store().quarantine(exc.key, exc.tier, exc)

    def _store_new_chunks(
        self, ids: torch.Tensor, cache: DynamicCache, keys: list[str], first: int, trim: bool = True
    ) -> int:
        """Queue chunks ``first..`` that the cache holds for storing; then trim sliding layers.

        The chunks are sliced on the writer's thread, from the layers' tensors as they are now (a later
        update of the cache replaces them, never writes into them): the request pays for a list of them.
        """
        last = min(len(keys), cache.get_seq_length() // self.block_size)
        try:
            layers = held_layers(cache) if last > first else []
        except UnsupportedModelError:
            layers = []  # NOTE: a layer that holds no keys and values: nothing of this cache can be stored
        spans = [(i * self.block_size, (i + 1) * self.block_size) for i in range(first, last)] if layers else []
        # NOTE: a sliding layer of a cache we did not build may no longer hold a chunk: skipped
        jobs = [(keys[i], span) for i, span in zip(range(first, last), spans) if holds(layers, *span)]
        if trim:
            trim_sliding_layers(cache)
        for key, (start, stop) in jobs:
            self._writer.submit(partial(self._store_chunk, key, layers, start, stop))
        return len(jobs)

    def _store_chunk(self, key: str, layers: HeldLayers, start: int, stop: int) -> None:
        value = slice_chunk(layers, start, stop)
        self.memory.store(key, value, namespace=self.namespace, compression=self.codec)

    def _observed(self, keys: list[str]) -> None:
        """Tell the predictive prefetcher (``config.predictive_prefetch``) about a request's chunks."""
        if self._predictor is not None:
            self._predictor.observe(keys, namespace=self.namespace)

    def _warm(self, key: str) -> bool:
        return self.memory.chunk_store().warm(self.memory.storage_key(key, self.namespace))

    def _count_tokens(self, requested: int, reused: int) -> None:
        m = self.memory.metrics
        m.kv_tokens.labels(kind="requested").inc(requested)
        m.kv_tokens.labels(kind="reused").inc(reused)
        m.kv_tokens.labels(kind="computed").inc(requested - reused)
