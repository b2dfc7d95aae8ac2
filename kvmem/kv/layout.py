"""transformers ``DynamicCache`` <-> per-chunk KV values.

A chunk value is a list with one ``{"k": Tensor, "v": Tensor}`` per layer, each
``[batch, kv_heads, block_size, head_dim]`` (GQA: KV heads, not query heads). Per
layer, so a layer's bytes are contiguous segments of the blob.

Sliding-window layers (Mistral ``sliding_window``) keep only their last
``window - 1`` tokens. So that every chunk of a prompt can be stored, prefill
runs with past recording on (:func:`record_full_past`) and trims the window back
afterwards (:func:`trim_sliding_layers`); a rebuilt sliding layer gets the last
window of the prefix *and* ``cumulative_length`` = prefix length, or its
positions and masks would silently go wrong.

Checked against transformers 5.24 (``DynamicLayer``, ``DynamicSlidingWindowLayer``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvmem.errors import UnsupportedModelError

__all__ = [
    "ChunkValue",
    "cache_argument",
    "new_cache",
    "record_full_past",
    "trim_sliding_layers",
    "chunk_value",
    "HeldLayers",
    "held_layers",
    "holds",
    "slice_chunk",
    "install_prefix",
    "kept_range",
    "kv_layer",
    "held",
]

ChunkValue = list[dict[str, torch.Tensor]]


def cache_argument(model: torch.nn.Module) -> str:
    """The forward argument that takes a cache: ``cache`` (transformers 5.x) or ``past_key_values``.

    NOTE: 4.57 accepts ``cache=`` silently and ignores it (wrong logits), so the
    name comes from the signature, never from trying.
    """
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise UnsupportedModelError(f"{type(model).__name__}.forward takes neither cache= nor past_key_values=")


def new_cache(model: torch.nn.Module, cls: type[DynamicCache] = DynamicCache) -> DynamicCache:
    """An empty cache (of ``cls``) with the model's layer types, recording the full past of sliding layers."""
    config = model.config
    if not isinstance(config, PretrainedConfig):
        raise UnsupportedModelError(
            f"{type(model).__name__}.config is a {type(config).__name__}: expected a transformers PretrainedConfig"
        )
    cache = cls(config=config)
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise UnsupportedModelError(
                f"{type(model).__name__} uses cache layers of type {type(layer).__name__}; "
                "kvmem handles DynamicLayer and DynamicSlidingWindowLayer"
            )
    record_full_past(cache)
    return cache


def record_full_past(cache: DynamicCache) -> None:
    """Make sliding layers keep every token until :func:`trim_sliding_layers`."""
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()


def trim_sliding_layers(cache: DynamicCache) -> None:
    """Cut sliding layers back to their window (what ``update`` would have kept) and stop recording."""
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized:
            keep = layer.sliding_window - 1
            keys, values = held(layer)
            layer.keys, layer.values = keys[:, :, -keep:, :], values[:, :, -keep:, :]
            layer.record_past = False


def kept_range(layer: Any) -> tuple[int, int]:
    """Absolute token positions ``[first, end)`` a layer holds."""
    if not layer.is_initialized:
        return 0, 0
    end = layer.get_seq_length()
    return end - layer.keys.shape[-2], end


def kv_layer(cache: DynamicCache, layer_idx: int) -> DynamicLayer:
    """Layer ``layer_idx`` of ``cache``: one that holds keys and values (full attention or a sliding window).

    Raises:
        UnsupportedModelError: a layer of another kind (linear attention, a placeholder).
    """
    layer = cache.layers[layer_idx]
    if not isinstance(layer, DynamicLayer):
        raise UnsupportedModelError(
            f"cache layer {layer_idx} is a {type(layer).__name__}: kvmem handles "
            "DynamicLayer and DynamicSlidingWindowLayer"
        )
    return layer


def held(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``layer`` holds (``[B, H, T, D]``); the layer must be initialized."""
    assert layer.keys is not None and layer.values is not None, "the layer holds no tokens yet"
    return layer.keys, layer.values


def chunk_value(cache: DynamicCache, start: int, stop: int) -> ChunkValue:
    """Views of every layer's K and V for absolute tokens ``[start, stop)``.

    Raises:
        UnsupportedModelError: a layer no longer holds those tokens (a sliding layer
            trimmed before the chunk was taken), or holds no keys and values (:func:`kv_layer`).
    """
    return slice_chunk(held_layers(cache), start, stop)


HeldLayers = list[tuple[int, int, torch.Tensor, torch.Tensor]]


def held_layers(cache: DynamicCache) -> HeldLayers:
    """Per layer, the absolute positions ``[first, end)`` it holds and its keys and values now.

    A later ``update`` of the cache replaces a layer's tensors (``torch.cat``) rather than writing into them,
    so these stay what they are: chunks can be sliced from them later, on another thread.

    Raises:
        UnsupportedModelError: a layer holds no keys and values (:func:`kv_layer`).
    """
    out: HeldLayers = []
    for i in range(len(cache.layers)):
        layer = kv_layer(cache, i)
        first, end = kept_range(layer)
        keys, values = held(layer) if end > first else (torch.empty(0), torch.empty(0))
        out.append((first, end, keys, values))
    return out


def holds(layers: HeldLayers, start: int, stop: int) -> bool:
    """Whether every layer holds absolute tokens ``[start, stop)``."""
    return all(first <= start and stop <= end for first, end, _, _ in layers)


def slice_chunk(layers: HeldLayers, start: int, stop: int) -> ChunkValue:
    """Views of every layer's K and V (of :func:`held_layers`) for absolute tokens ``[start, stop)``.

    Raises:
        UnsupportedModelError: a layer does not hold those tokens (a sliding layer trimmed before the chunk
            was taken).
    """
    out: ChunkValue = []
    for i, (first, end, keys, values) in enumerate(layers):
        if start < first or stop > end:
            raise UnsupportedModelError(
                f"layer {i} holds tokens [{first}, {end}), not [{start}, {stop}): "
                "its sliding window dropped them before they were stored"
            )
        out.append(
            {"k": keys[:, :, start - first : stop - first, :], "v": values[:, :, start - first : stop - first, :]}
        )
    return out


def install_prefix(
    cache: DynamicCache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, first: int = 0
) -> None:
    """Set layer ``layer_idx`` to hold ``keys``/``values`` ([B, H, T, D]) of prefix tokens ``first..first+T-1``.

    ``first`` > 0 only for a sliding layer, which needs just the prefix's last window.

    Raises:
        UnsupportedModelError: the layer holds no keys and values (:func:`kv_layer`).
    """
    layer = kv_layer(cache, layer_idx)
    if first and not isinstance(layer, DynamicSlidingWindowLayer):
        raise ValueError(f"layer {layer_idx} attends to every token: its prefix must start at 0, not {first}")
    layer.lazy_initialization(keys, values)
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = first + keys.shape[-2]
    layer.keys, layer.values = keys, values
