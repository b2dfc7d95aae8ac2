"""KVMemByteStore over a real Memory on disk: keys of any length, namespaces, other processes, the event loop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvmem
from langchain_kvmem.bytestore import KVMemByteStore

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # integrations/langchain: what `import langchain_kvmem` needs


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[kvmem.Memory]:
    with kvmem.Memory(str(tmp_path / "kvmem"), cpu_bytes="64MiB", disk_bytes="256MiB", fsync="never") as mem:
        yield mem


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter that imports langchain_kvmem from source; its stdout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_values_round_trip_exactly(memory: kvmem.Memory) -> None:
    store = KVMemByteStore(memory)
    values = [b"", b"\x00\xff" * 1000, bytes(range(256))]
    store.mset([("empty", values[0]), ("binary", values[1]), ("all", values[2])])
    assert store.mget(["empty", "binary", "all", "missing"]) == [*values, None]
    assert all(type(v) is bytes for v in store.mget(["empty", "binary"]))


def test_bytes_like_values_are_accepted_and_others_rejected_before_any_write(memory: kvmem.Memory) -> None:
    store = KVMemByteStore(memory)
    store.mset([("ba", bytearray(b"xy")), ("mv", memoryview(b"zw"))])
    assert store.mget(["ba", "mv"]) == [b"xy", b"zw"]
    with pytest.raises(TypeError, match="values are bytes"):
        store.mset([("ok", b"1"), ("text", "not bytes")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="keys are str"):
        store.mset([(b"raw", b"1")])  # type: ignore[list-item]
    assert store.mget(["ok"]) == [None]


def test_long_and_odd_keys_are_listed_whole(memory: kvmem.Memory) -> None:
    store = KVMemByteStore(memory)
    long_a, long_b = "doc/" + "a" * 1000, "doc/" + "a" * 999 + "b"  # equal in the catalog's 256-char preview
    odd = "emb/\u00e9\u4e2d\U0001f600 \n\t\\\"'"
    store.mset([(long_a, b"A"), (long_b, b"B"), (odd, b"O"), ("other", b"X")])
    assert store.mget([long_a, long_b, odd]) == [b"A", b"B", b"O"]
    assert sorted(store.yield_keys()) == sorted([long_a, long_b, odd, "other"])
    assert sorted(store.yield_keys(prefix="doc/" + "a" * 999)) == sorted([long_a, long_b])
    assert list(store.yield_keys(prefix="emb/\u00e9")) == [odd]
    assert list(store.yield_keys(prefix="nothing")) == []


def test_overwrite_and_delete_keep_the_listing_exact(memory: kvmem.Memory) -> None:
    store = KVMemByteStore(memory)
    store.mset([("k", b"1"), ("k", b"2"), ("j", b"3")])
    assert store.mget(["k"]) == [b"2"]
    assert sorted(store.yield_keys()) == ["j", "k"]
    store.mdelete(["k", "never-stored"])
    assert list(store.yield_keys()) == ["j"]
    assert not memory.contains("k", namespace=store.namespace)


def test_namespaces_are_isolated(memory: kvmem.Memory) -> None:
    one, two = KVMemByteStore(memory, namespace="a"), KVMemByteStore(memory, namespace="b")
    one.mset([("k", b"from a")])
    two.mset([("k", b"from b")])
    memory.store("k", b"not the store's", namespace="a-foreign")
    assert one.mget(["k"]) == [b"from a"] and two.mget(["k"]) == [b"from b"]
    two.mdelete(["k"])
    assert one.mget(["k"]) == [b"from a"] and list(two.yield_keys()) == []


def test_entries_written_without_the_store_are_not_listed(memory: kvmem.Memory) -> None:
    store = KVMemByteStore(memory)
    memory.store("direct", b"x", namespace=store.namespace)
    store.mset([("mine", b"y")])
    assert list(store.yield_keys()) == ["mine"]


def test_another_process_sees_the_values_and_keys(memory: kvmem.Memory, tmp_path: Path) -> None:
    store = KVMemByteStore(memory, namespace="shared")
    long_key = "k" * 600
    store.mset([("short", b"\x01\x02"), (long_key, b"long")])
    memory.flush()
    out = run_python(
        "import kvmem\n"
        "from langchain_kvmem.bytestore import KVMemByteStore\n"
        f"with kvmem.Memory({str(tmp_path / 'kvmem')!r}) as mem:\n"
        "    store = KVMemByteStore(mem, namespace='shared')\n"
        f"    print(store.mget(['short', {long_key!r}, 'missing']))\n"
        "    print(sorted(len(k) for k in store.yield_keys()))\n"
        "    store.mset([('from-child', b'hi')])\n"
    )
    assert out.splitlines() == ["[b'\\x01\\x02', b'long', None]", "[5, 600]"]
    assert store.mget(["from-child"]) == [b"hi"]


def test_values_survive_reopening(tmp_path: Path) -> None:
    path = str(tmp_path / "kvmem")
    with kvmem.Memory(path, fsync="never") as mem:
        KVMemByteStore(mem).mset([("k", b"kept")])
    with kvmem.Memory(path, fsync="never") as mem:
        store = KVMemByteStore(mem)
        assert store.mget(["k"]) == [b"kept"] and list(store.yield_keys()) == ["k"]


def test_a_damaged_value_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    with kvmem.Memory(str(path), fsync="never") as mem:
        KVMemByteStore(mem).mset([("k", b"payload" * 100)])
        skey = mem.storage_key("k", namespace="langchain/bytes")
    # the disk tier's file layout, as in tests/test_corruption.py
    blob = path / "disk" / "blobs" / skey[:2] / f"{skey}.kvb"
    data = bytearray(blob.read_bytes())
    data[-20] ^= 0xFF
    blob.write_bytes(bytes(data))
    with kvmem.Memory(str(path), fsync="never") as mem:
        assert KVMemByteStore(mem).mget(["k"]) == [None]


def test_async_methods_run_off_the_event_loop_thread(memory: kvmem.Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    store = KVMemByteStore(memory)
    threads: list[int] = []
    fetch = memory.fetch

    def recording_fetch(*args: object, **kwargs: object) -> object:
        threads.append(threading.get_ident())
        return fetch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(memory, "fetch", recording_fetch)

    async def main() -> tuple[list[bytes | None], list[str]]:
        await store.amset([("a", b"1")])
        return await store.amget(["a"]), [k async for k in store.ayield_keys()]

    assert asyncio.run(main()) == ([b"1"], ["a"])
    assert threads and threading.get_ident() not in threads
