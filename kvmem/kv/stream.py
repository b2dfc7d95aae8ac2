"""Layer-wise prefix loading: layer ``i`` of the forward pass waits only for layer ``i``'s KV.

A chunk blob stores its layers in order (``k0, v0, k1, v1, ...``), each in its own
CRC segment (:mod:`kvmem.blob`). A background thread reads the chunks layer by
layer with ranged reads (``pread`` on disk, slices in memory; the next layer's
ranges requested ahead), and checks every segment before its bytes are used.
:class:`StreamingCache` makes the model's ``update`` for layer ``i`` block until
layer ``i`` is in, so reading later layers overlaps the compute of earlier ones,
and concatenates the checked chunk pieces with the new tokens' K/V: the prefix is
copied once, as the forward pass over a cache already in memory copies it.

A chunk that cannot be read or fails a check stops the load: the waiting layer
raises :class:`ChunkLoadError` naming the chunk, and the caller retries with the
chunks before it. No unchecked byte ever reaches the model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvmem import blob as blobfmt
from kvmem.codecs.pipeline import check_owner, decode_tensor_range
from kvmem.errors import IntegrityError, KVMemError
from kvmem.kv.layout import install_prefix
from kvmem.stores.base import StorageTier

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
    """Where one chunk is read from: its storage key and the tier holding it."""

    key: str
    tier: StorageTier


class _ChunkReader:
    """Ranged, checked reads of one chunk blob from one tier."""

    def __init__(self, source: ChunkSource, index: int) -> None:
        self.source = source
        self.index = index
        head = self._read(0, blobfmt.HEAD_PROBE)
        try:
            extent = blobfmt.header_extent(head)
            if extent > head.numel():
                head = self._read(0, extent)
            self.header, self.start = blobfmt.parse_head(head)
            check_owner(self.header, source.key)
        except IntegrityError as exc:
            raise self._error(str(exc), corrupt=True) from None

    def _error(self, reason: str, corrupt: bool) -> ChunkLoadError:
        return ChunkLoadError(self.index, reason, corrupt=corrupt, key=self.source.key, tier=self.source.tier.name)

    def _read(self, start: int, stop: int) -> torch.Tensor:
        buf = self.source.tier.read_range(self.source.key, start, stop)
        if buf is None:
            raise self._error(f"gone from tier {self.source.tier.name}", corrupt=False)
        return buf

    def shapes(self) -> list[tuple[list[int], str]]:
        """``(shape, dtype)`` of each layer's K, in layer order."""
        return [(leaf["shape"], leaf["dtype"]) for leaf in self.header["leaves"][0::2]]

    def layer_range(self, layer_idx: int) -> tuple[int, int]:
        """Blob bytes ``[start, stop)`` of the CRC segments holding layer ``layer_idx``'s K and V."""
        lo, hi = blobfmt.covering_range(self.header, self.header["leaves"][2 * layer_idx: 2 * layer_idx + 2])
        return self.start + lo, self.start + hi

    def advise(self, layer_idx: int) -> None:
        """Tell the tier that layer ``layer_idx`` will be read next."""
        self.source.tier.advise_range(self.source.key, *self.layer_range(layer_idx))

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s K and V, ``[B, H, T, D]``, checked and decoded."""
        leaves = self.header["leaves"][2 * layer_idx: 2 * layer_idx + 2]
        lo, hi = blobfmt.covering_range(self.header, leaves)
        data = self._read(self.start + lo, self.start + hi)
        try:
            blobfmt.verify_range(self.header, data, lo, check=self.source.tier.checks_crc)
            return decode_tensor_range(data, lo, leaves[0]), decode_tensor_range(data, lo, leaves[1])
        except IntegrityError as exc:
            raise self._error(f"layer {layer_idx}: {exc}", corrupt=True) from None


class LayerwiseLoader:
    """Reads a prefix's chunk blobs on a background thread, layer by layer, every segment checked.

    The cache's layers get placeholders of the prefix's shape at once (so the cache
    already reports the prefix length); chunk 0's header is read here for the shapes.
    Each layer's bytes arrive as checked per-chunk views (of the tier's buffer or of
    the ranged read), and :class:`StreamingCache` concatenates them with the new
    tokens' K/V in the one copy the forward pass makes anyway.

    Args:
        sources: the prefix's chunks, in order.
        cache: receives the prefix; its ``update`` should call :meth:`take` (``StreamingCache``).
        block_size: tokens per chunk.
        tokens: prefix length to install (``<= len(sources) * block_size``).
        device: where the prefix's K/V live.

    Raises:
        ChunkLoadError: chunk 0's header cannot be read or is corrupt.
    """

    def __init__(self, sources: list[ChunkSource], cache: DynamicCache, block_size: int, tokens: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.tokens = tokens
        self.error: ChunkLoadError | None = None
        first_reader = _ChunkReader(sources[0], 0)
        self._sources = sources
        self._cache = cache
        self._device = device
        self._done = [threading.Event() for _ in cache.layers]
        self._filled = [False] * len(cache.layers)
        self._parts: list[tuple[list[torch.Tensor], list[torch.Tensor]] | None] = [None] * len(cache.layers)
        self._firsts: list[int] = []
        for i, (layer, (shape, dtype)) in enumerate(zip(cache.layers, first_reader.shapes())):
            first = 0
            if isinstance(layer, DynamicSlidingWindowLayer):
                first = max(0, tokens - (layer.sliding_window - 1))
            b, h, _t, d = shape
            # NOTE: placeholders: one element each, expanded to the prefix's shape; never read.
            k, v = (torch.zeros((), dtype=getattr(torch, dtype), device=device).expand(b, h, tokens - first, d)
                    for _ in range(2))
            install_prefix(cache, i, k, v, first=first)
            self._firsts.append(first)
        self._thread = threading.Thread(target=self._run, args=(first_reader,), name="kvmem-layerwise-load",
                                        daemon=True)
        self._thread.start()

    def _run(self, first_reader: _ChunkReader) -> None:
        try:
            # NOTE: every chunk has chunk 0's layout, so its header and layer 0 end where chunk 0's do:
            # ask for all of them at once (the forward pass waits for layer 0 of every chunk),
            # then for layer i + 1 of every chunk while layer i is read.
            head_end = first_reader.layer_range(0)[1]
            for source in self._sources:
                source.tier.advise_range(source.key, 0, head_end)
            readers = [first_reader] + [_ChunkReader(s, i) for i, s in enumerate(self._sources) if i]
            for layer_idx, first in enumerate(self._firsts):
                if layer_idx + 1 < len(self._firsts):
                    for reader in readers:
                        if self._holds(reader, self._firsts[layer_idx + 1]):
                            reader.advise(layer_idx + 1)
                keys, values = [], []
                for reader in readers:
                    if not self._holds(reader, first):
                        continue  # a sliding layer keeps only the prefix's last window
                    lo = reader.index * self.block_size
                    hi = min(lo + self.block_size, self.tokens)
                    ck, cv = reader.layer(layer_idx)
                    skip = max(first - lo, 0)
                    keys.append(ck[:, :, skip:hi - lo].to(self._device))
                    values.append(cv[:, :, skip:hi - lo].to(self._device))
                self._parts[layer_idx] = (keys, values)
                self._filled[layer_idx] = True
                self._done[layer_idx].set()
        except ChunkLoadError as exc:
            self.error = exc
        except (OSError, KVMemError) as exc:  # a failing tier: not the data's fault
            self.error = ChunkLoadError(0, f"{type(exc).__name__}: {exc}", corrupt=False)
        finally:
            for event in self._done:
                event.set()

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

    def take(self, layer_idx: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Layer ``layer_idx``'s prefix K and V as per-chunk pieces, once it is loaded; ``None`` once taken.

        Raises:
            ChunkLoadError: the load failed; no unchecked byte reached the layer.
        """
        self.wait(layer_idx)
        parts, self._parts[layer_idx] = self._parts[layer_idx], None
        return parts

    def wait_all(self, install: bool = True) -> None:
        """Block until every layer is loaded (the load-everything-first mode).

        Args:
            install: also put every layer's prefix into the cache now (one copy each);
                otherwise :class:`StreamingCache` does as the forward pass reaches it.
        """
        self._thread.join()
        if self.error is not None:
            raise self.error
        if install:
            for layer_idx, layer in enumerate(self._cache.layers):
                parts = self.take(layer_idx)
                if parts is not None:
                    layer.keys, layer.values = torch.cat(parts[0], dim=-2), torch.cat(parts[1], dim=-2)


class StreamingCache(DynamicCache):
    """A ``DynamicCache`` whose layer-``i`` update first waits for the loader's layer ``i``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.loader: LayerwiseLoader | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.loader is not None:
            parts = self.loader.take(layer_idx)
            if layer_idx == len(self.layers) - 1:
                self.loader = None  # fully loaded: later updates need not wait
            if parts is not None:
                layer = self.layers[layer_idx]
                if type(layer) is DynamicLayer:
                    # NOTE: what DynamicLayer.update does, with the prefix still in pieces: one copy in all
                    layer.keys = torch.cat([*parts[0], key_states], dim=-2)
                    layer.values = torch.cat([*parts[1], value_states], dim=-2)
                    return layer.keys, layer.values
                layer.keys, layer.values = torch.cat(parts[0], dim=-2), torch.cat(parts[1], dim=-2)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
