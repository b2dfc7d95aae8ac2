"""Layer-wise prefix loading: layer ``i`` of the forward pass waits only for layer ``i``'s KV.

A chunk blob stores its layers in order (``k0, v0, k1, v1, ...``), each in its own
CRC segment (:mod:`kvmem.blob`). A background thread opens every chunk once
(:meth:`~kvmem.ports.ChunkStore.open_blob`: a file stays open, a memory tier's
pages stay held, so every layer comes from the same version), then reads them layer by
layer (the next layer's ranges requested ahead) and checks every segment before its
bytes are used. :class:`StreamingCache` makes the model's ``update`` for layer ``i``
block until layer ``i`` is in, so reading later layers overlaps the compute of earlier ones.

How a layer's prefix gets into the cache depends on its chunks' codec:

- int8/int4 chunks are decoded on the target device by the fused dequantize + scatter
  op (:func:`kvmem.cuda.dequantize_into`): each chunk-layer's codes and scales move to
  the device in one copy and are written straight into a ``[B, H, S, D]`` buffer the
  loader allocates, with room after the prefix for the first update's new tokens, so
  no float chunk is made on the host and the prefix is never copied again;
- chunks read from disk or Redis are read straight into their slice of such a buffer
  (lossless: one ``preadv`` per step, CRC-checked in the same pass) or decoded there;
- chunks the CPU tier holds arrive as checked views of its pages, concatenated with
  the new tokens' K/V: the prefix is copied once, as the forward pass over a cache
  already in memory copies it (see :meth:`LayerwiseLoader._layer` for why not earlier);
- on a GPU, chunks the CPU tier holds are staged instead: each chunk's payload goes to
  the device in one asynchronous copy on a side stream and each layer is placed into
  buffers with room by copy kernels there, the model's stream waiting for the layer's
  event only (:mod:`kvmem.kv.staging`).

A chunk that cannot be read or fails a check stops the load: the waiting layer
raises :class:`ChunkLoadError` naming the chunk, and the caller retries with the
chunks before it. No unchecked byte ever reaches the model. Every tier operation
goes through the memory's :class:`~kvmem.ports.ChunkStore` (``open_blob``, ``advise``), so a
tier fault (an ``OSError``, Redis gone) is handled as for ``Memory.load``: counted in
``kvmem_tier_errors_total``, the tier skipped for ``tier_retry_seconds``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvmem import blob as blobfmt
from kvmem.codecs.serialization import check_owner, decode_tensor_range, stored_as_is, tensor_parts_range
from kvmem.cuda.kvquant import dequantize_kv_into
from kvmem.errors import CodecError, IntegrityError, KVMemError, TierUnavailable
from kvmem.kv.layout import install_prefix, kv_layer
from kvmem.kv.staging import DeviceStaging, quantized_leaf
from kvmem.ports import ChunkStore

__all__ = ["ChunkSource", "ChunkLoadError", "LayerwiseLoader", "StreamingCache"]


class ChunkLoadError(KVMemError):
    """Chunk ``index`` of a prefix could not be read from ``tier``, or failed an integrity check (``corrupt``)."""

    def __init__(self, index: int, reason: str, *, corrupt: bool, key: str = "", tier: str = "") -> None:
        super().__init__(f"KV chunk {index}: {reason}")
        self.index = index
        self.corrupt = corrupt
        self.key = key
        self.tier = tier


@dataclass(frozen=True)
class ChunkSource:
    """Where one chunk is read from: its storage key and the name of the tier holding it."""

    key: str
    tier: str


@dataclass
class _Pieces:
    """A layer's prefix as checked per-chunk pieces (often views of the CPU tier's pages: never written to)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix's K and V, joined in one copy."""
        return torch.cat(self.keys, dim=-2), torch.cat(self.values, dim=-2)

    def extended(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix followed by new tokens' K and V, in one copy (what ``DynamicLayer.update`` makes)."""
        return torch.cat([*self.keys, key_states], dim=-2), torch.cat([*self.values, value_states], dim=-2)


@dataclass
class _Filled:
    """A layer's prefix in ``[B, H, S + room, D]`` buffers the loader made for it (``room`` tokens free after it)."""

    keys: torch.Tensor
    values: torch.Tensor
    room: int

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix's K and V: views of the buffers."""
        end = self.keys.shape[-2] - self.room
        return self.keys[:, :, :end], self.values[:, :, :end]

    def extended(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix followed by new tokens' K and V: written into the room when they fill it exactly."""
        if not self.room or key_states.shape[-2] != self.room:
            keys, values = self.whole()
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        # NOTE: the buffers are this layer's alone (the loader made them for it): filling the room
        # in place leaves the prefix where it was written, uncopied.
        self.keys[:, :, -self.room :] = key_states
        self.values[:, :, -self.room :] = value_states
        return self.keys, self.values


_LayerPrefix = _Pieces | _Filled


def _parts_on(
    device: torch.device, data: torch.Tensor, lo: int, leaves: list[dict[str, Any]]
) -> list[dict[str, torch.Tensor]]:
    """Each leaf's codec parts (in checked ``data``, from payload offset ``lo``) on ``device``, moved in one copy."""
    if data.device != device and not any("raw" in p for leaf in leaves for p in leaf["parts"].values()):
        data = data.to(device)  # the layer's codes and scales as stored: one copy, nothing decoded yet
    parts = [tensor_parts_range(data, lo, leaf) for leaf in leaves]
    if all(p.device == device for leaf_parts in parts for p in leaf_parts.values()):
        return parts
    return _packed_to(device, parts)


def _packed_to(device: torch.device, parts: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """``parts`` (lz4 undone on the host) on ``device``, packed into one buffer so that they move in one copy."""
    flat = [p.reshape(-1).view(torch.uint8) for leaf_parts in parts for p in leaf_parts.values()]
    offsets, end = [], 0
    for f in flat:
        offsets.append(end)
        end = -(-(end + f.numel()) // 16) * 16  # NOTE: 16-byte aligned, so each part can be viewed as its dtype
    packed = torch.empty(end, dtype=torch.uint8)
    for f, off in zip(flat, offsets):
        packed[off : off + f.numel()] = f
    moved = packed.to(device)
    out: list[dict[str, torch.Tensor]] = []
    for leaf_parts in parts:
        out.append({})
        for (name, p), f, off in zip(leaf_parts.items(), flat, offsets):
            out[-1][name] = moved[off : off + f.numel()].view(p.dtype).reshape(p.shape)
        flat, offsets = flat[len(leaf_parts) :], offsets[len(leaf_parts) :]
    return out


class _ChunkReader:
    """Checked reads of one chunk blob, opened once in one tier (through ``store``'s failure handling)."""

    def __init__(self, store: ChunkStore, source: ChunkSource, index: int) -> None:
        self.source = source
        self.index = index
        try:
            reader = store.open_blob(source.key, source.tier)
        except IntegrityError as exc:
            raise self._error(str(exc), corrupt=True) from None
        if reader is None:
            raise self._error(f"gone from tier {source.tier}, or the tier failed", corrupt=False)
        self.blob = reader
        self.header = reader.header
        self._ranges: dict[int, tuple[int, int]] = {}
        try:
            check_owner(self.header, source.key)
        except IntegrityError as exc:
            reader.close()
            raise self._error(str(exc), corrupt=True) from None

    def _error(self, reason: str, corrupt: bool) -> ChunkLoadError:
        return ChunkLoadError(self.index, reason, corrupt=corrupt, key=self.source.key, tier=self.source.tier)

    @contextlib.contextmanager
    def _reading(self, what: str, bad_data: tuple[type[KVMemError], ...] = (IntegrityError,)) -> Iterator[None]:
        """Turn a failed read of ``what`` (``"layer 3"``) into a :class:`ChunkLoadError` naming this chunk.

        ``bad_data`` errors mean the copy is corrupt; ``TierUnavailable`` means its tier failed
        (already counted and backed off by the store's handling) or is skipped.
        """
        try:
            yield
        except bad_data as exc:
            raise self._error(f"{what}: {exc}", corrupt=True) from None
        except TierUnavailable as exc:
            raise self._error(f"{what}: {exc}", corrupt=False) from None

    def shapes(self) -> list[tuple[list[int], str]]:
        """``(shape, dtype)`` of each layer's K, in layer order."""
        return [(leaf["shape"], leaf["dtype"]) for leaf in self.header["leaves"][0::2]]

    def layer_range(self, layer_idx: int) -> tuple[int, int]:
        """Payload bytes ``[lo, hi)`` of the CRC segments holding layer ``layer_idx``'s K and V."""
        if layer_idx not in self._ranges:
            self._ranges[layer_idx] = blobfmt.covering_range(self.header, self.leaves(layer_idx))
        return self._ranges[layer_idx]

    def payload(self, lo: int, hi: int) -> torch.Tensor:
        """Payload bytes ``[lo, hi)`` (whole CRC segments), checked."""
        with self._reading(f"payload bytes [{lo}, {hi})"):
            return self.blob.read(lo, hi)

    def advise(self, layer_idx: int) -> None:
        """Tell the tier that layer ``layer_idx`` will be read next."""
        self.blob.advise(*self.layer_range(layer_idx))

    def leaves(self, layer_idx: int) -> list[dict[str, Any]]:
        """The header entries of layer ``layer_idx``'s K and V."""
        return self.header["leaves"][2 * layer_idx : 2 * layer_idx + 2]

    def _checked(self, layer_idx: int) -> tuple[torch.Tensor, int]:
        """Layer ``layer_idx``'s bytes, every CRC segment checked, and their payload offset."""
        lo, hi = self.layer_range(layer_idx)
        return self.blob.read(lo, hi), lo

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s K and V, ``[B, H, T, D]``, checked and decoded."""
        with self._reading(f"layer {layer_idx}"):
            data, lo = self._checked(layer_idx)
            keys, values = self.leaves(layer_idx)
            return decode_tensor_range(data, lo, keys), decode_tensor_range(data, lo, values)

    def direct(self, layer_idx: int, dtype: torch.dtype) -> list[dict[str, Any]] | None:
        """The parts of layer ``layer_idx``'s K and V if they are stored as they are in ``dtype``, else ``None``."""
        parts = [stored_as_is(leaf) for leaf in self.leaves(layer_idx)]
        if any(p is None or p["dtype"] != str(dtype).removeprefix("torch.") for p in parts):
            return None
        return parts  # type: ignore[return-value]

    def layer_direct(
        self, parts: list[dict[str, Any]], keys: torch.Tensor, values: torch.Tensor, layer_idx: int
    ) -> None:
        """Read ``parts`` (see :meth:`direct`) straight into ``keys``/``values`` (slices of the cache buffers)."""
        with self._reading(f"layer {layer_idx}"):
            self.blob.part_into(parts[0], keys)
            self.blob.part_into(parts[1], values)

    def layer_into(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, start: int, skip: int, count: int
    ) -> None:
        """Decode tokens ``[skip, skip + count)`` of int8/int4 layer ``layer_idx`` into ``keys``/``values``.

        They go to positions ``start..`` of the buffers. The fused path: codes and scales go
        to the buffers' device in one copy, and the fused dequantize + scatter op writes the
        values there (no float chunk is made).
        """
        # a CodecError here is a header that misdescribes its parts
        with self._reading(f"layer {layer_idx}", bad_data=(IntegrityError, CodecError)):
            data, lo = self._checked(layer_idx)
            leaves = self.leaves(layer_idx)
            for dst, leaf, parts in zip((keys, values), leaves, _parts_on(keys.device, data, lo, leaves)):
                dequantize_kv_into(dst, start, parts, leaf["meta"], skip=skip, count=count)

    def close(self) -> None:
        self.blob.close()


class LayerwiseLoader:
    """Reads a prefix's chunk blobs on a background thread, layer by layer, every segment checked.

    The cache's layers get placeholders of the prefix's shape at once (so the cache
    already reports the prefix length); chunk 0's header is read here for the shapes.
    A layer whose chunks are all int8/int4 is dequantized on ``device`` straight into
    one buffer (see the module docstring); any other arrives as checked per-chunk views,
    and :class:`StreamingCache` concatenates them with the new tokens' K/V in the one
    copy the forward pass makes anyway.

    Args:
        store: the tiers, whose failure handling every open and read goes through.
        sources: the prefix's chunks, in order.
        cache: receives the prefix; its ``update`` should call :meth:`take` (``StreamingCache``).
        block_size: tokens per chunk.
        tokens: prefix length to install (``<= len(sources) * block_size``).
        device: where the prefix's K/V live.
        room: tokens the cache's first update will add (the computed part of the prompt):
            the fused path's buffers of full-attention layers leave room for them, so
            that the update writes them in place instead of copying the prefix.

    Raises:
        ChunkLoadError: chunk 0's header cannot be read (its tier failed) or is corrupt.
    """

    def __init__(
        self,
        store: ChunkStore,
        sources: list[ChunkSource],
        cache: DynamicCache,
        block_size: int,
        tokens: int,
        device: torch.device,
        room: int = 0,
    ) -> None:
        self.block_size = block_size
        self.tokens = tokens
        self.error: ChunkLoadError | None = None
        first_reader = _ChunkReader(store, sources[0], 0)
        self._store = store
        self._sources = sources
        self._cache = cache
        self._device = device
        self._room = room
        self._done = [threading.Event() for _ in cache.layers]
        self._filled = [False] * len(cache.layers)
        self._parts: list[_LayerPrefix | None] = [None] * len(cache.layers)
        self._firsts: list[int] = []
        # NOTE: made here, on the thread that runs the model: its current stream is the one that waits
        self._staging = DeviceStaging(device) if device.type == "cuda" else None
        zeros: dict[str, torch.Tensor] = {}
        for i, (layer, (shape, dtype)) in enumerate(zip(cache.layers, first_reader.shapes())):
            first = 0
            if isinstance(layer, DynamicSlidingWindowLayer):
                first = max(0, tokens - (layer.sliding_window - 1))
            b, h, _t, d = shape
            # placeholders: one element per dtype (one fill, not one per layer on a GPU), expanded to the
            # prefix's shape; never read
            if dtype not in zeros:
                zeros[dtype] = torch.zeros((), dtype=getattr(torch, dtype), device=device)
            placeholder = zeros[dtype].expand(b, h, tokens - first, d)
            install_prefix(cache, i, placeholder, placeholder, first=first)
            self._firsts.append(first)
        self._thread = threading.Thread(
            target=self._run, args=(first_reader,), name="kvmem-layerwise-load", daemon=True
        )
        self._thread.start()

    def _run(self, first_reader: _ChunkReader) -> None:
        readers = [first_reader]
        try:
            # NOTE: every chunk has chunk 0's layout, so its header and layer 0 end where chunk 0's do:
            # ask for all of them at once (the forward pass waits for layer 0 of every chunk),
            # then for layer i + 1 of every chunk while layer i is read.
            head_end = first_reader.blob.start + first_reader.layer_range(0)[1]
            for source in self._sources:
                self._store.advise(source.key, source.tier, 0, head_end)
            for i, source in enumerate(self._sources[1:], 1):
                readers.append(_ChunkReader(self._store, source, i))
            if self._stage(readers):
                self._place_staged(readers)
            for layer_idx, first in enumerate(self._firsts):
                if self._filled[layer_idx]:
                    continue  # placed from the staged payloads
                if layer_idx + 1 < len(self._firsts):
                    for reader in readers:
                        if self._holds(reader, self._firsts[layer_idx + 1]):
                            reader.advise(layer_idx + 1)
                self._publish(layer_idx, self._layer(layer_idx, self._needed(readers, first), first))
        except ChunkLoadError as exc:
            self.error = exc
        except (OSError, KVMemError) as exc:  # not a tier's (those name their chunk): reuse none of it
            self.error = ChunkLoadError(0, f"{type(exc).__name__}: {exc}", corrupt=False)
        finally:
            if self._staging is not None:
                self._staging.finish()  # before the readers let their pages go: copies may still read them
            for reader in readers:
                reader.close()
            for event in self._done:
                event.set()

    def _span(self, reader: _ChunkReader, first: int) -> tuple[int, int, int]:
        """``(start, skip, count)``: ``reader``'s chunk tokens ``[skip, skip + count)`` go to prefix position ``start``.

        The prefix of a layer starts at token ``first``; its positions count from there.
        """
        lo = reader.index * self.block_size
        skip = max(first - lo, 0)
        return lo + skip - first, skip, min(lo + self.block_size, self.tokens) - lo - skip

    def _layer(self, layer_idx: int, readers: list[_ChunkReader], first: int) -> _LayerPrefix:
        """Layer ``layer_idx``'s prefix: in one buffer when its bytes must be copied anyway, else as views.

        int8/int4 chunks are dequantized into the buffer; chunks a tier reads (disk, Redis)
        are read straight into their slice of it (lossless) or decoded and copied there.
        Chunks the CPU tier holds arrive as views of its pages, joined with the new tokens in
        the first update's one copy.

        NOTE: measured on 2 vCPUs, 2048 + 256 tokens: writing the CPU tier's chunks into the
        buffer on this thread put that copy beside the forward pass (TTFT / oracle 1.07 ->
        1.14-1.31), while reading a disk chunk straight into it saves the join's copy (cold
        disk, layer-wise, 1024 + 256: 241 ms against 275 ms with views).
        """
        if all(quantized_leaf(leaf) for reader in readers for leaf in reader.leaves(layer_idx)):
            return self._fused_layer(layer_idx, readers, first)
        if any(reader.blob.lends_views for reader in readers):
            keys, values = [], []
            for reader in readers:
                _start, skip, count = self._span(reader, first)
                ck, cv = reader.layer(layer_idx)
                keys.append(ck[:, :, skip : skip + count].to(self._device))
                values.append(cv[:, :, skip : skip + count].to(self._device))
            return _Pieces(keys, values)
        prefix = self._buffers(layer_idx, readers, first)
        for reader in readers:
            start, skip, count = self._span(reader, first)
            slot = (prefix.keys[:, :, start : start + count], prefix.values[:, :, start : start + count])
            whole = skip == 0 and count == reader.leaves(layer_idx)[0]["shape"][2]
            parts = reader.direct(layer_idx, prefix.keys.dtype) if whole else None
            if parts is not None:
                reader.layer_direct(parts, *slot, layer_idx)
            else:
                for dst, src in zip(slot, reader.layer(layer_idx)):
                    dst.copy_(src[:, :, skip : skip + count])
        return prefix

    def _stage(self, readers: list[_ChunkReader]) -> bool:
        """On a GPU, start copying every chunk's payload to the device (see :mod:`kvmem.kv.staging`).

        Only where every chunk lends views of the CPU tier's memory (a copy is made here
        anyway) in one layout, with no lz4 part (undone on the host); else the chunks are
        read layer by layer as on the CPU.

        Returns:
            Whether the chunks are staged (then :meth:`_place_staged` places every layer).
        """
        layout = readers[0].header["leaves"]
        if (
            self._staging is None
            or not all(reader.blob.lends_views and reader.header["leaves"] == layout for reader in readers)
            or any("raw" in part for leaf in layout for part in leaf.get("parts", {}).values())
        ):
            return False
        lo, hi = readers[0].layer_range(0)[0], readers[0].layer_range(len(self._firsts) - 1)[1]
        self._staging.stage([reader.payload(lo, hi) for reader in readers], lo)
        return True

    def _place_staged(self, readers: list[_ChunkReader]) -> None:
        """Every layer's prefix placed on the device from the staged payloads, in buffers with room.

        The buffers are allocated on the model's stream (which frees them), every copy is queued
        on the side stream in one pass, and each layer is published as soon as its copies are queued.
        """
        assert self._staging is not None
        layers = [(i, self._needed(readers, first), first) for i, first in enumerate(self._firsts)]
        with torch.cuda.stream(self._staging.consumer):
            prefixes = [self._buffers(i, needed, first) for i, needed, first in layers]
        with self._staging.queueing():
            for (layer_idx, needed, first), prefix in zip(layers, prefixes):
                spans = [self._span(reader, first) for reader in needed]
                chunks = [reader.index for reader in needed]
                leaves = needed[0].leaves(layer_idx)
                self._staging.place(layer_idx, chunks, spans, leaves, [prefix.keys, prefix.values])
                self._publish(layer_idx, prefix)

    def _needed(self, readers: list[_ChunkReader], first: int) -> list[_ChunkReader]:
        """The chunks a layer whose prefix starts at token ``first`` reads (a sliding layer: its window's)."""
        return [reader for reader in readers if self._holds(reader, first)]

    def _publish(self, layer_idx: int, prefix: _LayerPrefix) -> None:
        """Hand layer ``layer_idx``'s prefix to the forward pass waiting for it."""
        self._parts[layer_idx] = prefix
        self._filled[layer_idx] = True
        self._done[layer_idx].set()

    def _buffers(self, layer_idx: int, readers: list[_ChunkReader], first: int) -> _Filled:
        """Empty ``[B, H, S + room, D]`` K and V buffers for layer ``layer_idx``'s prefix (room: full-attention
        layers only)."""
        room = self._room if type(self._cache.layers[layer_idx]) is DynamicLayer else 0
        keys, values = (
            torch.empty(
                (*leaf["shape"][:2], self.tokens - first + room, leaf["shape"][3]),
                dtype=getattr(torch, leaf["dtype"]),
                device=self._device,
            )
            for leaf in readers[0].leaves(layer_idx)
        )
        return _Filled(keys, values, room)

    def _fused_layer(self, layer_idx: int, readers: list[_ChunkReader], first: int) -> _Filled:
        """Layer ``layer_idx``'s int8/int4 prefix, dequantized chunk by chunk into one buffer for K, one for V."""
        prefix = self._buffers(layer_idx, readers, first)
        # NOTE: the spans of the readers tile [first, tokens): every prefix position is written before use.
        for reader in readers:
            reader.layer_into(layer_idx, prefix.keys, prefix.values, *self._span(reader, first))
        return prefix

    def _holds(self, reader: _ChunkReader, first: int) -> bool:
        """Whether a layer whose prefix starts at token ``first`` needs any of ``reader``'s chunk."""
        return min((reader.index + 1) * self.block_size, self.tokens) > first

    def wait(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx`` is loaded and checked.

        Raises:
            ChunkLoadError: the load failed; no unchecked byte reached the layer.
        """
        self._done[layer_idx].wait()
        if not self._filled[layer_idx]:
            assert self.error is not None
            raise self.error

    def take(self, layer_idx: int) -> _LayerPrefix | None:
        """Layer ``layer_idx``'s prefix K and V (pieces, or filled buffers), once loaded; ``None`` once taken.

        Raises:
            ChunkLoadError: the load failed; no unchecked byte reached the layer.
        """
        self.wait(layer_idx)
        if self._staging is not None:
            self._staging.ready(layer_idx)
        parts, self._parts[layer_idx] = self._parts[layer_idx], None
        return parts

    def wait_all(self, install: bool = True) -> None:
        """Block until every layer is loaded (the load-everything-first mode).

        Args:
            install: also put every layer's prefix into the cache now (one copy each, none for
                filled buffers); otherwise :class:`StreamingCache` does as the forward pass reaches it.
        """
        self._thread.join()
        if self.error is not None:
            raise self.error
        if install:
            for layer_idx in range(len(self._cache.layers)):
                parts = self.take(layer_idx)
                if parts is not None:
                    layer = kv_layer(self._cache, layer_idx)
                    layer.keys, layer.values = parts.whole()


class StreamingCache(DynamicCache):
    """A ``DynamicCache`` whose layer-``i`` update first waits for the loader's layer ``i``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.loader: LayerwiseLoader | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.loader is not None:
            parts = self.loader.take(layer_idx)
            if layer_idx == len(self.layers) - 1:
                self.loader = None  # fully loaded: later updates need not wait
            if parts is not None:
                layer = kv_layer(self, layer_idx)
                if type(layer) is DynamicLayer:
                    # what DynamicLayer.update does, with the prefix still in pieces (one copy in all)
                    # or filled in place with room for these tokens (no copy of the prefix)
                    layer.keys, layer.values = parts.extended(key_states, value_states)
                    return layer.keys, layer.values
                layer.keys, layer.values = parts.whole()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
