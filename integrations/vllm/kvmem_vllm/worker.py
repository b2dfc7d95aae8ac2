"""The worker side: blocks loaded from kvmem straight into vLLM's KV cache, and saved from it.

Every layer's KV cache is a view of one buffer at equal strides (vLLM's CPU backend: ``[num_blocks,
num_kv_heads, block_size, 2 * head_dim]`` per layer; with several KV cache groups, layer ``j`` of every group
shares tensor ``j``), so one block of every tensor is one strided view, ``[num_tensors, *block]``. A chunk of
blocks is stored as one tensor whose rows are its blocks, and loaded with ``Memory.load_many(out=[[view, ...],
...])``: each row straight into its block's view, one copy, no buffer in between (a block vLLM already holds
is skipped). Synchronous loads run before the forward pass of the step that needs them; asynchronous ones on
the loader's threads, into the blocks of requests that wait for them (vLLM schedules those once
:meth:`WorkerSide.finished` reports them). The chunks vLLM evicted (the step's ``evicted``) are warmed from
the persistent tiers into the CPU tier on a thread of their own, so the CPU tier holds what vLLM's cache
does not (with ``write_policy="around"``, saves and loads leave it alone). Saves are stored from those views
on the saver's thread (:mod:`kvmem_vllm.saver`), after the forward pass that computed them; a sliding
window's blocks are freed while their request runs, so with such a group a chunk's rows are gathered into a
tensor of their own before the next step.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from kvmem import Memory
from kvmem.errors import ConfigError
from kvmem.threads import yield_to_compute
from kvmem_vllm.identity import rank_key
from kvmem_vllm.log import logger
from kvmem_vllm.metadata import ChunkTransfer, KVMemMetadata, KVMemWorkerMeta
from kvmem_vllm.saver import Saver
from kvmem_vllm.stats import TIERS

__all__ = ["BlockViews", "WorkerSide"]

# NOTE: how long an empty step waits for a save or a load to end (requests holding blocks): long enough that the
# engine's loop does not take the cores the save needs, short enough that a request arriving meanwhile is not held
# up (the loop takes new requests between steps; a 50 ms wait added the rest of the last request's save to the
# next one's TTFT at concurrency 1)
_IDLE_WAIT_S = 0.002
_LOADER_THREADS = 2  # requests loading at once (each one's blocks are read in one batched load_many)
_WARMERS = 1  # evicted chunks warmed into the CPU tier at once (a background copy: one thread)


class BlockViews:
    """One vLLM block across every KV cache tensor, as a view of the KV cache.

    Args:
        kv_caches: vLLM's KV cache tensors by layer name, in layer order (layers of different KV cache groups
            share a tensor: each tensor counts once).
        num_blocks: blocks per layer (finds the block dimension).

    Raises:
        ConfigError: the layers are not views of one buffer at equal strides, or no single dimension
            has ``num_blocks`` entries.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        shared = {(t.untyped_storage().data_ptr(), t.storage_offset()): t for t in kv_caches.values()}
        layers = sorted(shared.values(), key=lambda t: t.storage_offset())
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
        self.block_bytes = len(layers) * first.select(self.block_dim, 0).numel() * first.element_size()
        block = first.select(self.block_dim, 0)
        self.shape = [len(layers), *block.shape]
        self._strides = [step, *block.stride()]

    def __call__(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` of every layer: a ``[num_layers, *block]`` view of the KV cache."""
        return self._first.as_strided(self.shape, self._strides, self._offset(block_id))

    def span(self, block_ids: list[int]) -> torch.Tensor | None:
        """Blocks ``block_ids`` as the rows of one ``[len(block_ids), num_layers, *block]`` view of the KV cache
        when they are consecutive (one block always is; vLLM's free queue often hands out runs), else ``None``.

        NOTE: a save stores such a view as it is (each block's layers are contiguous runs the disk tier writes
        with one ``pwritev``): stacking the blocks first cost a fresh 2 MiB tensor per block here, ~5 ms of page
        faults, on a thread beside the forward pass.
        """
        if not block_ids or block_ids != list(range(block_ids[0], block_ids[0] + len(block_ids))):
            return None
        shape, strides = [len(block_ids), *self.shape], [self._first.stride(self.block_dim), *self._strides]
        return self._first.as_strided(shape, strides, self._offset(block_ids[0]))

    def _offset(self, block_id: int) -> int:
        return int(self._first.storage_offset() + block_id * self._first.stride(self.block_dim))


class WorkerSide:
    """The worker half of :class:`~kvmem_vllm.KVMemConnector`.

    Args:
        memory: this worker's memory (its CPU tier is the fast one).
        namespace: the keys' namespace (:func:`kvmem_vllm.identity.namespace`).
        num_blocks: blocks per layer in vLLM's KV cache.
        compression: codec of the saved blocks.
        rank: this worker's tensor-parallel rank: it stores and loads its shard of each block under
            :func:`~kvmem_vllm.identity.rank_key`.
        whole_requests: a failed load fails its request (:meth:`take_failed_requests`), not its blocks
            (:meth:`take_failed`): with several KV cache groups (:attr:`kvmem_vllm.groups.GroupLayout.whole_requests`).
        gather: a save copies its rows out of the KV cache before the next step (a sliding window's blocks
            are freed while their request runs).
    """

    def __init__(
        self,
        memory: Memory,
        namespace: str,
        num_blocks: int,
        compression: str,
        rank: int = 0,
        *,
        whole_requests: bool = False,
        gather: bool = False,
    ) -> None:
        self.memory = memory
        self.whole_requests = whole_requests
        self.gather = gather
        self.rank = rank
        self.namespace = namespace
        self.num_blocks = num_blocks
        self.views: BlockViews | None = None
        self._failed: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests whose synchronous load failed this step (their saves dropped)
        self._failed_loads: set[str] = set()  # with whole_requests: requests whose asynchronous load failed
        self._failed_keys: set[str] = set()  # chunks whose load failed, for the scheduler side
        self.loaded_blocks = 0
        self.failed_blocks = 0
        self.load_seconds = 0.0  # NOTE: spent loading before forward passes (what layer-by-layer loads could hide)
        self.async_blocks = 0  # blocks loaded asynchronously (or tried: their failures are in failed_blocks)
        self.async_load_seconds = 0.0  # spent on the loader's threads (beside the forward passes)
        self.saver = Saver(memory, namespace, compression)
        self._loader = ThreadPoolExecutor(
            max_workers=_LOADER_THREADS, thread_name_prefix="kvmem-vllm-loader", initializer=yield_to_compute
        )
        self._loading: dict[str, tuple[ChunkTransfer, Future[tuple[list[int], float]]]] = {}  # asynchronous loads
        self.warmed_chunks = 0  # evicted chunks warmed into the CPU tier
        memory_tiers = memory.config.cpu_bytes > 0 or memory.config.gpu_bytes > 0
        self._exclusive = memory_tiers and memory.config.write_policy == "around"
        self._warmer: ThreadPoolExecutor | None = None
        if memory_tiers:
            self._warmer = ThreadPoolExecutor(_WARMERS, "kvmem-vllm-warmer", initializer=yield_to_compute)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's per-layer KV cache tensors (see :class:`BlockViews`)."""
        self.views = BlockViews(kv_caches, self.num_blocks)

    def start_async(self, meta: KVMemMetadata) -> None:
        """Start this step's asynchronous loads on the loader's threads (as soon as the step's metadata is
        bound, before its forward pass: a load that ends within the step is reported at its end), and the
        warming of the chunks vLLM evicted."""
        if meta.evicted and self._warmer is not None:
            self._warmer.submit(self._warm, meta.evicted)
        for transfer in meta.async_loads:
            self._loading[transfer.req_id] = (transfer, self._loader.submit(self._timed_load, transfer))

    def load(self, meta: KVMemMetadata) -> None:
        """Write this step's synchronous loads into their blocks; the blocks that could not be loaded are
        remembered.

        NOTE: a block is loaded or reported failed, never half-trusted: a copy that fails its CRC is
        quarantined by kvmem and its load is a miss, a failing tier is skipped, a load that raises anything
        fails every block of its request, and a miss is reported to vLLM (:meth:`take_failed`), which
        recomputes the block (overwriting whatever a failed load wrote into it).
        """
        self._failed_reqs = set()
        start = time.perf_counter()
        for transfer in meta.loads:
            if self._count(transfer, self._load_one(transfer)):
                self._failed_reqs.add(transfer.req_id)
        self.load_seconds += time.perf_counter() - start

    def _count(self, transfer: ChunkTransfer, failed_chunks: list[int]) -> set[int]:
        """Note a finished load: its failed blocks are reported to vLLM by :meth:`take_failed` (or its request by
        :meth:`take_failed_requests`), its failed chunks to the scheduler side (:meth:`worker_meta`); the ids of
        the blocks not loaded."""
        failed = {b for c in failed_chunks for b in transfer.blocks[c] if b is not None}
        self._failed_keys.update(transfer.keys[c] for c in failed_chunks)
        if failed and self.whole_requests:
            self._failed_loads.add(transfer.req_id)
        elif failed:
            self._failed |= failed
        self.failed_blocks += len(failed)
        self.loaded_blocks += len(transfer.block_ids) - len(failed)
        return failed

    def _timed_load(self, transfer: ChunkTransfer) -> tuple[list[int], float]:
        """An asynchronous load (on a loader thread): the chunks not loaded, and the seconds it took."""
        start = time.perf_counter()
        failed = self._load_one(transfer)
        return failed, time.perf_counter() - start

    def _warm(self, keys: list[str]) -> None:
        """Warm ``keys`` (chunks vLLM evicted) into the CPU tier from the tiers below (CRC-checked on the way).

        NOTE: a chunk not stored (its save failed, or is still queued) is skipped; a failure costs a future
        load from disk, never the engine."""
        store = self.memory.chunk_store()
        for key in keys:
            try:
                if store.warm(self.memory.storage_key(rank_key(key, self.rank), self.namespace)):
                    self.warmed_chunks += 1
            except Exception as exc:
                logger.warning("kvmem: warming an evicted chunk failed (%s): %s", type(exc).__name__, exc)

    def _loads_done(self) -> set[str]:
        """The requests whose asynchronous load has finished since the last call; their failed blocks are
        reported in the same step (vLLM's rule: no later than the step that reports the request received)."""
        done = {r for r, (_, future) in self._loading.items() if future.done()}
        for req_id in done:
            transfer, future = self._loading.pop(req_id)
            failed, seconds = future.result()  # NOTE: _load_one raises nothing: a failure is its chunks' indexes
            self.async_load_seconds += seconds
            self.async_blocks += len(transfer.block_ids)
            self._count(transfer, failed)
        return done

    def _load_one(self, transfer: ChunkTransfer) -> list[int]:
        """Load one request's chunks; the chunks not loaded, by index (all of them when the load raised, or when
        its rows do not hold every block vLLM allocated).

        NOTE: any exception is a failed load, not the step's: a stored chunk that does not fit this layout
        (``KVMemError``), a fault in a tier or a copy (``OSError``, ``RuntimeError``...) is recomputed by
        vLLM, never injected, and the engine goes on serving.
        """
        views = self._views()
        if not transfer.complete:
            logger.warning("kvmem: a load's chunks do not hold every block vLLM allocated for it: it is recomputed")
            return list(range(len(transfer.keys)))
        try:
            got = self.memory.load_many(
                [rank_key(k, self.rank) for k in transfer.keys],
                namespace=self.namespace,
                out=[[None if b is None else views(b) for b in chunk] for chunk in transfer.blocks],
            )
        except Exception as exc:
            logger.warning("kvmem: loading %d chunk(s) failed (%s): %s", len(transfer.keys), type(exc).__name__, exc)
            return list(range(len(transfer.keys)))
        if self._exclusive and self._warmer is not None:
            self._warmer.submit(self._release, [k for k, value in zip(transfer.keys, got) if value is not None])
        return [c for c, value in enumerate(got) if value is None]

    def _release(self, keys: list[str]) -> None:
        """Drop the CPU tier's copies of ``keys`` (chunks just loaded into vLLM's cache, which holds them now;
        the persistent tiers keep theirs, and an eviction warms them again)."""
        store = self.memory.chunk_store()
        for key in keys:
            try:
                store.release(self.memory.storage_key(rank_key(key, self.rank), self.namespace))
            except Exception as exc:
                logger.warning("kvmem: releasing a loaded chunk failed (%s): %s", type(exc).__name__, exc)

    def save(self, meta: KVMemMetadata) -> None:
        """Queue this step's completed chunks for the saver thread (a request whose load failed this step
        saves nothing): the forward pass of the next step does not wait for them (with ``gather``, the copy of
        their rows out of the KV cache does)."""
        if not meta.saves:
            return
        views = self._views()
        items: list[tuple[str, list[torch.Tensor] | torch.Tensor]] = []
        for transfer in meta.saves:
            if transfer.req_id in self._failed_reqs:
                continue
            for key, chunk in zip(transfer.keys, transfer.blocks):
                ids = [b for b in chunk if b is not None]
                span = None if self.gather else views.span(ids)  # NOTE: a view, stored as it is (see span)
                if span is None:
                    rows = [views(b) for b in ids]
                    items.append((rank_key(key, self.rank), torch.stack(rows) if self.gather else rows))
                else:
                    items.append((rank_key(key, self.rank), span))
        self.saver.submit({t.req_id for t in meta.saves}, items)

    def finished(self, meta: KVMemMetadata | None, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Of the finished requests, those whose saves are done (vLLM frees their blocks); and the requests
        whose asynchronous load has finished (vLLM schedules them).

        NOTE: on a step with nothing scheduled, vLLM steps again at once while a finished request holds its
        blocks or a request waits for its KV: waiting here (briefly) for a save or a load to end, or for
        another instance to save the KV handed off, keeps that loop from taking the CPU they need.
        """
        saved = self.saver.finished(finished_req_ids)
        loaded = self._loads_done()
        if saved or loaded or meta is None or not meta.idle:
            return saved, loaded
        if self._loading:
            wait([future for _, future in self._loading.values()], _IDLE_WAIT_S, FIRST_COMPLETED)
            loaded = self._loads_done()
        elif self.saver.waiting():
            self.saver.wait_any(_IDLE_WAIT_S)
        elif meta.handoff:  # NOTE: the KV comes from another instance, which needs the cores to save it
            time.sleep(_IDLE_WAIT_S)
        return saved | self.saver.finished(()), loaded

    def preempted(self, meta: KVMemMetadata) -> None:
        """Wait for the saves of the requests preempted this step: their blocks were freed and may be written
        by this step's forward pass."""
        if meta.preempted:
            self.saver.wait_for(meta.preempted)

    @property
    def saved_blocks(self) -> int:
        """Blocks stored so far."""
        return self.saver.saved_blocks

    def totals(self) -> dict[str, float]:
        """This worker's numbers since it started (:data:`kvmem_vllm.stats.COUNTERS`), and the blocks queued for
        saving now (``saves_pending``)."""
        block_bytes = self.views.block_bytes if self.views is not None else 0
        hits = {f"loaded_chunks_{tier}": self.memory.metrics.hits_of(tier, "tensor") for tier in TIERS}
        return {
            "loaded_blocks": self.loaded_blocks,
            "loaded_async_blocks": self.async_blocks,
            "failed_blocks": self.failed_blocks,
            "loaded_bytes": self.loaded_blocks * block_bytes,
            "load_seconds": self.load_seconds,
            "async_load_seconds": self.async_load_seconds,
            "saved_blocks": self.saver.saved_blocks,
            "saved_bytes": self.saver.saved_blocks * block_bytes,
            "save_seconds": self.saver.save_seconds,
            **hits,
            "warmed_chunks": self.warmed_chunks,
            "saves_pending": self.saver.queued_blocks,
        }

    def close(self) -> None:
        """Finish the loads and saves in flight (before the memory is closed)."""
        self._loader.shutdown(wait=True)
        if self._warmer is not None:
            self._warmer.shutdown(wait=True, cancel_futures=True)
        self.saver.close()

    def take_failed(self) -> set[int]:
        """The blocks whose load failed since the last call."""
        failed, self._failed = self._failed, set()
        return failed

    def take_failed_requests(self) -> set[str]:
        """With ``whole_requests``: the requests whose asynchronous load failed since the last call (each reported
        loaded by :meth:`finished` in the same call or an earlier one)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def worker_meta(self) -> KVMemWorkerMeta | None:
        """The chunks whose load failed since the last call, for the scheduler side (``None``: none)."""
        if not self._failed_keys:
            return None
        meta, self._failed_keys = KVMemWorkerMeta(self._failed_keys), set()
        return meta

    def _views(self) -> BlockViews:
        if self.views is None:
            raise ConfigError("kvmem-vllm: a transfer before register_kv_caches (vLLM did not register its KV cache)")
        return self.views
