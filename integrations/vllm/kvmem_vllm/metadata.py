"""What the scheduler-side connector tells the worker-side one each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["BlockTransfer", "KVMemMetadata"]


@dataclass
class BlockTransfer:
    """Blocks of one request to load into or save from vLLM's KV cache.

    Attributes:
        req_id: the request.
        keys: one kvmem key per block (in the connector's namespace).
        block_ids: vLLM block ids, ``keys[i]`` <-> ``block_ids[i]``.
    """

    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class KVMemMetadata(KVConnectorMetadata):
    """One step's transfers: loads run before the forward pass, saves after it (on the saver's thread).

    Attributes:
        loads: blocks to load before this step's forward pass.
        async_loads: blocks to load on the worker's loader thread, for requests that wait for them (vLLM's
            ``WAITING_FOR_REMOTE_KVS``) while other requests run.
        saves: blocks this step completes, to store.
        preempted: requests preempted this step: their blocks were freed, so their saves in flight are
            waited for before the forward pass.
        idle: nothing is scheduled this step.

    NOTE: a request with a load that fails this step has its saves of this step dropped by the worker:
    the blocks computed after a failed load were computed from the wrong KV.
    """

    loads: list[BlockTransfer] = field(default_factory=list)
    async_loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    idle: bool = False
