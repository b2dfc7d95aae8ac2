"""In-memory tiers: an LRU of immutable blob buffers on one torch device.

``CpuTier`` and ``GpuTier`` are the same structure on two devices. Every stored
buffer is a new tensor that is never written again (copy-on-write): a reader
copying out an old version keeps reading consistent bytes while a writer
replaces it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

import torch

from kvmem.blob import EncodedBlob
from kvmem.stores.base import TierBase

__all__ = ["MemoryTier", "CpuTier", "GpuTier"]


class MemoryTier(TierBase):
    """LRU of blob buffers on ``device``; all operations O(1).

    Args:
        name: tier name for metrics (``cpu``, ``gpu``).
        capacity: bytes this tier may hold.
        device: torch device the buffers live on.
        pin_memory: allocate CPU buffers pinned (for fast copies to a GPU).
    """

    shares_buffers = True

    def __init__(self, name: str, capacity: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False) -> None:
        self.name = name
        self.capacity = capacity
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu"
        # NOTE: OrderedDict order is the LRU order: first = least recently used.
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            buf = self._entries.get(key)
            if buf is not None:
                self._entries.move_to_end(key)
            return buf

    def put(self, key: str, blob: EncodedBlob) -> None:
        buf = blob.to_tensor(self.device, pin_memory=self.pin_memory)
        with self._lock:
            old = self._entries.pop(key, None)
            self._bytes += buf.numel() - (old.numel() if old is not None else 0)
            self._entries[key] = buf

    def contains(self, key: str) -> bool:
        return key in self._entries

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.numel()
            return old is not None

    def keys(self) -> Iterator[str]:
        with self._lock:
            snapshot = list(self._entries)
        return iter(snapshot)

    def usage(self) -> int:
        return self._bytes


class CpuTier(MemoryTier):
    """Host-memory tier; pinned buffers when CUDA is present."""

    def __init__(self, capacity: int) -> None:
        super().__init__("cpu", capacity, "cpu", pin_memory=torch.cuda.is_available())


class GpuTier(MemoryTier):
    """Device-memory tier. Loads from it are not CRC-checked (the bytes never left the device)."""

    checks_crc = False

    def __init__(self, capacity: int, device: torch.device | str = "cuda") -> None:
        super().__init__("gpu", capacity, device)
