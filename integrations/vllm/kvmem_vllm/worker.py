"""The worker side: blocks loaded from kvmem straight into vLLM's KV cache, and saved from it.

Every layer's KV cache is a view of one buffer at equal strides (vLLM's CPU backend:
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` per layer), so one block of every layer is
one strided view, ``[num_layers, *block]``: a block is stored as one tensor and loaded with
``Memory.load_many(out=...)`` into that view, one copy, no buffer in between. Saves are stored from
those views on the saver's thread (:mod:`kvmem_vllm.saver`), after the forward pass that computed them.
"""

from __future__ import annotations

import time

import torch

from kvmem import Memory
from kvmem.errors import ConfigError
from kvmem_vllm.log import logger
from kvmem_vllm.metadata import BlockTransfer, KVMemMetadata
from kvmem_vllm.saver import Saver

__all__ = ["BlockViews", "WorkerSide"]

_IDLE_WAIT_S = 0.05  # how long an empty step waits for a save to end (finished requests holding blocks)


class BlockViews:
    """One vLLM block across every layer, as a view of the KV cache.

    Args:
        kv_caches: vLLM's KV cache tensors by layer name, in layer order.
        num_blocks: blocks per layer (finds the block dimension).

    Raises:
        ConfigError: the layers are not views of one buffer at equal strides, or no single dimension
            has ``num_blocks`` entries.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        layers = list(kv_caches.values())
        if not layers:
            raise ConfigError("register_kv_caches got no KV cache tensor: expected one per attention layer")
        first = layers[0]
        dims = [d for d, n in enumerate(first.shape) if n == num_blocks]
        if len(dims) != 1:
            raise ConfigError(
                f"KV cache of shape {list(first.shape)}: expected exactly one dimension of {num_blocks} blocks"
            )
        self.block_dim = dims[0]
        offsets = [t.storage_offset() for t in layers]
        step = offsets[1] - offsets[0] if len(layers) > 1 else first.numel()
        same = all(
            t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and t.shape == first.shape
            and t.stride() == first.stride()
            and t.dtype == first.dtype
            and off == offsets[0] + i * step
            for i, (t, off) in enumerate(zip(layers, offsets))
        )
        if not same or step <= 0:
            raise ConfigError(
                f"KV caches of {len(layers)} layers ({', '.join(list(kv_caches)[:2])}, ...) are not views of one "
                "buffer at equal strides: kvmem-vllm stores a block of every layer as one tensor and needs that layout"
            )
        self._first = first
        self._layer_stride = step
        block = first.select(self.block_dim, 0)
        self.shape = [len(layers), *block.shape]
        self._strides = [step, *block.stride()]

    def __call__(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` of every layer: a ``[num_layers, *block]`` view of the KV cache."""
        offset = self._first.storage_offset() + block_id * self._first.stride(self.block_dim)
        return self._first.as_strided(self.shape, self._strides, offset)


class WorkerSide:
    """The worker half of :class:`~kvmem_vllm.KVMemConnector`.

    Args:
        memory: this worker's memory (its CPU tier is the fast one).
        namespace: the keys' namespace (:func:`kvmem_vllm.identity.namespace`).
        num_blocks: blocks per layer in vLLM's KV cache.
        compression: codec of the saved blocks.
    """

    def __init__(self, memory: Memory, namespace: str, num_blocks: int, compression: str) -> None:
        self.memory = memory
        self.namespace = namespace
        self.num_blocks = num_blocks
        self.views: BlockViews | None = None
        self._failed: set[int] = set()
        self._failed_reqs: set[str] = set()
        self.loaded_blocks = 0
        self.failed_blocks = 0
        self.load_seconds = 0.0  # NOTE: spent loading before forward passes (what layer-by-layer loads could hide)
        self.saver = Saver(memory, namespace, compression)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's per-layer KV cache tensors (see :class:`BlockViews`)."""
        self.views = BlockViews(kv_caches, self.num_blocks)

    def load(self, meta: KVMemMetadata) -> None:
        """Write this step's loads into their blocks; the blocks that could not be loaded are remembered.

        NOTE: a block is loaded or reported failed, never half-trusted: a copy that fails its CRC is
        quarantined by kvmem and its load is a miss, a failing tier is skipped, a load that raises anything
        fails every block of its request, and a miss is reported to vLLM (:meth:`take_failed`), which
        recomputes the block (overwriting whatever a failed load wrote into it).
        """
        self._failed_reqs = set()
        start = time.perf_counter()
        for transfer in meta.loads:
            failed = self._load_one(transfer)
            if failed:
                self._failed |= failed
                self._failed_reqs.add(transfer.req_id)
                self.failed_blocks += len(failed)
            self.loaded_blocks += len(transfer.block_ids) - len(failed)
        self.load_seconds += time.perf_counter() - start

    def _load_one(self, transfer: BlockTransfer) -> set[int]:
        """Load one request's blocks; the ids of those not loaded (all of them when the load raised).

        NOTE: any exception is a failed load, not the step's: a stored block that does not fit this layout
        (``KVMemError``), a fault in a tier or a copy (``OSError``, ``RuntimeError``...) is recomputed by
        vLLM, never injected, and the engine goes on serving.
        """
        views = self._views()
        try:
            got = self.memory.load_many(
                transfer.keys, namespace=self.namespace, out=[views(b) for b in transfer.block_ids]
            )
        except Exception as exc:
            logger.warning("kvmem: loading %d block(s) failed (%s): %s", len(transfer.keys), type(exc).__name__, exc)
            return set(transfer.block_ids)
        return {b for b, value in zip(transfer.block_ids, got) if value is None}

    def save(self, meta: KVMemMetadata) -> None:
        """Queue this step's completed chunks for the saver thread (a request whose load failed this step
        saves nothing): the forward pass of the next step does not wait for them."""
        views = self._views()
        items = [
            (key, views(b))
            for transfer in meta.saves
            if transfer.req_id not in self._failed_reqs
            for key, b in zip(transfer.keys, transfer.block_ids)
        ]
        self.saver.submit({t.req_id for t in meta.saves}, items)

    def finished(self, meta: KVMemMetadata | None, finished_req_ids: set[str]) -> set[str]:
        """Of the finished requests, those whose saves are done: vLLM frees their blocks.

        NOTE: on a step with nothing scheduled, vLLM steps again at once while a finished request holds its
        blocks: waiting here for a save to end (briefly) keeps that loop from taking the CPU the saves need.
        """
        done = self.saver.finished(finished_req_ids)
        if not done and meta is not None and meta.idle and self.saver.waiting():
            self.saver.wait_any(_IDLE_WAIT_S)
            done = self.saver.finished(())
        return done

    def preempted(self, meta: KVMemMetadata) -> None:
        """Wait for the saves of the requests preempted this step: their blocks were freed and may be written
        by this step's forward pass."""
        if meta.preempted:
            self.saver.wait_for(meta.preempted)

    @property
    def saved_blocks(self) -> int:
        """Blocks stored so far."""
        return self.saver.saved_blocks

    def close(self) -> None:
        """Finish the saves in flight (before the memory is closed)."""
        self.saver.close()

    def take_failed(self) -> set[int]:
        """The blocks whose load failed since the last call."""
        failed, self._failed = self._failed, set()
        return failed

    def _views(self) -> BlockViews:
        if self.views is None:
            raise ConfigError("kvmem-vllm: a transfer before register_kv_caches (vLLM did not register its KV cache)")
        return self.views
