"""``KVMemConnector``: kvmem as vLLM's KV connector (``KVConnectorBase_V1``, vLLM 0.32).

Configured the vLLM way::

    KVTransferConfig(
        kv_connector="KVMemConnector",
        kv_connector_module_path="kvmem_vllm",
        kv_role="kv_both",                      # or kv_producer (saves only) / kv_consumer (loads only)
        kv_load_failure_policy="recompute",     # a block that fails its CRC is recomputed, not fatal
        kv_connector_extra_config={"path": "/var/cache/kvmem", "disk_bytes": "50GiB"},
    )

The scheduler-side instance probes kvmem for the longest stored run of a prompt's chunks and plans
loads and saves (:mod:`kvmem_vllm.scheduler`); the worker-side instance, in another process, moves the
blocks (:mod:`kvmem_vllm.worker`). A request whose KV is on this machine loads it before the forward pass
of the step that schedules it (synchronous loads); one whose KV is only in the remote tier waits for it
while other requests run (asynchronous loads, ``load_async``). Saves are stored on a thread of their own
after the forward pass (:mod:`kvmem_vllm.saver`), and a finished request keeps its blocks until its saves
are done.

It takes vLLM's hybrid KV cache groups (``SupportsHMA``: full and sliding-window attention, each group's
blocks stored and loaded as that group keeps them, :mod:`kvmem_vllm.groups`); an engine with a group of
another kind (a Mamba layer's state) runs with the connector idle: nothing loaded or saved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvmem import Memory
from kvmem.codecs import parse_codec
from kvmem.errors import ConfigError
from kvmem_vllm.groups import GroupLayout, UnsupportedLayout, group_windows
from kvmem_vllm.identity import ConnectorOptions, attention_backend, chunk_blocks, memory_settings, namespace
from kvmem_vllm.log import logger
from kvmem_vllm.metadata import KVMemMetadata, KVMemWorkerMeta
from kvmem_vllm.placement import place_background_threads
from kvmem_vllm.scheduler import SchedulerSide
from kvmem_vllm.stats import KVMemPromMetrics, KVMemStats, since
from kvmem_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVMemConnector"]


class KVMemConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's prefix KV kept in kvmem: reused across requests, engine restarts and instances.

    Args:
        vllm_config: the engine's config; ``kv_transfer_config.kv_connector_extra_config`` holds ``path``
            and any other :class:`kvmem.config.Config` field.
        role: scheduler or worker.
        kv_cache_config: the engine's KV cache layout.

    Raises:
        ConfigError: no ``path``, a bad kvmem setting, a chunk that is not a whole number of vLLM blocks,
            the scheduler side without a persistent tier (disk or remote), or an unsupported engine layout
            (pipeline parallelism).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        settings = memory_settings(transfer.kv_connector_extra_config or {})
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._reported: dict[str, float] = {}  # the worker's totals at its last stats report
        if role == KVConnectorRole.SCHEDULER:
            # NOTE: the scheduler only probes; the CPU tier that holds blocks is the worker's, in another
            # process, so the scheduler sees what reached a persistent tier (disk, remote).
            memory = Memory(**{**settings, "cpu_bytes": 0, "metrics_port": None})
            if memory.config.disk_bytes == 0 and not memory.config.remote_url:
                memory.close()
                raise ConfigError(
                    "kvmem-vllm needs a persistent tier the scheduler can probe: disk_bytes > 0 or a remote_url "
                    f"(got disk_bytes=0 and no remote_url in kv_connector_extra_config for {settings['path']!r})"
                )
        else:
            # NOTE: before the Memory, whose threads are made from here on
            place_background_threads(vllm_config.parallel_config.world_size)
            # NOTE: saves and loads leave the CPU tier to the chunks vLLM evicted (worker.py), unless set otherwise;
            # only the warmer's thread puts into it, so it needs no room kept free for a request's stores
            memory = Memory(**{"write_policy": "around", "offload_threshold": 1.0, **settings})
        try:
            self._open_side(vllm_config, kv_cache_config, role, memory)
        except BaseException:  # NOTE: a refused layout must not leave the Memory's threads and files open
            memory.close()
            raise
        self._memory = memory

    def _open_side(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, role: KVConnectorRole, memory: Memory
    ) -> None:
        """The scheduler's or the worker's half, on ``memory``.

        Raises:
            ConfigError: an unsupported engine layout.
        """
        transfer = self._kv_transfer_config
        block_size = vllm_config.cache_config.block_size
        codec = str(parse_codec(memory.config.compression))
        chunk_tokens = memory.config.block_size
        layout = GroupLayout((), block_size, chunk_blocks(chunk_tokens, block_size))
        try:
            layout = GroupLayout(group_windows(kv_cache_config), layout.block_size, layout.chunk_blocks)
            ns = namespace(
                vllm_config, kv_cache_config, codec, chunk_tokens, attention_backend(vllm_config, kv_cache_config)
            )
            self._idle = ""
        except UnsupportedLayout as exc:
            ns, self._idle = "vllm/idle", str(exc)
            if role == KVConnectorRole.SCHEDULER:
                logger.warning("kvmem: %s; the engine runs without reuse (nothing loaded or saved)", exc)
        if role == KVConnectorRole.SCHEDULER:
            options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config or {})
            self._scheduler = SchedulerSide(
                memory,
                ns,
                layout,
                load=transfer.is_kv_consumer and not self._idle,
                save=transfer.is_kv_producer and not self._idle,
                load_async=options.load_async,
                ranks=vllm_config.parallel_config.tensor_parallel_size,
                handoff_wait_s=options.handoff_wait_s,
            )
            if transfer.kv_load_failure_policy != "recompute":
                logger.warning(
                    "kvmem: kv_load_failure_policy=%r: a block that fails its CRC fails its request; "
                    'set kv_load_failure_policy="recompute" to recompute it instead',
                    transfer.kv_load_failure_policy,
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._worker = WorkerSide(
                memory,
                ns,
                kv_cache_config.num_blocks,
                codec,
                rank,
                whole_requests=layout.whole_requests,
                gather=any(kept is not None for kept in layout.windows),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is a future miss, never a lost hand-off."""
        return False

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvmem can load beyond ``num_computed_tokens``, and whether they are loaded asynchronously."""
        return self._sched().matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The tokens loaded for ``request``, by the tier the scheduler found them in (vLLM's metrics by source)."""
        return self._sched().hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load into the blocks just allocated."""
        self._sched().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves."""
        return self._sched().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Note the requests whose saves are done and the blocks whose load failed (recomputed by vLLM,
        saved again after)."""
        self._sched().after_step(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether the blocks wait for saves in flight (True: freed once :meth:`get_finished` reports them), and
        the ``kv_transfer_params`` that hand the prompt's KV to a decode instance (:mod:`kvmem_vllm.proxy`)."""
        return self._sched().finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished`, with the blocks of every KV cache group (vLLM's hybrid KV cache manager)."""
        return self._sched().finished(request)

    def has_pending_block_frees(self) -> bool:
        """Finished requests whose saves are in flight will free blocks: vLLM waits rather than preempting."""
        return self._sched().holds_blocks()

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's per-layer block tensors (not with the connector idle: a Mamba layer's state is no block)."""
        if not self._idle:
            self._work().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Wait for the saves of requests preempted this step, before their freed blocks are written."""
        if isinstance(kv_connector_metadata, KVMemMetadata):
            self._work().preempted(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's metadata, and start its asynchronous loads at once (vLLM starts loads after the
        forward pass of a step without synchronous ones: a step's time later)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVMemMetadata):
            self._worker.start_async(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's synchronous blocks (vLLM calls this before the forward pass when the step has any)."""
        self._work().load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: every layer was loaded in :meth:`start_load_kv`."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: a block of every layer is saved as one tensor in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        """Queue the chunks this step completed for the saver thread (not waited for)."""
        if self.has_connector_metadata():
            self._work().save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The finished requests whose saves are done (their blocks can be freed), and the requests whose
        asynchronous load is done (their failed blocks are in this step's :meth:`get_block_ids_with_load_errors`)."""
        meta = self._meta() if self.has_connector_metadata() else None
        saved, loaded = self._work().finished(meta, finished_req_ids)
        return saved or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`'s requests, and those whose asynchronous load failed (with several KV cache groups:
        vLLM recomputes them)."""
        saved, loaded = self.get_finished(finished_req_ids)
        failed = self._work().take_failed_requests()
        return KVConnectorTransferResults(set(saved or ()), set(loaded or ()), failed)

    def build_connector_worker_meta(self) -> KVMemWorkerMeta | None:
        """The chunks whose load failed this step, for the scheduler side (never probed as stored again)."""
        return self._work().worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's counts since its last report (:mod:`kvmem_vllm.stats`), for vLLM's log and /metrics."""
        if self._worker is None:
            return None
        now = self._worker.totals()
        stats = since(now, self._reported)
        self._reported = now
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Workers' counts, from what :meth:`get_kv_connector_stats` sent (vLLM aggregates and logs them)."""
        return KVMemStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """The ``vllm:kvmem_*`` metrics of the server's /metrics."""
        return KVMemPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks whose load failed this step: vLLM recomputes them."""
        return self._work().take_failed()

    def shutdown(self) -> None:
        """Finish the saves in flight, then close the memory (flushes its catalog)."""
        if self._worker is not None:
            w = self._worker
            w.close()
            logger.info(
                "kvmem: %d block(s) loaded, %d failed and recomputed, %d saved; %.3f s loading before forward "
                "passes; %d block(s) loaded asynchronously, in %.3f s beside them",
                w.loaded_blocks,
                w.failed_blocks,
                w.saved_blocks,
                w.load_seconds,
                w.async_blocks,
                w.async_load_seconds,
            )
        self._memory.close()

    # -- helpers --------------------------------------------------------------------------------
    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise ConfigError("a scheduler-side call on the worker-side KVMemConnector")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise ConfigError("a worker-side call on the scheduler-side KVMemConnector")
        return self._worker

    def _meta(self) -> KVMemMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVMemMetadata):
            raise ConfigError(f"connector metadata of type {type(meta).__name__}: expected KVMemMetadata")
        return meta
