"""Dynamic offload of a live cache: the oldest chunks of a generating sequence move to host pages.

:class:`OffloadingCache` is a transformers ``DynamicCache`` whose device keeps only a
window of recent tokens per layer. Three pointers, in tokens and whole chunks:

- ``end``: the planned boundary: everything but the last ``resident_blocks`` chunks
  should be off the device (advanced after each forward pass, in runs of
  ``transfer_blocks`` chunks so that each copy is at least ``min_transfer_bytes``);
- ``current``: how far the offload has got: tokens ``[0, current)`` have host copies;
- ``start``: the device holds tokens ``[start, seq)``; it moves up to ``current``
  once a copy is complete.

NOTE: ``start <= current <= end <= seq`` always. The producer (the decoding loop)
waits only when the offload has fallen more than ``max_lag_blocks`` chunks behind
``end``; otherwise the copies run beside it (a worker thread; on CUDA a side stream).

Attention still needs the offloaded prefix: while layer ``i`` runs, layer ``i + 1``'s
prefix is read back from the host pages (prefetched), and layer ``i``'s update
returns ``prefix + window``, the tensors a plain cache would hold. The device thus
holds every layer's window plus one or two layers' prefix instead of every layer's
whole sequence, and the values attention sees are the same bits.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from kvmem.api import Memory
from kvmem.cuda.transfer import SideStream
from kvmem.errors import ConfigError, UnsupportedModelError
from kvmem.kv.layout import held
from kvmem.ports import BlockTable, PagedBuffer

__all__ = ["OffloadPointers", "OffloadingCache"]


@dataclass
class OffloadPointers:
    """Device holds ``[start, seq)``; host copies cover ``[0, current)``; the plan is ``[0, end)``."""

    start: int = 0
    current: int = 0
    end: int = 0


class _WindowLayer(DynamicLayer):
    """A ``DynamicLayer`` holding tokens ``[offset, seq)`` only; it reports the whole sequence's length."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = 0

    def get_seq_length(self) -> int:
        return self.offset + super().get_seq_length()

    def window(self, first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values of absolute tokens ``[first, stop)``, which the layer holds."""
        keys, values = held(self)
        lo, hi = first - self.offset, stop - self.offset
        return keys[..., lo:hi, :], values[..., lo:hi, :]

    def drop_before(self, start: int) -> None:
        """Free the device copies of the tokens before ``start``: the layer holds ``[start, seq)``."""
        keys, values = held(self)
        cut = start - self.offset
        self.keys, self.values = keys[..., cut:, :].clone(), values[..., cut:, :].clone()
        self.offset = start


class OffloadingCache(DynamicCache):
    """A ``DynamicCache`` that offloads the oldest chunks of every layer to host pages as generation runs.

    Args:
        config: the model's config (full-attention layers only).
        max_tokens: most tokens a sequence may reach (sizes the host page pool).
        block_size: tokens per chunk.
        resident_blocks: chunks of recent tokens kept on the device (>= 1).
        max_lag_blocks: chunks the offload may fall behind its plan before the producer waits.
        min_transfer_bytes: bytes per copy; chunks are offloaded in runs at least this large.
        memory: take the host pages from this memory's CPU tier pool (counted in its usage
            while the cache lives) instead of allocating them apart; apart when it has no
            CPU tier or no free run of pages that long.

    Raises:
        ConfigError: a setting out of range.
        UnsupportedModelError: the model has sliding-window or other non-full-attention layers.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        max_tokens: int,
        block_size: int = 256,
        resident_blocks: int = 4,
        max_lag_blocks: int = 2,
        min_transfer_bytes: int = 1 << 20,
        memory: Memory | None = None,
    ) -> None:
        super().__init__(config=config)
        if any(type(layer) is not DynamicLayer for layer in self.layers):
            kinds = sorted({type(layer).__name__ for layer in self.layers})
            raise UnsupportedModelError(f"layers of type {kinds}: offloading handles full-attention DynamicLayer only")
        for name, value, least in (
            ("max_tokens", max_tokens, 1),
            ("block_size", block_size, 1),
            ("resident_blocks", resident_blocks, 1),
            ("max_lag_blocks", max_lag_blocks, 0),
            ("min_transfer_bytes", min_transfer_bytes, 1),
        ):
            if not isinstance(value, int) or value < least:
                raise ConfigError(f"{name}={value!r}: accepted an integer >= {least}")
        self.layers = [_WindowLayer() for _ in self.layers]
        self.block_size = block_size
        self.resident_blocks = resident_blocks
        self.max_lag_blocks = max_lag_blocks
        self.min_transfer_bytes = min_transfer_bytes
        self.max_tokens = max_tokens
        self.memory = memory
        self.pointers = OffloadPointers()
        self.peak_resident_bytes = 0
        self._host: PagedBuffer | None = None  # made at the first update, when shapes are known
        self._tables = [BlockTable(block_size) for _ in self.layers]
        self._transfer_blocks = 1
        self._side: SideStream | None = None
        self._offloader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-offload")
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-reload")
        self._job: Future[int] | None = None  # the offload in flight; gives its end pointer
        self._prefetched: dict[int, Future[tuple[torch.Tensor, torch.Tensor] | None]] = {}

    # -- the model's side ---------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host is None:
            self._setup(key_states)
        prefix = self._take_prefix(layer_idx)
        keys, values = self._windows[layer_idx].update(key_states, value_states)
        if layer_idx + 1 < len(self.layers):
            self._prefetch(layer_idx + 1)
        if prefix is not None:
            keys, values = torch.cat([prefix[0], keys], dim=-2), torch.cat([prefix[1], values], dim=-2)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes() + _nbytes(keys, values))
        if layer_idx == len(self.layers) - 1:
            self._advance()
            self._prefetch(0)
        return keys, values

    def resident_bytes(self) -> int:
        """Bytes of K/V the cache holds on its device now (windows, not counting a prefix being used)."""
        return sum(_nbytes(*held(layer)) for layer in self._windows if layer.is_initialized)

    def close(self) -> None:
        """Finish copies in flight and stop the worker threads."""
        self._offloader.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True)

    # -- internals -----------------------------------------------------------------
    @property
    def _windows(self) -> list[_WindowLayer]:
        """``self.layers``: ``__init__`` made every one a :class:`_WindowLayer`."""
        return cast("list[_WindowLayer]", self.layers)

    def _setup(self, key_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if batch != 1:
            raise UnsupportedModelError(f"a batch of {batch} sequences: offloading handles one sequence (batch 1)")
        blocks = len(self.layers) * -(-self.max_tokens // self.block_size)
        nbytes = blocks * 2 * heads * self.block_size * dim * key_states.element_size()
        lent = self.memory.lease_host(nbytes) if self.memory is not None else None
        self._host = PagedBuffer(
            blocks,
            2 * heads,
            self.block_size * dim,
            key_states.dtype,
            "cpu",
            pin_memory=key_states.is_cuda,
            storage=lent,
        )
        chunk_layer_bytes = self._host.page_nbytes
        self._transfer_blocks = -(-self.min_transfer_bytes // chunk_layer_bytes)
        self._side = SideStream(key_states.device)

    def _advance(self) -> None:
        """After a forward pass: move ``end``, collect a finished offload, start the next; wait if far behind."""
        p, seq = self.pointers, self.get_seq_length()
        run = self._transfer_blocks * self.block_size
        p.end = max(p.end, (seq - self.resident_blocks * self.block_size) // run * run)
        behind = p.end - p.current > self.max_lag_blocks * self.block_size
        if self._job is not None and (self._job.done() or behind):
            p.current = self._job.result()  # the producer blocks here only when offload fell behind the plan
            self._job = None
            self._drop_offloaded()
        if self._job is None and p.end > p.current:
            self._job = self._submit_offload(p.current, p.end)

    def _submit_offload(self, first: int, stop: int) -> Future[int] | None:
        """Copy tokens ``[first, stop)`` of every layer to host pages in the background; the future gives ``stop``."""
        assert self._host is not None and self._side is not None
        n = (stop - first) // self.block_size
        if self._host.pool.num_free < n * len(self.layers):
            return None  # host pool full: the tokens simply stay on the device
        blocks = []
        for table in self._tables:
            table.grow(self._host.pool, n * self.block_size)
            blocks.append(table.blocks[-n:])
        # views of the window as it is now; a later update makes new tensors, these stay valid.
        sources = [layer.window(first, stop) for layer in self._windows]
        with self._side.after_producer():
            staged = [self._side.to_host(_pages_of(k, v)) for k, v in sources]
            done = self._side.done_event()

        def finish() -> int:
            if done is not None:
                done.synchronize()
            for layer_blocks, src in zip(blocks, staged):
                self._host.write(layer_blocks, src)  # type: ignore[union-attr]
            return stop

        return self._offloader.submit(finish)

    def _drop_offloaded(self) -> None:
        """Free the device copies of tokens ``[start, current)``: ``start`` moves up to ``current``."""
        p = self.pointers
        for layer in self._windows:
            layer.drop_before(p.current)
        p.start = p.current
        self._prefetched.clear()

    def _prefetch(self, layer_idx: int) -> None:
        """Start reading layer ``layer_idx``'s offloaded prefix ``[0, start)`` back to the device."""
        tokens = self.pointers.start
        if tokens == 0 or layer_idx in self._prefetched:
            return
        assert self._host is not None and self._side is not None
        blocks = self._tables[layer_idx].blocks[: tokens // self.block_size]
        heads = self._host.pages.shape[1] // 2

        def load() -> tuple[torch.Tensor, torch.Tensor]:
            with self._side.after_producer():  # type: ignore[union-attr]
                pages = self._side.to_device(self._host.read(blocks))  # type: ignore[union-attr]
            kv = pages.view(2, heads, tokens, -1).unsqueeze(1)
            return kv[0], kv[1]

        self._prefetched[layer_idx] = self._prefetcher.submit(load)

    def _take_prefix(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer_idx``'s offloaded prefix on the device (waiting for its prefetch), or ``None``."""
        if self.pointers.start == 0:
            return None
        self._prefetch(layer_idx)  # a no-op when prefetched already, as it is after the first layer
        k, v = self._prefetched.pop(layer_idx).result()  # type: ignore[misc]
        if k.is_cuda:
            consumer = torch.cuda.current_stream(k.device)
            consumer.wait_stream(self._side.stream)  # type: ignore[union-attr, arg-type]
            k.record_stream(consumer)  # NOTE: made on the side stream, read on this one
        return k, v


def _pages_of(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` K and V as one ``[2H, T * D]`` tensor: the host pages' gather layout."""
    return torch.cat([keys[0], values[0]], dim=0).reshape(2 * keys.shape[1], -1)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
