"""Layer-wise prefix loading: layer ``i`` of the forward pass waits only for layer ``i``'s KV.

A chunk blob stores its layers in order (``k0, v0, k1, v1, ...``), each in its own
CRC segment (:mod:`kvmem.blob`). A background thread reads the chunks layer by
layer with ranged reads (``pread`` on disk, slices in memory), checks every
segment before its bytes are used, and copies it into per-layer prefix buffers
that are already installed in the cache. :class:`StreamingCache` makes the
model's ``update`` for layer ``i`` block until layer ``i`` is in, so reading later
layers overlaps the compute of earlier ones.

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
from transformers.cache_utils import DynamicSlidingWindowLayer

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
    """Fills per-layer prefix buffers from chunk blobs on a background thread, layer by layer.

    The buffers are allocated and installed in ``cache`` at once (so the cache
    already reports the prefix length); chunk 0's header is read here for the shapes.

    Args:
        sources: the prefix's chunks, in order.
        cache: receives the prefix; its ``update`` should call :meth:`wait` (``StreamingCache``).
        block_size: tokens per chunk.
        tokens: prefix length to install (``<= len(sources) * block_size``).
        device: where the prefix buffers live.

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
        self._done = [threading.Event() for _ in cache.layers]
        self._filled = [False] * len(cache.layers)
        self._plan: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for i, (layer, (shape, dtype)) in enumerate(zip(cache.layers, first_reader.shapes())):
            first = 0
            if isinstance(layer, DynamicSlidingWindowLayer):
                first = max(0, tokens - (layer.sliding_window - 1))
            b, h, _t, d = shape
            k = torch.empty(b, h, tokens - first, d, dtype=getattr(torch, dtype), device=device)
            v = torch.empty_like(k)
            install_prefix(cache, i, k, v, first=first)
            self._plan.append((first, k, v))
        self._thread = threading.Thread(target=self._run, args=(first_reader,), name="kvmem-layerwise-load",
                                        daemon=True)
        self._thread.start()

    def _run(self, first_reader: _ChunkReader) -> None:
        try:
            readers = [first_reader] + [_ChunkReader(s, i) for i, s in enumerate(self._sources) if i]
            for layer_idx, (first, k, v) in enumerate(self._plan):
                for reader in readers:
                    lo = reader.index * self.block_size
                    hi = min(lo + self.block_size, self.tokens)
                    if hi <= first:
                        continue  # a sliding layer keeps only the prefix's last window
                    ck, cv = reader.layer(layer_idx)
                    skip = max(first - lo, 0)
                    k[:, :, lo + skip - first:hi - first].copy_(ck[:, :, skip:hi - lo])
                    v[:, :, lo + skip - first:hi - first].copy_(cv[:, :, skip:hi - lo])
                self._filled[layer_idx] = True
                self._done[layer_idx].set()
        except ChunkLoadError as exc:
            self.error = exc
        except (OSError, KVMemError) as exc:  # a failing tier: not the data's fault
            self.error = ChunkLoadError(0, f"{type(exc).__name__}: {exc}", corrupt=False)
        finally:
            for event in self._done:
                event.set()

    def wait(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx`` is filled.

        Raises:
            ChunkLoadError: the load failed; no unchecked byte reached the layer.
        """
        self._done[layer_idx].wait()
        if not self._filled[layer_idx]:
            assert self.error is not None
            raise self.error

    def wait_all(self) -> None:
        """Block until every layer is filled (the load-everything-first mode)."""
        self._thread.join()
        if self.error is not None:
            raise self.error


class StreamingCache(DynamicCache):
    """A ``DynamicCache`` whose layer-``i`` update first waits for the loader's layer ``i``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.loader: LayerwiseLoader | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.loader is not None:
            self.loader.wait(layer_idx)
            if layer_idx == len(self.layers) - 1:
                self.loader = None  # fully loaded: later updates need not wait
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
