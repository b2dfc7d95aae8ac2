"""A prefix's chunks from host memory to a GPU without stalling the model's stream.

On a GPU the forward pass over a short suffix is launch-bound, and a prefix's bytes
cross to the device at tens of GB/s; what made reuse slow was how they crossed. One
synchronous ``.to(device)`` per chunk per K/V on the model's stream (544 of them for
4,096 tokens of a 16-layer model, each waiting for its copy and for the model's queued
kernels, each holding the GIL that the forward pass launches kernels with) put TTFT
at 2.3x that of a prefix cache already on the GPU (measured on an H200,
``benchmarks/gpu_check.sh``).

:class:`DeviceStaging` moves each chunk's checked payload to the device in one
asynchronous copy on a side stream (the CPU tier's pages are pinned when CUDA is
present, so it is a DMA that does not block the host), then puts each layer into its
cache buffers with one copy kernel per K and V for the run of whole chunks (int8/int4:
the fused dequantize + scatter per chunk), records an event, and makes the model's
stream wait for that event only when the forward pass reaches the layer
(:meth:`DeviceStaging.ready`). The device holds the staged payloads (the prefix's
size, once more) until the load ends.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmem.codecs import tensor_codec
from kvmem.codecs.quant import QuantCodec
from kvmem.codecs.serialization import decode_tensor_range, stored_as_is, tensor_parts_range, torch_dtype
from kvmem.cuda.kvquant import dequantize_kv_into

__all__ = ["DeviceStaging", "quantized_leaf"]

_ROW_ALIGN = 64  # bytes: each chunk's row starts aligned, so its parts can be viewed as their dtype


def quantized_leaf(leaf: dict[str, Any]) -> bool:
    """Whether a K/V leaf is int8/int4-coded (then the fused op decodes it, straight into the cache).

    Raises:
        CodecError: the leaf names an unknown codec.
    """
    return isinstance(tensor_codec(leaf["codec"]), QuantCodec) and not leaf["meta"].get("raw")


Span = tuple[int, int, int]  # (prefix position, first chunk token, tokens): see LayerwiseLoader._span


class DeviceStaging:
    """One prefix load's side stream, staged chunk payloads and per-layer events on a CUDA ``device``.

    Made on the thread that will run the model (its current stream is the one that waits);
    :meth:`stage` and :meth:`place` run on the loader's thread, :meth:`ready` on the model's.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.consumer = torch.cuda.current_stream(device)
        self._stream = torch.cuda.Stream(device)
        # NOTE: after everything queued before the load (a freed cache's last reads included), so
        # that memory the allocator hands this load is no longer in use on the model's stream
        self._stream.wait_stream(self.consumer)
        self._events: dict[int, torch.cuda.Event] = {}
        self._held: list[torch.Tensor] = []
        self._rows = torch.empty(0, 0, dtype=torch.uint8, device=device)
        self._lo = 0

    def stage(self, payloads: list[torch.Tensor], lo: int) -> None:
        """Start copying each chunk's checked payload bytes (from payload offset ``lo``, all the same length)."""
        size = payloads[0].numel()
        pitch = -(-size // _ROW_ALIGN) * _ROW_ALIGN
        with torch.cuda.stream(self._stream):
            self._rows = torch.empty(len(payloads), pitch, dtype=torch.uint8, device=self.device)
            for row, data in zip(self._rows, payloads):
                row[:size].copy_(data, non_blocking=True)
        self._held = payloads  # the host bytes stay alive (and their pages held) until the copies are done
        self._lo = lo

    def queueing(self) -> torch.cuda.StreamContext:
        """The side stream as the current one: :meth:`place` queues its work there."""
        return torch.cuda.stream(self._stream)

    def place(
        self,
        layer_idx: int,
        chunks: list[int],
        spans: list[Span],
        leaves: list[dict[str, Any]],
        dst: list[torch.Tensor],
    ) -> None:
        """Queue layer ``layer_idx``'s K and V of staged ``chunks`` into ``dst`` (``[B, H, S, D]``) at ``spans``.

        Called inside :meth:`queueing`. Every chunk has the same ``leaves`` (the caller
        checked): int8/int4 leaves are dequantized chunk by chunk; bytes stored as they
        are go in one copy per run of whole chunks; anything else is decoded on the
        device chunk by chunk.
        """
        for buffer, leaf in zip(dst, leaves):
            if quantized_leaf(leaf):
                for chunk, (start, skip, count) in zip(chunks, spans):
                    parts = tensor_parts_range(self._rows[chunk], self._lo, leaf)
                    dequantize_kv_into(buffer, start, parts, leaf["meta"], skip=skip, count=count)
            else:
                self._copy_leaf(buffer, chunks, spans, leaf)
        event = torch.cuda.Event()
        event.record(self._stream)
        self._events[layer_idx] = event

    def _copy_leaf(self, dst: torch.Tensor, chunks: list[int], spans: list[Span], leaf: dict[str, Any]) -> None:
        part = stored_as_is(leaf)
        tokens = int(leaf["shape"][2])
        i = 0
        while i < len(chunks):
            j = i
            while part is not None and j < len(chunks) and spans[j][1:] == (0, tokens):
                j += 1  # a run of whole chunks: [B, H, chunks * T, D] filled by one copy kernel
            if j - i > 1:
                assert part is not None
                off = int(part["off"]) - self._lo
                whole = self._rows[chunks[i] : chunks[j - 1] + 1, off : off + int(part["n"])]
                src = whole.view(torch_dtype(part["dtype"])).view(j - i, *leaf["shape"])
                start = spans[i][0]
                dst[:, :, start : start + (j - i) * tokens].unflatten(2, (j - i, tokens)).copy_(
                    src.permute(1, 2, 0, 3, 4)
                )
                i = j
                continue
            start, skip, count = spans[i]
            value = decode_tensor_range(self._rows[chunks[i]], self._lo, leaf)
            dst[:, :, start : start + count].copy_(value[:, :, skip : skip + count])
            i += 1

    def ready(self, layer_idx: int) -> None:
        """Make the model's stream (the caller's current one) wait for layer ``layer_idx``'s copies."""
        event = self._events.pop(layer_idx, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def finish(self) -> None:
        """Wait for every queued copy, then let the host bytes and the staged payloads go."""
        self._stream.synchronize()
        self._held = []
        self._rows = torch.empty(0, 0, dtype=torch.uint8, device=self.device)  # NOTE: not a view: frees the rows
