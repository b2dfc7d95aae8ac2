"""``BlendCache``: reuse the KV of documents wherever they land in a prompt (CacheBlend, EuroSys '25).

Prefix reuse only helps when the shared text comes first. A retrieval-augmented
prompt is ``system + doc_7 + doc_2 + question`` one time and ``system + doc_2 +
doc_9 + question`` the next: the documents recur, their positions and neighbours
do not. ``BlendCache`` stores each reusable segment's KV once, computed on its own
at positions ``0..n-1`` and keyed by its token ids and the model (never by its
position), and on a prompt that contains it:

1. loads it and re-rotates its keys by the segment's start position (RoPE is a
   rotation, so rotating a key computed at ``t`` by ``p`` gives the key at ``t + p``);
2. runs the layers below ``check_layer`` on every token (their inputs are what the
   check needs), and at ``check_layer`` measures, per reused token, how far the
   value vectors it would get now deviate from the loaded ones (CacheBlend's
   "high KV deviation" tokens: those whose meaning depends on what precedes them);
3. runs the layers from ``check_layer`` up on the ``recompute_ratio`` most deviating
   reused tokens, every token of a non-reusable segment and the last
   ``logits_to_keep`` tokens only, their new K/V written over the loaded ones, every
   other token keeping its loaded (re-rotated) K/V.

NOTE: layer 0's K/V of a reused token are exact after the rotation (its input is the
token's embedding alone), so the first deviation shows at layer 1, the default
``check_layer``. By default the selection is made once there, by values, and kept for
the layers above; ``filter_layers`` and ``deviation`` give CacheBlend's gradual
filtering by keys and values, closer to the full prefill at the same ratio on
``bench_blend``'s retrieval task, and slower (it computes more tokens in the first layers).
``recompute_ratio=1`` computes every token at every layer: a full prefill.

Supported position encodings: rotary embeddings whose angle is ``position x inv_freq``
with frequencies fixed at start-up (``rope_type`` ``default``, ``linear``, ``llama3``,
``yarn``, whose attention scaling is divided out of the re-rotation), where a rotation
by ``p`` composes exactly, per layer type where a model has several (Gemma 3's sliding
and global layers). ``dynamic`` and ``longrope`` change their frequencies with the
sequence's length, so a segment computed alone was rotated with other ones: they raise
:class:`UnsupportedModelError`, as do other types. Works on transformers 5 Llama-family
decoders (``model.model.layers`` of decoder layers taking ``position_embeddings``: Llama,
Qwen 2 and 3 (q/k norms come before RoPE, so stored keys rotate as Llama's), Mistral,
Gemma 2 and 3 with their sliding windows and Gemma 2's soft-capped logits), with SDPA or
eager attention, CPU or GPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvmem.api import Memory, default_memory
from kvmem.codecs import parse_codec
from kvmem.errors import ConfigError, InvalidKeyError, UnsupportedModelError
from kvmem.keys import content_hash
from kvmem.kv.background import WriteBehind
from kvmem.kv.blend_mask import attention_mask
from kvmem.kv.fingerprint import model_fingerprint
from kvmem.kv.layout import ChunkValue, cache_argument, chunk_value, install_prefix, new_cache, trim_sliding_layers

__all__ = ["BlendCache", "BlendResult", "Segment", "SUPPORTED_ROPE_TYPES"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEVIATIONS = ("values", "keys_values")
# NOTE: their frequencies depend on the sequence's length: a segment computed alone is rotated by other ones
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens: a document whose KV may be reused anywhere, or text computed every time.

    Attributes:
        ids: token ids, ``[n]`` or ``[1, n]`` (a tensor or a list), ``n >= 1``.
        reusable: store this segment's KV by its content and reuse it at any position
            (documents); ``False`` for text that changes every request (a question).
    """

    ids: torch.Tensor | list[int]
    reusable: bool = True
    tokens: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = torch.as_tensor(self.ids)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.numel() == 0 or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidKeyError(
                f"segment ids of shape {tuple(ids.shape)} and dtype {ids.dtype}: expected a non-empty "
                "sequence of integer token ids, [n] or [1, n]"
            )
        object.__setattr__(self, "tokens", ids.long())


