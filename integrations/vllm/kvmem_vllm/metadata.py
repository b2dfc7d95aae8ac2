"""What the scheduler-side connector tells the worker-side one each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = ["ChunkTransfer", "KVMemMetadata", "KVMemWorkerMeta"]


@dataclass
class ChunkTransfer:
    """Chunks of one request to load into or save from vLLM's KV cache: a chunk is one kvmem entry holding
    its vLLM blocks (of every layer) as the rows of one tensor (:meth:`kvmem_vllm.groups.GroupLayout.rows`:
    with several KV cache groups, each group's blocks in turn).

    Attributes:
        req_id: the request.
        keys: one kvmem key per chunk (in the connector's namespace; each rank adds its own, see
            :func:`kvmem_vllm.identity.rank_key`).
        blocks: per chunk, the vLLM block id of each of its rows, in order; ``None`` for a block not to
            load (vLLM's own prefix cache holds it, it holds the prompt's last token, or it is outside a
            sliding window). A save has them all.
        complete: the rows hold every block vLLM allocated for the loaded tokens (else the load fails).
    """

    req_id: str
    keys: list[str]
    blocks: list[list[int | None]]
    complete: bool = True

    @property
    def block_ids(self) -> list[int]:
        """The vLLM blocks transferred (every one not ``None``)."""
        return [b for chunk in self.blocks for b in chunk if b is not None]


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
        handoff: a request waits for a prefill instance's KV (its saves on their way): an idle step then waits a
            little on the worker, so the engine's loop leaves the cores to the instance that is saving.
        evicted: chunks vLLM evicted this step (a block of theirs was given to other KV): the worker warms them
            into its CPU tier in the background, which so holds what vLLM's KV cache does not.

    NOTE: a request with a load that fails this step has its saves of this step dropped by the worker:
    the blocks computed after a failed load were computed from the wrong KV.
    """

    loads: list[ChunkTransfer] = field(default_factory=list)
    async_loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    idle: bool = False
    handoff: bool = False
    evicted: list[str] = field(default_factory=list)


@dataclass
class KVMemWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler side after a step: the chunks whose load failed (their keys
    without a rank), never probed as stored again by this engine.
    """

    failed_keys: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVMemWorkerMeta:
        """Every rank's failed chunks."""
        theirs = other.failed_keys if isinstance(other, KVMemWorkerMeta) else set()
        return KVMemWorkerMeta(self.failed_keys | theirs)
