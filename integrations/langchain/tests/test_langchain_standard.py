"""The standard suites on a real Memory: langchain-tests' over KVMemByteStore and KVMemCache (exact and semantic),
langgraph-checkpoint-conformance's over KVMemSaver (sync and async, SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata, CheckpointTuple
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import Capability

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_tests.integration_tests import (
    AsyncCacheTestSuite,
    BaseStoreAsyncTests,
    BaseStoreSyncTests,
    SyncCacheTestSuite,
)

import kvmem
from langchain_kvmem.bytestore import KVMemByteStore
from langchain_kvmem.cache import KVMemCache
from langchain_kvmem.saver import KVMemSaver

# pytest-asyncio runs in strict mode here, so the async suites are marked as a whole; the mark also
# lands on their one sync test (test_no_overrides_DO_NOT_OVERRIDE), which pytest-asyncio warns about.
ASYNC_SUITE = [
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:The test <Function test_no_overrides_DO_NOT_OVERRIDE>"),
]


class ByteStoreFixtures:
    """The fixtures both ByteStore suites ask for."""

    @pytest.fixture
    def kv_store(self, memory: kvmem.Memory) -> KVMemByteStore:
        return KVMemByteStore(memory)

    @pytest.fixture
    def three_values(self) -> tuple[bytes, bytes, bytes]:
        return b"foo", b"\x00bar\xff", b""


class TestKVMemByteStoreSync(ByteStoreFixtures, BaseStoreSyncTests[bytes]):
    pass


class TestKVMemByteStoreAsync(ByteStoreFixtures, BaseStoreAsyncTests[bytes]):
    pytestmark = ASYNC_SUITE


class TestKVMemCacheSync(SyncCacheTestSuite):
    @pytest.fixture
    def cache(self, memory: kvmem.Memory) -> KVMemCache:
        return KVMemCache(memory)


class TestKVMemCacheAsync(AsyncCacheTestSuite):
    pytestmark = ASYNC_SUITE

    @pytest.fixture
    def cache(self, memory: kvmem.Memory) -> KVMemCache:
        return KVMemCache(memory)


class TestKVMemSemanticCacheSync(SyncCacheTestSuite):
    @pytest.fixture
    def cache(self, semantic_memory: kvmem.Memory) -> KVMemCache:
        return KVMemCache(semantic_memory, semantic=True)


class TestKVMemSemanticCacheAsync(AsyncCacheTestSuite):
    pytestmark = ASYNC_SUITE

    @pytest.fixture
    def cache(self, semantic_memory: kvmem.Memory) -> KVMemCache:
        return KVMemCache(semantic_memory, semantic=True)


class SyncDrivenSaver(KVMemSaver):
    """KVMemSaver whose async methods call its sync ones in the loop's thread: the conformance suite, which
    drives the async API only, then tests the sync one (KVMemSaver's own async methods run them in a worker)."""

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self.get_tuple(config)

    async def alist(self, config: RunnableConfig | None, **kwargs: Any) -> AsyncIterator[CheckpointTuple]:
        for item in self.list(config, **kwargs):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return self.put(config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        self.put_writes(config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        self.delete_thread(thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        self.delete_for_runs(run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.copy_thread(source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self.prune(thread_ids, strategy=strategy)


@pytest.mark.parametrize("capability", [c.value for c in Capability])
@pytest.mark.parametrize("saver_class", [KVMemSaver, SyncDrivenSaver], ids=["async", "sync"])
def test_langgraph_checkpoint_conformance(
    saver_class: type[KVMemSaver], capability: str, tmp_path: Path, catalog: dict[str, str]
) -> None:
    """Every capability of the suite (base and extended) is detected, and each of its tests passes: none skipped."""

    @checkpointer_test(name=f"{saver_class.__name__}-{capability}")
    async def fresh_saver() -> AsyncIterator[KVMemSaver]:
        with kvmem.Memory(str(tmp_path / uuid.uuid4().hex), fsync="never", **catalog) as mem:
            yield saver_class(mem)

    result = asyncio.run(validate(fresh_saver, capabilities={capability})).results[capability]
    assert result.detected and result.passed, result.failures
    assert result.tests_failed == result.tests_skipped == 0 and result.tests_passed > 0
