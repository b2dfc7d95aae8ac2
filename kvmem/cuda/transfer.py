"""Aggregated device <-> host copies: small pages travel in runs of at least ``min_bytes``.

A copy between a GPU and pinned host memory costs a fixed setup per call; pages
of tens of KB waste most of the link on it. :func:`plan_runs` groups consecutive
pages into runs of at least ``min_bytes`` (the seed: 16 x 64 KB pages -> one
1 MB copy), and :class:`SideStream` issues each run's copy on a side CUDA stream
ordered after the producer's work by an event, so the copy overlaps the next
layer's compute. On a CPU "device" the same calls run in place (what CI tests).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from kvmem.errors import ConfigError

__all__ = ["plan_runs", "SideStream"]


def plan_runs(n_pages: int, page_bytes: int, min_bytes: int = 1 << 20) -> list[range]:
    """Consecutive page indices ``0..n_pages-1`` in runs of at least ``min_bytes`` (the last may be short).

    Raises:
        ConfigError: ``page_bytes`` or ``min_bytes`` < 1.
    """
    if page_bytes < 1 or min_bytes < 1:
        raise ConfigError(f"page_bytes={page_bytes}, min_bytes={min_bytes}: accepted sizes >= 1")
    per = -(-min_bytes // page_bytes)
    return [range(i, min(i + per, n_pages)) for i in range(0, n_pages, per)]


class SideStream:
    """Where asynchronous copies run: a side CUDA stream on a GPU, in place on a CPU.

    Args:
        device: the device whose copies these are.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream (``None`` on a CPU)."""
        return self._stream

    def after_producer(self) -> AbstractContextManager[object]:
        """A context in which work runs on the side stream, after everything queued on the current stream so far.

        NOTE: call it on the producer's thread; the event it records orders the copies after the
        kernels that produced their source.
        """
        if self._stream is None:
            return nullcontext()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._stream.wait_event(ready)
        return torch.cuda.stream(self._stream)

    def done_event(self) -> torch.cuda.Event | None:
        """An event marking the end of the work queued on the side stream so far (``None`` on a CPU)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` in pinned host memory, one copy (inside :meth:`after_producer`); a CPU ``src`` as is."""
        if src.device.type == "cpu":
            return src
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        host.copy_(src, non_blocking=True)
        src.record_stream(self._stream)  # type: ignore[arg-type]  # NOTE: not reused before the copy is done
        return host

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` (host) copied to this device in one copy, pinned first so the copy is asynchronous."""
        if self.device.type == "cpu":
            return src
        return src.pin_memory().to(self.device, non_blocking=True)
