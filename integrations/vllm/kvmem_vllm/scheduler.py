"""The scheduler side: how much of a prompt kvmem holds, and which blocks to load or save each step.

A prompt is cut into chunks of ``chunk_blocks`` vLLM blocks with prefix-chained hashes
(:func:`kvmem.keys.chunk_hashes`, folding in the engine's namespace, the request's cache salt and LoRA
adapter, and the content hash of each image or other multimodal input in place of its placeholder tokens:
:func:`kvmem_vllm.identity.keyed_tokens`); chunk ``i`` is one kvmem entry under ``h_i`` (with the rank:
one file, one catalog row, one CRC whatever vLLM's block size), its blocks the rows of one tensor, so a
request whose first blocks vLLM's own prefix cache already holds loads only the rows after them.

A probe answers from what is stored when it runs (the persistent tiers' files or server, not an index
read at start-up), chunk by chunk, and stops at the first chunk not wholly there; a block whose load
failed is never probed as present again by this engine (it is computed instead). It also notes where the
run is: a request whose run reaches blocks held only by the remote tier (Redis) is loaded asynchronously
(``load_async="remote"``, the default): it waits for its KV while others run, instead of holding up the
step that schedules it.

It also follows which chunk each vLLM block holds (of the first KV cache group): when vLLM gives a block
to other KV, the chunk it held has left vLLM's cache, and the step's metadata names it (``evicted``), so the
worker warms it into its CPU tier (``write_policy="around"`` keeps that tier for such chunks: what vLLM
evicted, not a second copy of what it holds). Only a chunk that was reused before (a hit of vLLM's prefix
cache or a load from kvmem) is named: one computed once and never asked again (a question's tail, a chat's
last turn) costs the worker no read, and takes no room from the chunks that come back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvmem import Memory
from kvmem.keys import chunk_hashes
from kvmem_vllm.groups import NULL_BLOCK, GroupLayout
from kvmem_vllm.identity import keyed_tokens, rank_key, request_scope
from kvmem_vllm.log import logger
from kvmem_vllm.metadata import ChunkTransfer, KVMemMetadata, KVMemWorkerMeta

HANDOFF = "kvmem"  # the key of kvmem's part of vLLM's kv_transfer_params
_LOCAL_TIERS = frozenset({"gpu", "cpu", "disk"})
_FAILED_KEPT = 65536  # chunks whose load failed, remembered (oldest forgotten first: tried again once)
_REUSED_KEPT = 65536  # chunks reused at least once, remembered (oldest forgotten first)
_SLOWNESS = {"gpu": 0, "cpu": 1, "disk": 2, "redis": 3}

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HANDOFF", "SchedulerSide"]


@dataclass
class _Request:
    """What the scheduler side keeps about one request.

    Attributes:
        keys: one key per full chunk of the prompt.
        stored: leading blocks known to be stored (the probe's hit, then what was saved).
        local: tokens vLLM had computed itself when the load was planned (block-aligned).
        block_ids: the request's vLLM blocks, in order, per KV cache group (a sliding-window group's outside its
            window are vLLM's null block).
        saving: a save was planned for it: once finished, its blocks are freed when the worker says its
            saves are done.
        found_in: per stored chunk, the tier the probe found it in (the slowest of its ranks' shards).
        asked: when vLLM first asked about it (``time.monotonic()``): how long it has waited for a hand-off.
        load_async: its load was reported to vLLM as asynchronous.
    """

    keys: list[str]
    stored: int
    local: int = 0
    block_ids: list[list[int]] = field(default_factory=list)
    saving: bool = False
    found_in: list[str] = field(default_factory=list)
    load_async: bool = False
    asked: float = 0.0

    @property
    def remote(self) -> bool:
        """Whether some of the stored run is held only by the remote tier (none of this machine's)."""
        return not _LOCAL_TIERS.issuperset(self.found_in)


class SchedulerSide:
    """The scheduler half of :class:`~kvmem_vllm.KVMemConnector`.

    Args:
        memory: a memory over the same persistent tiers the worker writes (it has no CPU tier of its own:
            the worker's is in another process).
        namespace: the keys' namespace (:func:`kvmem_vllm.identity.namespace`).
        layout: vLLM's block size, the blocks per kvmem chunk and what of a chunk each KV cache group keeps.
        load: whether this engine loads (``kv_both``, ``kv_consumer``).
        save: whether this engine saves (``kv_both``, ``kv_producer``).
        load_async: when loads are asynchronous: ``"remote"``, ``"always"`` or ``"never"``
            (:func:`kvmem_vllm.identity.load_async`).
        ranks: tensor-parallel ranks: a block is stored when every rank's shard is.
        handoff_wait_s: how long a request handed off by a prefill instance waits for the blocks it said it
            stored (its saves may still be on their way) before the rest is computed here.
    """

    def __init__(
        self,
        memory: Memory,
        namespace: str,
        layout: GroupLayout,
        *,
        load: bool,
        save: bool,
        load_async: str = "remote",
        ranks: int = 1,
        handoff_wait_s: float = 10.0,
    ) -> None:
        self.memory = memory
        self.namespace = namespace
        self.layout = layout
        self.block_size = layout.block_size
        self.chunk_blocks = layout.chunk_blocks
        self.load = load
        self.save = save
        self.load_async = load_async
        self.ranks = ranks
        self.handoff_wait_s = handoff_wait_s
        self._requests: dict[str, _Request] = {}
        self._loads: list[ChunkTransfer] = []
        self._async_loads: list[ChunkTransfer] = []
        self._handoff = False  # a request waited for a hand-off since the last step's metadata
        self._held: set[str] = set()  # finished requests whose blocks wait for their saves
        self._occupants: dict[int, str] = {}  # a vLLM block (first KV cache group) -> the chunk it holds
        self._evicted: dict[str, None] = {}  # chunks evicted since the last step's metadata, in order
        self._reused: OrderedDict[str, None] = OrderedDict()  # chunks a request reused (the last _REUSED_KEPT)
        # NOTE: chunks whose load failed: not probed as present again (the most recent _FAILED_KEPT of them)
        self._failed_keys: OrderedDict[str, None] = OrderedDict()
        self.failed_blocks = 0  # NOTE: blocks whose load failed (CRC or tier) and were recomputed

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` that kvmem can load (whole blocks; never the last prompt token),
        and whether they are loaded asynchronously; ``None``: not yet (a prefill instance's saves of this
        request's prompt are still on their way: asked again at the next step, for ``handoff_wait_s`` at most).

        A request not scheduled yet is probed again each time vLLM asks (it may wait while blocks are
        removed or stored); a scheduled one (back from preemption) keeps what was loaded and saved for it.
        """
        state = self._requests.get(request.request_id)
        if state is None or not state.block_ids:
            first_asked = state.asked if state is not None else time.monotonic()
            state = self._requests[request.request_id] = self._probe(request)
            state.asked = first_asked
        state.local = num_computed_tokens
        self._note_reused(state.keys[: num_computed_tokens // (self.block_size * self.chunk_blocks)])
        if not self.load:
            return 0, False
        cap = (len(request.prompt_token_ids or ()) - 1) // self.block_size
        if min(self._handed_off(request), cap) > state.stored and time.monotonic() - state.asked < self.handoff_wait_s:
            self._handoff = True
            return None, False
        loadable = min(state.stored, cap)
        tokens = max(0, loadable * self.block_size - num_computed_tokens)
        # NOTE: with several KV cache groups a failed load can only be reported for a request waiting for its KV
        state.load_async = tokens > 0 and (
            self.layout.whole_requests or self.load_async == "always" or (self.load_async == "remote" and state.remote)
        )
        return tokens, state.load_async

    def _handed_off(self, request: Request) -> int:
        """The blocks a prefill instance said it stored for this request (its ``kv_transfer_params``), when it
        ran this engine's model and layout; else 0."""
        params = (getattr(request, "kv_transfer_params", None) or {}).get(HANDOFF)
        if not isinstance(params, dict) or params.get("namespace") != self.namespace:
            return 0
        blocks = params.get("blocks")
        return blocks if isinstance(blocks, int) and not isinstance(blocks, bool) else 0

    def _probe(self, request: Request) -> _Request:
        """The request's chunk keys and how many leading blocks are stored (whole chunks)."""
        tokens = request.prompt_token_ids
        if tokens is None or not (self.load or self.save):
            return _Request([], 0)  # NOTE: prompt embeddings: KV that depends on more than token ids
        scope = request_scope(request.cache_salt, request.lora_request)
        seed = f"{self.namespace}/{scope}" if scope else self.namespace
        keys = chunk_hashes(keyed_tokens(tokens, request.mm_features), self.block_size * self.chunk_blocks, seed)
        # NOTE: a producer probes too, so it does not store again the chunks it finds stored
        tiers = self._stored_run(keys)
        return _Request(keys, len(tiers) * self.chunk_blocks, found_in=tiers)

    def _stored_run(self, keys: list[str]) -> list[str]:
        """The tier of each leading chunk of ``keys`` stored now (one lookup a chunk, of every rank's shard, up
        to the first chunk with a shard missing or whose load failed before): the slowest of its shards'."""
        tiers: list[str] = []
        for key in keys:
            if key in self._failed_keys:
                break
            found = self.memory.locate_many([rank_key(key, r) for r in range(self.ranks)], namespace=self.namespace)
            held = [tier for tier in found if tier is not None]
            if len(held) < len(found):
                break
            tiers.append(max(held, key=lambda tier: _SLOWNESS.get(tier, len(_SLOWNESS))))
        return tiers

    def hit_sources(self, request: Request, tokens: int) -> dict[CacheHitSource, int]:
        """The ``tokens`` about to be loaded for ``request``, by the tier the probe found them in (vLLM's
        prefix-cache metrics by source): the disk tier's as ``disk``, Redis's as ``external_unspecified``."""
        state = self._requests.get(request.request_id)
        if state is None or tokens == 0:
            return {}
        first = state.local // self.block_size
        sources: dict[CacheHitSource, int] = {}
        for b in range(first, first + tokens // self.block_size):
            tier = state.found_in[b // self.chunk_blocks]
            source = CacheHitSource.DISK if tier in _LOCAL_TIERS else CacheHitSource.EXTERNAL_UNSPECIFIED
            sources[source] = sources.get(source, 0) + self.block_size
        return sources

    def _transfer(self, req_id: str, state: _Request, first: int, last: int) -> ChunkTransfer:
        """Blocks ``[first, last)`` of a request, by chunk: each chunk's rows (:meth:`GroupLayout.rows`), ``None``
        for a row outside them or a null block."""
        cb = self.chunk_blocks
        chunks = range(first // cb, -(-last // cb))
        rows = [
            [state.block_ids[g][p] if first <= p < last else NULL_BLOCK for g, p in self.layout.rows(c)] for c in chunks
        ]
        blocks = [[None if b == NULL_BLOCK else b for b in chunk] for chunk in rows]
        return ChunkTransfer(req_id, [state.keys[c] for c in chunks], blocks)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into the request's newly allocated blocks."""
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return
        # NOTE: an asynchronously loaded request is scheduled (and its block ids sent) only once its KV is in:
        # a failed block is found among these
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        self._occupy(state.block_ids, state.keys, 0)  # NOTE: an asynchronous load writes them before its step
        first = state.local // self.block_size
        last = first + num_external_tokens // self.block_size
        transfer = self._transfer(request.request_id, state, first, last)
        # NOTE: a block vLLM holds for the request that no row of its chunks has (vLLM keeps more of a sliding
        # window than the rows hold) is never left unwritten: the load fails, and vLLM recomputes it
        wanted = {b for ids in state.block_ids for b in ids[first:last] if b != NULL_BLOCK}
        transfer.complete = wanted == set(transfer.block_ids)
        self._note_reused(transfer.keys)
        (self._async_loads if state.load_async else self._loads).append(transfer)

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVMemMetadata:
        """This step's loads (planned since the last step) and the saves of chunks this step completes."""
        meta = KVMemMetadata(
            loads=self._loads,
            async_loads=self._async_loads,
            preempted=set(scheduler_output.preempted_req_ids or ()),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            handoff=self._handoff,
        )
        self._loads, self._async_loads, self._handoff = [], [], False
        tokens = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            self._occupy(new.block_ids, state.keys if state is not None else [], 0)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_save(meta, new.req_id, state, new.num_computed_tokens + tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids  # NOTE: a preempted request comes back with new blocks
            if state is None:
                self._occupy(new_ids, [], 0)  # NOTE: positions unknown: no chunk of its is followed
                continue
            first = 0 if resumed or not state.block_ids else len(state.block_ids[0])
            if resumed:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                for mine, more in zip(state.block_ids, new_ids):
                    mine.extend(more)
            self._occupy(state.block_ids, state.keys, first)
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[i] + tokens[req_id])
        meta.evicted, self._evicted = list(self._evicted), {}
        return meta

    def _note_reused(self, keys: list[str]) -> None:
        """Remember ``keys`` as reused (hits of vLLM's prefix cache, or loaded): named when evicted."""
        for key in keys:
            self._reused[key] = None
            self._reused.move_to_end(key)
        while len(self._reused) > _REUSED_KEPT:
            self._reused.popitem(last=False)

    def _occupy(self, block_ids: Sequence[Sequence[int]] | None, keys: list[str], first: int) -> None:
        """Note what a request's blocks from position ``first`` on hold (of the first KV cache group): block
        ``p`` the chunk ``keys[p // chunk_blocks]`` (nothing known beyond ``keys``); a chunk another block held
        before has left vLLM's cache (evicted: named in the next metadata when it was reused before).

        NOTE: vLLM's prefix cache hands a request the very block that holds its chunk, so a reuse is no eviction.
        """
        ids = block_ids[0] if block_ids else ()
        for p in range(first, len(ids)):
            block = ids[p]
            if block == NULL_BLOCK:
                continue
            c = p // self.chunk_blocks
            key = keys[c] if c < len(keys) else None
            held = self._occupants.get(block)
            if held == key:
                continue
            if held is not None and held in self._reused:
                self._evicted[held] = None
            if key is None:
                del self._occupants[block]
            else:
                self._occupants[block] = key
                self._evicted.pop(key, None)  # NOTE: back in vLLM's cache (loaded, or computed again)

    def _plan_save(self, meta: KVMemMetadata, req_id: str, state: _Request, computed: int) -> None:
        """Save the chunks whose every token is computed once this step has run, and not stored yet."""
        if not self.save:
            return
        held = min((len(ids) for ids in state.block_ids), default=0)
        done = min(computed // self.block_size, len(state.keys) * self.chunk_blocks, held)
        done -= done % self.chunk_blocks
        if done <= state.stored:
            return
        transfer = self._transfer(req_id, state, state.stored, done)
        if any(b is None for chunk in transfer.blocks for b in chunk):
            return  # NOTE: a row's block was freed already (a window moved past it): the chunk is not stored whole
        meta.saves.append(transfer)
        state.stored = done
        state.saving = True

    def after_step(self, output: KVConnectorOutput) -> None:
        """Note the finished requests whose saves are done, the chunks whose load failed (never probed as stored
        again), and the requests they belong to: vLLM recomputes their blocks (with several KV cache groups, the
        whole request, which is probed again), so those are saved again after that."""
        self._held.difference_update(output.finished_sending or ())
        worker = output.kv_connector_worker_meta
        if isinstance(worker, KVMemWorkerMeta):
            self._failed_keys.update(dict.fromkeys(worker.failed_keys))
            while len(self._failed_keys) > _FAILED_KEPT:
                self._failed_keys.popitem(last=False)
        if output.failed_recving:
            logger.warning(
                "kvmem: the loads of %d request(s) failed (CRC or tier failure): vLLM recomputes them",
                len(output.failed_recving),
            )
        for req_id in output.failed_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.block_ids = []  # NOTE: probed again when vLLM asks again
        failed = output.invalid_block_ids
        if not failed:
            return
        self.failed_blocks += len(failed)
        logger.warning("kvmem: %d block(s) failed to load (CRC or tier failure): vLLM recomputes them", len(failed))
        for state in self._requests.values():
            bad = [
                i for i, b in enumerate(state.block_ids[0][: state.stored] if state.block_ids else ()) if b in failed
            ]
            if bad:
                state.stored = bad[0] - bad[0] % self.chunk_blocks

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget a finished request; whether its blocks must wait for its saves in flight (the worker
        reports them done in ``finished_sending``), and the hand-off for a decode instance: the blocks of its
        prompt stored or being stored (``{"kvmem": {"namespace": ..., "blocks": n}}``, vLLM's
        ``kv_transfer_params``, which a disaggregated-serving proxy passes on: :mod:`kvmem_vllm.proxy`)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        params = {HANDOFF: {"namespace": self.namespace, "blocks": state.stored}} if state.stored else None
        if not state.saving:
            return False, params
        self._held.add(request.request_id)
        return True, params

    def holds_blocks(self) -> bool:
        """Whether finished requests hold blocks until their saves are done (vLLM waits for them rather
        than preempting a running request)."""
        return bool(self._held)
