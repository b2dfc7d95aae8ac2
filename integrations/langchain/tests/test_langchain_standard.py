"""langchain-tests' standard suites over KVMemByteStore and KVMemCache (exact and semantic) on a real Memory."""

from __future__ import annotations

import os

import pytest

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