@dataclass
class BlendResult:
    """What :meth:`BlendCache.prefill` computed.

    Attributes:
        cache: a ``DynamicCache`` holding the whole prompt, ready for decoding.
        logits: logits of the last ``logits_to_keep`` positions, ``[1, logits_to_keep, vocab]``.
        reused_tokens: tokens of reusable segments whose loaded KV was kept above ``check_layer``.
        recomputed_tokens: tokens run through the layers from ``check_layer`` up.
        loaded_segments: reusable segments whose KV was found stored.
        stored_segments: reusable segments computed (on their own) and queued for storing.
    """

    cache: DynamicCache
    logits: torch.Tensor
    reused_tokens: int
    recomputed_tokens: int
    loaded_segments: int
    stored_segments: int


def _check_ratio(ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"recompute_ratio={ratio!r}: expected a number from 0.0 to 1.0 (CacheBlend uses 0.15)")
    return float(ratio)


class _BlendKV:
    """The cache the decoder layers see: each layer's K/V for the whole prompt, in ``[1, H, N, D]`` buffers.

    ``update`` writes the computed tokens' K/V at their positions (``index``; ``None``:
    every token, in order) and returns the whole prompt's K/V to attend to.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys
        self.values = values
        self.index: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index is None:
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        else:
            self.keys[layer_idx].index_copy_(2, self.index, key_states.to(self.keys[layer_idx].dtype))
            self.values[layer_idx].index_copy_(2, self.index, value_states.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]


@dataclass
class _Pass:
    """What every layer from here up needs about the computed positions, made once per prefill.

    Attributes:
        total: the prompt's length.
        positions: the computed positions, ``[1, q]`` (sorted).
        rope: per rotary kind (:attr:`BlendCache._rope_kinds`), the ``(cos, sin)`` at those positions.
        masks: per sliding window (``None``: full attention), the attention mask (:meth:`BlendCache._mask`).
    """

    total: int
    positions: torch.Tensor
    rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]]
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    @property
    def index(self) -> torch.Tensor | None:
        """The computed positions as ``[q]``; ``None`` when every position is computed, in order."""
        return None if self.positions.shape[1] == self.total else self.positions[0]


class BlendCache:
    """Position-independent KV reuse of prompt segments, with CacheBlend's selective recompute.

    Args:
        model: a transformers 5 causal LM of the Llama family (Llama, Qwen2, Mistral, ...)
            with rotary position embeddings of a supported ``rope_type`` (see the module docstring).
        memory: where segments' KV lives (the module default when ``None``).
        recompute_ratio: share of the reused tokens recomputed from ``check_layer`` up (0.15, as the paper).
        check_layer: the layer whose KV deviation picks the tokens to recompute (>= 1).
        filter_layers: over how many layers from ``check_layer`` the selection narrows (CacheBlend's gradual
            filtering): ``2 x recompute_ratio`` of the reused tokens at ``check_layer``, down to
            ``recompute_ratio`` at ``check_layer + filter_layers - 1``, each layer picking among the tokens
            the one below it computed; 1: one selection at ``check_layer``.
        deviation: what the deviation is measured on: ``"values"``, or ``"keys_values"`` (both, each relative
            to the loaded ones' mean square).
        compression: codec of the stored KV (default ``memory.config.compression``).
        namespace: an extra scope (e.g. a tenant); the model identity is always folded in.

    Raises:
        UnsupportedModelError: the model's position encoding or layout is not one this handles.
        ConfigError: ``recompute_ratio`` outside ``[0, 1]``, ``check_layer`` or the last filtering layer
            outside ``[1, layers)``, or another ``deviation``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        memory: Memory | None = None,
        *,
        recompute_ratio: float = 0.15,
        check_layer: int = 1,
        filter_layers: int = 1,
        deviation: str = "values",
        compression: str | None = None,
        namespace: str = "",
    ) -> None:
        self.model = model
        self._base = _decoder(model)
        self._rope_kinds = _rope_kinds(model)
        _check_rope(model, self._base.rotary_emb, self._rope_kinds)
        self.recompute_ratio = _check_ratio(recompute_ratio)
        layers = len(self._base.layers)
        if isinstance(check_layer, bool) or not isinstance(check_layer, int) or not 1 <= check_layer < layers:
            raise ConfigError(
                f"check_layer={check_layer!r}: expected an int from 1 to {layers - 1} (the model has {layers} layers)"
            )
        self.check_layer = check_layer
        if isinstance(filter_layers, bool) or not isinstance(filter_layers, int) or not 1 <= filter_layers < layers:
            raise ConfigError(f"filter_layers={filter_layers!r}: expected an int from 1 to {layers - 1}")
        if check_layer + filter_layers > layers:
            raise ConfigError(
                f"check_layer={check_layer} with filter_layers={filter_layers}: the filtering would end past "
                f"the model's last layer ({layers - 1})"
            )
        if deviation not in DEVIATIONS:
            raise ConfigError(f"deviation={deviation!r}: expected one of {DEVIATIONS}")
        self.filter_layers = filter_layers
        self.deviation = deviation
        self.memory = memory if memory is not None else default_memory()
        self.codec = str(parse_codec(compression or self.memory.config.compression))
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.namespace = f"blend/{model_fingerprint(model)}/{dtype}/{self.codec}/{namespace}"
        self._cache_arg = cache_argument(model)
        self._layer_cache_arg = cache_argument(self._base.layers[0])
        self._windows = [
            layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None
            for layer in new_cache(model).layers
        ]
        self._sdpa = _attention(model) == "sdpa"
        self._head: Any = self.model.get_output_embeddings()  # type: ignore[operator]  # nn.Module types it as Tensor | Module
        self._writer = WriteBehind(activity=self.memory.activity)

    # -- keys and stored segments --------------------------------------------------------
    def segment_key(self, segment: Segment) -> str:
        """The key of a segment's KV: its token ids only (never its position), in :attr:`namespace`."""
        return content_hash(segment.tokens, "blend-segment")

    def lookup(self, segments: list[Segment]) -> list[bool]:
        """Per segment: whether its KV is stored (always ``False`` for a non-reusable one)."""
        found = self.memory.contains_many([self.segment_key(s) for s in segments], namespace=self.namespace)
        return [s.reusable and hit for s, hit in zip(segments, found)]

    def store_segment(self, segment: Segment, *, wait: bool = True) -> None:
        """Compute a segment's KV on its own (positions ``0..n-1``) and store it: a document ingested ahead."""
        self._queue_store(segment, self._compute_alone(segment))
        if wait:
            self.flush()

    def flush(self) -> None:
        """Wait for background segment stores to finish."""
        self._writer.flush()

    def close(self) -> None:
        """Finish background work."""
        self._writer.close()

    # -- prefill -------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(
        self, segments: list[Segment], *, recompute_ratio: float | None = None, logits_to_keep: int = 1
    ) -> BlendResult:
        """Run the model on the segments' concatenation, reusing every reusable segment's KV.

        A reusable segment not stored yet is computed on its own first and stored in the
        background (see :meth:`flush`), then blended like a stored one.

        Args:
            segments: the prompt, in order (e.g. ``[system, doc_a, doc_b, question]``).
            recompute_ratio: this call's ratio (default: the instance's).
            logits_to_keep: the last this many positions are always computed; their logits are returned.
        """
        start = time.perf_counter()
        ratio = self.recompute_ratio if recompute_ratio is None else _check_ratio(recompute_ratio)
        ids, known, keys, values, loaded, stored = self._assemble(segments)
        total = ids.shape[1]
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or not 1 <= logits_to_keep <= total:
            raise ConfigError(f"logits_to_keep={logits_to_keep!r}: expected an int from 1 to {total} (prompt length)")
        forced = ~known
        forced[-logits_to_keep:] = True
        picks = math.ceil(ratio * int((~forced).sum()))
        kv = _BlendKV(keys, values)
        hidden, active = self._run_layers(ids, kv, forced, picks)
        logits = self._head(self._base.norm(hidden[:, -logits_to_keep:]))
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        cache = self._to_cache(kv)
        recomputed = int(active.numel())
        self._count(total, total - recomputed, start)
        return BlendResult(cache, logits, total - recomputed, recomputed, loaded, stored)

    # -- internals -----------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _assemble(
        self, segments: list[Segment]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], int, int]:
        """The prompt's ids, which positions hold reused KV, each layer's ``[1, H, N, D]`` K/V buffers
        (reused segments' K/V rotated into place; the other positions unset: every layer computes them), and
        segments loaded and stored."""
        if not isinstance(segments, (list, tuple)) or not segments or not all(isinstance(s, Segment) for s in segments):
            raise InvalidKeyError(f"segments={segments!r:.80}: expected a non-empty list of kvmem.kv.Segment")
        ids = torch.cat([s.tokens for s in segments]).to(self._device)[None]
        found, loaded, stored = self._segment_values(segments)
        total = ids.shape[1]
        known = torch.zeros(total, dtype=torch.bool, device=ids.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        first = next((v for v in found if v is not None), None)
        for leaf in first or [{}] * len(self._base.layers):
            # NOTE: without any reused segment every token is computed: the buffers are replaced, never read
            k = leaf.get("k", torch.empty(1, 1, 0, 1, device=ids.device))
            keys.append(k.new_empty(1, k.shape[1], total, k.shape[3]))
            values.append(k.new_empty(1, k.shape[1], total, leaf["v"].shape[3]) if leaf else k)
        pos = 0
        for seg, value in zip(segments, found):
            n = seg.tokens.numel()
            if value is not None:
                known[pos : pos + n] = True
                turns = {kind: self._turn(pos, ids.device, kind) for kind in set(self._rope_kinds)}
                for layer, leaf in enumerate(value):
                    _rotate_into(keys[layer][:, :, pos : pos + n], leaf["k"], turns[self._rope_kinds[layer]])
                    values[layer][:, :, pos : pos + n] = leaf["v"]
            pos += n
        return ids, known, keys, values, loaded, stored

    def _segment_values(self, segments: list[Segment]) -> tuple[list[ChunkValue | None], int, int]:
        """Per segment its KV at positions ``0..n-1`` (``None`` for a non-reusable one): loaded when
        stored, else computed on its own and queued for storing. Also how many were loaded and stored."""
        reusable = [s for s in segments if s.reusable]
        loaded = self.memory.load_many(
            [self.segment_key(s) for s in reusable], namespace=self.namespace, device=self._device
        )
        hits = iter(loaded)
        out: list[ChunkValue | None] = []
        stored = 0
        for seg in segments:
            value: ChunkValue | None = next(hits) if seg.reusable else None
            if seg.reusable and value is None:
                value = self._compute_alone(seg)
                self._queue_store(seg, value)
                stored += 1
            out.append(value)
        return out, sum(v is not None for v in loaded), stored

    def _compute_alone(self, segment: Segment) -> ChunkValue:
        """The segment's KV computed on its own, at positions ``0..n-1`` (every layer, the full past)."""
        cache = new_cache(self.model)
        self.model(input_ids=segment.tokens[None].to(self._device), use_cache=True, **{self._cache_arg: cache})
        return chunk_value(cache, 0, segment.tokens.numel())

    def _queue_store(self, segment: Segment, value: ChunkValue) -> None:
        self._writer.submit(partial(self._store, self.segment_key(segment), value))

    def _store(self, key: str, value: ChunkValue) -> None:
        self.memory.store(key, value, namespace=self.namespace, compression=self.codec)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor, kind: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary ``(cos, sin)`` at ``positions`` for layers of rotary ``kind``."""
        return self._base.rotary_emb(x, position_ids=positions, **({"layer_type": kind} if kind else {}))

    def _turn(self, delta: int, device: torch.device, kind: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotation (``(cos, sin)``, ``[1, 1, 1, D]``, fp32) that moves keys of rotary ``kind`` from
        positions ``t`` to ``t + delta`` (``None``: none, ``delta == 0``).

        NOTE: rotations compose, so keys rotated by this equal the keys computed at ``t + delta`` up to
        float rounding, for the supported ``rope_type`` values only (angle ``position x inv_freq``). The
        model's ``(cos, sin)`` carry its attention scaling (YaRN), already in the stored keys: divided out
        here (it is the cosine at position 0).
        """
        if delta == 0:
            return None
        probe = torch.empty(0, dtype=torch.float32, device=device)
        cos, sin = self._rotary(probe, torch.tensor([[0, delta]], device=device), kind)
        scale = cos[:, :1, :1]
        return (cos[:, 1:] / scale)[:, None], (sin[:, 1:] / scale)[:, None]

    def _run_layers(
        self, ids: torch.Tensor, kv: _BlendKV, forced: torch.Tensor, picks: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over the blended prompt.

        Returns:
            ``(hidden states of the computed tokens after the last layer, their positions)``.
        """
        total = ids.shape[1]
        active = torch.arange(total, device=ids.device) if picks else forced.nonzero()[:, 0]
        hidden = self._base.embed_tokens(ids[:, active])
        now = self._pass(active, total, hidden)
        schedule = self._schedule(picks, int((~forced).sum()))
        for i, layer in enumerate(self._base.layers):
            if i in schedule and schedule[i] < int((~forced[active]).sum()):
                keep = self._select(layer, i, hidden, active, now, kv, forced, schedule[i])
                active, hidden = active[keep], hidden[:, keep]
                now = self._pass(active, total, hidden)
            hidden = self._layer(layer, i, hidden, now, kv)
        return hidden, active

    def _schedule(self, picks: int, candidates: int) -> dict[int, int]:
        """Per filtering layer, how many reused tokens it keeps: ``2 x picks`` at ``check_layer`` down to
        ``picks`` at the last (one layer: ``picks``); none when every or no reused token is recomputed."""
        if not 0 < picks < candidates:
            return {}
        steps = self.filter_layers
        return {
            self.check_layer + j: min(candidates, math.ceil(picks * (1 + (steps - 1 - j) / max(steps - 1, 1))))
            for j in range(steps)
        }

    def _select(
        self,
        layer: Any,
        idx: int,
        hidden: torch.Tensor,
        active: torch.Tensor,
        now: _Pass,
        kv: _BlendKV,
        forced: torch.Tensor,
        picks: int,
    ) -> torch.Tensor:
        """Indices into ``active`` of the tokens to compute from layer ``idx`` up: the forced ones and the
        ``picks`` reused tokens whose K/V now (from their ``hidden`` input) deviate most from the loaded ones.

        NOTE: keys are compared after RoPE (a rotation keeps distances), each term relative to the loaded
        tensors' mean square so that neither dominates.
        """
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        reused = ~forced[active]
        loaded_v = kv.values[idx][:, :, active].float()
        fresh_v = attn.v_proj(x).view(1, x.shape[1], -1, loaded_v.shape[-1]).transpose(1, 2).float()
        deviation = _relative_deviation(fresh_v, loaded_v, reused)
        if self.deviation == "keys_values":
            loaded_k = kv.keys[idx][:, :, active].float()
            fresh_k = attn.k_proj(x).view(1, x.shape[1], -1, loaded_k.shape[-1])
            norm = getattr(attn, "k_norm", None)  # Qwen 3, Gemma 3: before RoPE
            fresh_k = (norm(fresh_k) if norm is not None else fresh_k).transpose(1, 2).float()
            cos, sin = (t.float()[:, None] for t in now.rope[self._rope_kinds[idx]])
            rotated = torch.empty_like(fresh_k)
            _rotate_into(rotated, fresh_k, (cos, sin))
            deviation = deviation + _relative_deviation(rotated, loaded_k, reused)
        deviation[~reused] = -math.inf
        chosen = deviation.topk(picks).indices
        return torch.cat([(~reused).nonzero()[:, 0], chosen]).sort().values

    def _pass(self, active: torch.Tensor, total: int, hidden: torch.Tensor) -> _Pass:
        positions = active[None]
        return _Pass(total, positions, {kind: self._rotary(hidden, positions, kind) for kind in set(self._rope_kinds)})

    def _layer(self, layer: torch.nn.Module, idx: int, hidden: torch.Tensor, now: _Pass, kv: _BlendKV) -> torch.Tensor:
        """Decoder layer ``idx`` on the computed positions' ``hidden`` states, attending to the whole prompt."""
        window = self._windows[idx]
        if window not in now.masks:  # NOTE: one mask per window, not per layer (~2 ms each at 4k tokens here)
            now.masks[window] = self._mask(now, window, hidden.dtype)
        kv.index = now.index
        out = layer(
            hidden,
            attention_mask=now.masks[window],
            position_ids=now.positions,
            position_embeddings=now.rope[self._rope_kinds[idx]],
            use_cache=True,
            **{self._layer_cache_arg: kv},
        )
        return out[0] if isinstance(out, tuple) else out

    def _mask(self, now: _Pass, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The computed positions' attention mask over the prompt (:func:`attention_mask`): SDPA on the CPU
        computes it in runs of queries, each over the keys it can see. ``None`` (SDPA's causal kernel) when
        every token is computed in order by full attention.

        NOTE: in runs on the CPU only, where attention is bound by arithmetic. On a GPU it is bound by
        kernel launches, and one masked call is faster (H200, 250m bf16 model, 4 documents, 15 %: 22 ms in
        one call against 30 ms in runs at 4x1,024 tokens, 78 against 112 ms at 4x8,192).
        """
        if now.index is None and window is None and self._sdpa:
            return None
        positions = now.positions[0]
        return attention_mask(positions, now.total, window, dtype, grouped=self._sdpa and positions.is_cpu)

    def _to_cache(self, kv: _BlendKV) -> DynamicCache:
        cache = new_cache(self.model)
        for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
            install_prefix(cache, i, k, v)
        trim_sliding_layers(cache)
        return cache

    def _count(self, total: int, reused: int, start: float) -> None:
        m = self.memory.metrics
        m.kv_tokens.labels(kind="requested").inc(total)
        m.kv_tokens.labels(kind="reused").inc(reused)
        m.kv_tokens.labels(kind="computed").inc(total - reused)
        m.ttft_seconds.observe(time.perf_counter() - start)


def _relative_deviation(fresh: torch.Tensor, loaded: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """Per token, the squared distance of ``fresh`` from ``loaded`` (``[1, H, T, D]``) summed over heads and
    dimensions, over the ``reused`` tokens' mean squared norm of ``loaded`` (the other tokens' rows are not
    set yet: their distance means nothing)."""
    distance = (fresh - loaded).square().sum(dim=(0, 1, 3))
    return distance / loaded[:, :, reused].square().sum(dim=(0, 1, 3)).mean().clamp_min(1e-12)


def _rotate_into(out: torch.Tensor, keys: torch.Tensor, turn: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Write ``keys`` (``[B, H, T, D]``) rotated by ``turn`` (:meth:`BlendCache._turn`) into ``out``, in fp32.

    NOTE: in place (no ``rotate_half`` copy): ``k * cos`` plus each half's partner times ``sin``.
    """
    if turn is None:
        out.copy_(keys)
        return
    cos, sin = turn
    k = keys.float()
    half = k.shape[-1] // 2
    rot = out if out.dtype == torch.float32 else torch.empty_like(k)
    torch.mul(k, cos, out=rot)
    rot[..., :half].addcmul_(k[..., half:], sin[..., :half], value=-1)
    rot[..., half:].addcmul_(k[..., :half], sin[..., half:])
    if rot is not out:
        out.copy_(rot)


def _decoder(model: torch.nn.Module) -> Any:
    """``model.model``, checked to be a Llama-family decoder stack with rotary embeddings.

    Raises:
        UnsupportedModelError: naming the part that is missing.
    """
    base: Any = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    missing = [name for name in needed if not hasattr(base, name)]
    if missing or model.get_output_embeddings() is None:  # type: ignore[operator]
        raise UnsupportedModelError(
            f"{type(model).__name__} has no {', '.join(f'model.{m}' for m in missing) or 'output embeddings'}: "
            "BlendCache handles Llama-family decoders with rotary position embeddings "
            f"(rope_type in {SUPPORTED_ROPE_TYPES}: Llama, Qwen2, Mistral, ...)"
        )
    for layer in base.layers:
        if not hasattr(layer, "input_layernorm") or not hasattr(getattr(layer, "self_attn", None), "v_proj"):
            raise UnsupportedModelError(
                f"{type(model).__name__}'s decoder layers have no input_layernorm / self_attn.v_proj: "
                "BlendCache reads the value projection to pick the tokens to recompute"
            )
    return base


def _rope_kinds(model: torch.nn.Module) -> list[str | None]:
    """Per layer, the layer type whose rotary parameters it uses (Gemma 3: ``sliding_attention`` and
    ``full_attention`` differ), or ``None`` for all where the model has one set."""
    config: Any = model.config
    params = getattr(config, "rope_parameters", None)
    types = getattr(config, "layer_types", None)
    if isinstance(params, dict) and types and all(isinstance(params.get(t), dict) for t in types):
        return list(types)
    return [None] * config.num_hidden_layers


def _check_rope(model: torch.nn.Module, rotary: torch.nn.Module, kinds: list[str | None]) -> None:
    """Refuse position encodings whose rotation by ``p`` does not compose exactly (see the module docstring).

    Raises:
        UnsupportedModelError: naming the ``rope_type``, why, and the supported ones.
    """
    config: Any = model.config
    params = getattr(config, "rope_parameters", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for kind in sorted(set(kinds), key=str):
        kind_params = params.get(kind) if kind and isinstance(params, dict) else params
        rope_type = kind_params.get("rope_type") if isinstance(kind_params, dict) else None
        where = f" (layer type {kind})" if kind else ""
        if rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{type(model).__name__} uses rope_type={rope_type!r}{where}: its frequencies depend on the "
                "sequence length, so a segment's keys computed alone are rotated with other frequencies than "
                f"the whole prompt's; BlendCache re-rotates keys for rope_type in {SUPPORTED_ROPE_TYPES} only"
            )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{type(model).__name__} uses rope_type={rope_type!r}{where}: BlendCache re-rotates keys for "
                f"rope_type in {SUPPORTED_ROPE_TYPES} only, whose rotations compose exactly"
            )
        probe = torch.empty(0)
        cos, _ = rotary(
            probe, position_ids=torch.zeros(1, 1, dtype=torch.long), **({"layer_type": kind} if kind else {})
        )
        if cos.shape[-1] != head_dim:
            raise UnsupportedModelError(
                f"{type(model).__name__} rotates {cos.shape[-1]} of {head_dim} head dimensions{where}: "
                "BlendCache handles rotary embeddings over the whole head only"
            )


def _attention(model: torch.nn.Module) -> str:
    """The model's attention implementation, checked to take an arbitrary additive mask (``sdpa``, ``eager``).

    Raises:
        UnsupportedModelError: another one (FlashAttention takes no mask of selected query positions).
    """
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"{type(model).__name__} runs attn_implementation={impl!r}: BlendCache needs 'sdpa' or 'eager' "
            "(selected query positions attend through an explicit mask)"
        )
    return str(impl)
