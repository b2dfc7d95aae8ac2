"""The public API: Memory and the module-level functions, on real files and a real SQLite catalog."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import kvmem
import kvmem.api
from kvmem.errors import IntegrityError
from kvmem.keys import is_storage_key, storage_key
from kvmem.stores import DiskTier
from tests.bounds import assert_bit_exact, error_bound

MISSING = object()
ENTRY = 16_900  # bytes of one framed 16 KiB entry


def all_dtypes() -> list[torch.dtype]:
    names = [
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex32",
        "complex64",
        "complex128",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random: every bit pattern, NaN payloads included."""
    n = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.5
    itemsize = dtype.itemsize
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).reshape(shape)


def corrupt_every_copy(mem: kvmem.Memory, key: str, *, namespace: str | None = None) -> int:
    """Flip a payload byte of every stored copy of ``key``; the number of copies."""
    skey = mem.storage_key(key, namespace)
    n = 0
    for tier in mem._tiers.tiers:
        if not tier.contains(skey):
            continue
        if isinstance(tier, DiskTier):
            data = bytearray(tier.path(skey).read_bytes())
            data[len(data) - 100] ^= 0x10
            tier.path(skey).write_bytes(bytes(data))
        else:
            buf = tier.get(skey)  # a memory tier's own buffer
            assert buf is not None
            buf[buf.numel() - 100] ^= 0x10
        n += 1
    return n


# -- store / load ---------------------------------------------------------------------------------
def test_store_returns_the_storage_key(memory: kvmem.Memory) -> None:
    skey = memory.store("visual_abc", torch.ones(4), metadata={"dim": 4})
    assert is_storage_key(skey)
    assert skey == memory.storage_key("visual_abc") == storage_key("visual_abc", None, memory.config.tenant_salt)
    assert skey == memory.info("visual_abc").key  # type: ignore[union-attr]
    assert memory.store("visual_abc", torch.ones(4), namespace="m") != skey


@pytest.mark.parametrize("shape", [(3, 5, 7), (), (0, 4)], ids=["3d", "0d", "empty"])
@pytest.mark.parametrize("dtype", all_dtypes(), ids=lambda d: str(d).removeprefix("torch."))
def test_tensor_of_every_dtype_bit_exact(memory: kvmem.Memory, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    value = random_bits(dtype, shape)
    memory.store("t", value)
    back = memory.load("t")
    assert_bit_exact(value, back)
    assert memory.info("t").kind == "tensor"  # type: ignore[union-attr]


def test_non_contiguous_and_grad_tensors(memory: kvmem.Memory) -> None:
    base = torch.randn(16, 32)
    views = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "expanded": torch.randn(1, 8).expand(5, 8),
        "offset": base[4:, 10:12],
    }
    for name, v in views.items():
        memory.store(name, v)
        back = memory.load(name)
        assert torch.equal(back, v) and back.shape == v.shape and back.is_contiguous()
    w = torch.randn(4, 4, requires_grad=True)
    memory.store("grad", w * 2)
    back = memory.load("grad")
    assert torch.equal(back, (w * 2).detach()) and not back.requires_grad


def test_nested_tree_of_tensors(memory: kvmem.Memory, kv_value: dict[str, torch.Tensor]) -> None:
    layers = [(kv_value["k"][i], kv_value["v"][i]) for i in range(2)]
    value = {
        "layers": layers,
        "pos": torch.arange(32),
        "extra": [torch.tensor(1.5), {"mask": torch.ones(3) > 0}],
        "config": {"model": "llama", "n": 2, "scale": 0.5, "ok": True, "none": None},
    }
    memory.store("kv", value)
    back = memory.load("kv")
    assert isinstance(back["layers"], list) and all(isinstance(p, tuple) and len(p) == 2 for p in back["layers"])
    for (k, v), (bk, bv) in zip(layers, back["layers"]):
        assert_bit_exact(k, bk)
        assert_bit_exact(v, bv)
    assert_bit_exact(value["pos"], back["pos"])
    assert_bit_exact(value["extra"][0], back["extra"][0])
    assert_bit_exact(value["extra"][1]["mask"], back["extra"][1]["mask"])
    assert back["config"] == value["config"]
    assert list(back) == list(value), "dict order is kept"
    assert memory.info("kv").kind == "tree"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.array(7, dtype=np.int64),
        np.zeros((0, 3), np.float16),
        np.arange(20, dtype=np.int32)[::3],
        np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        np.arange(6, dtype=">i4"),
        np.array([True, False]),
        np.array([1 + 2j, -3j], dtype=np.complex128),
        np.frombuffer(np.random.default_rng(0).bytes(64), dtype=np.float64),  # NaN payloads and all
        np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
        np.arange(5, dtype=np.uint64),
    ],
    ids=["f32-3d", "0d", "empty", "strided", "fortran", "big-endian", "bool", "complex", "raw-bits", "datetime", "u64"],
)
def test_numpy_arrays(memory: kvmem.Memory, arr: np.ndarray) -> None:
    memory.store("a", arr)
    back = memory.load("a")
    assert isinstance(back, np.ndarray)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert back.tobytes() == arr.tobytes()
    assert memory.info("a").kind == "ndarray"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value, kind",
    [
        (b"", "bytes"),
        (b"\x00\xff" * 1000, "bytes"),
        ("", "str"),
        ("héllo wörld 🔑", "str"),
        ("\ud800 lone", "str"),
        ({"a": 1, "b": [1, 2.5, None, True, "s"], "c": {"d": {}}}, "tree"),
        ([1, "two", 3.0], "tree"),
        (42, "tree"),
        (2**70, "tree"),
        (None, "tree"),
        (False, "tree"),
        ((1, (2, 3)), "tree"),
    ],
)
def test_bytes_str_and_json(memory: kvmem.Memory, value: object, kind: str) -> None:
    memory.store("v", value)
    back = memory.load("v", MISSING)
    assert back == value and type(back) is type(value)
    assert memory.info("v").kind == kind  # type: ignore[union-attr]


def test_bytearray_and_memoryview_come_back_as_bytes(memory: kvmem.Memory) -> None:
    memory.store("ba", bytearray(b"abc"))
    memory.store("mv", memoryview(b"xyz"))
    assert memory.load("ba") == b"abc" and memory.load("mv") == b"xyz"


def test_bytes_keys(memory: kvmem.Memory) -> None:
    memory.store(b"\x00\xff raw key", torch.arange(3))
    assert torch.equal(memory.load(b"\x00\xff raw key"), torch.arange(3))
    memory.store("same", 1)
    assert memory.load(b"same") == 1, "a str key and its UTF-8 bytes are the same key"


def test_device_placement(memory: kvmem.Memory, kv_value: dict[str, torch.Tensor]) -> None:
    memory.store("kv", {"kv": kv_value, "list": [torch.ones(2)], "n": 3})
    on_cpu = memory.load("kv", device="cpu")
    assert on_cpu["kv"]["k"].device.type == "cpu" and torch.equal(on_cpu["kv"]["k"], kv_value["k"])
    on_meta = memory.load("kv", device=torch.device("meta"))
    assert on_meta["kv"]["k"].device.type == "meta" and on_meta["list"][0].device.type == "meta"
    assert on_meta["kv"]["v"].shape == kv_value["v"].shape and on_meta["n"] == 3


def test_loaded_values_are_owned_by_the_caller(memory: kvmem.Memory) -> None:
    src = torch.arange(10.0)
    memory.store("x", src)
    src.add_(100)  # the caller changes its tensor after storing
    first = memory.load("x")
    assert torch.equal(first, torch.arange(10.0))
    first.mul_(-1)  # and changes what it loaded
    assert torch.equal(memory.load("x"), torch.arange(10.0))


# -- misses, defaults, regenerate, integrity ---------------------------------------------------------------
def test_default_and_miss(memory: kvmem.Memory) -> None:
    assert memory.load("nothing") is None
    assert memory.load("nothing", default=MISSING) is MISSING
    assert memory.load("nothing", 5) == 5


def test_regenerate_on_miss(memory: kvmem.Memory) -> None:
    calls: list[int] = []

    def rebuild() -> torch.Tensor:
        calls.append(1)
        return torch.full((3,), 7.0)

    got = memory.load("lazy", regenerate=rebuild, namespace="m")
    assert torch.equal(got, torch.full((3,), 7.0)) and calls == [1]
    assert memory.contains("lazy", namespace="m") and not memory.contains("lazy")
    assert torch.equal(memory.load("lazy", regenerate=rebuild, namespace="m"), torch.full((3,), 7.0))
    assert calls == [1], "a hit does not regenerate"
    assert memory.info("lazy", namespace="m").version == 1  # type: ignore[union-attr]


def test_regenerate_on_corruption(tmp_path: Path) -> None:
    memory = kvmem.Memory(str(tmp_path / "m"), cpu_bytes="8MiB", disk_bytes="8MiB", fsync="never", cpu_verify=True)
    memory.store("x", torch.arange(100.0))
    assert corrupt_every_copy(memory, "x") == 2
    got = memory.load("x", regenerate=lambda: torch.arange(100.0) * 2)
    assert torch.equal(got, torch.arange(100.0) * 2)
    assert torch.equal(memory.load("x"), torch.arange(100.0) * 2)
    assert memory.stats().crc_failures == 2
    memory.close()


def test_corruption_is_a_miss_or_raises_when_strict(tmp_path: Path) -> None:
    with kvmem.Memory(
        str(tmp_path / "m"), cpu_bytes="8MiB", disk_bytes="8MiB", fsync="never", strict=True, cpu_verify=True
    ) as mem:
        mem.store("x", torch.arange(100.0))
        corrupt_every_copy(mem, "x")
        with pytest.raises(IntegrityError, match="integrity check"):
            mem.load("x")
        mem.store("y", torch.arange(100.0))
        corrupt_every_copy(mem, "y")
        assert mem.load("y", MISSING, strict=False) is MISSING
    with kvmem.Memory(str(tmp_path / "n"), cpu_bytes="8MiB", disk_bytes="8MiB", fsync="never", cpu_verify=True) as mem:
        mem.store("x", torch.arange(100.0))
        corrupt_every_copy(mem, "x")
        with pytest.raises(IntegrityError):
            mem.load("x", strict=True)
        assert mem.metrics.total("kvmem_crc_failures_total") == 2


# -- compress / decompress -----------------------------------------------------------------------------------
def test_compress_round_trip_int8_lz4(memory: kvmem.Memory, kv_value: dict[str, torch.Tensor]) -> None:
    blob = memory.compress(kv_value, codec="int8+lz4")
    assert isinstance(blob, bytes)
    assert len(blob) < sum(t.numel() * t.element_size() for t in kv_value.values()) / 3
    back = kvmem.Memory.decompress(blob)
    for name, axis in (("k", -2), ("v", -1)):
        err = (back[name].double() - kv_value[name].double()).abs()
        assert bool((err <= error_bound(kv_value[name], "int8", axis)).all())
        print(f"int8+lz4 {name}: max {float(err.max()):.4g} mean {float(err.mean()):.4g}")
    assert memory.compress(kv_value, codec="int8+lz4") == blob, "compression is deterministic"


def test_compress_lossless_and_default_codec(memory: kvmem.Memory, kv_value: dict[str, torch.Tensor]) -> None:
    back = memory.decompress(memory.compress(kv_value, codec="lz4"))
    assert_bit_exact(kv_value["k"], back["k"])
    default = memory.compress(kv_value)  # config.compression: fp16
    assert len(default) < len(memory.compress(kv_value, codec="none")) * 0.55
    assert torch.allclose(memory.decompress(default)["v"], kv_value["v"], atol=1e-2)


def test_corrupted_compressed_blob_raises(memory: kvmem.Memory, kv_value: dict[str, torch.Tensor]) -> None:
    blob = memory.compress(kv_value, codec="int8+lz4")
    for pos in (0, 9, 20, len(blob) // 2, len(blob) - 5, len(blob) - 1):
        bad = bytearray(blob)
        bad[pos] ^= 0x04
        with pytest.raises(IntegrityError):
            kvmem.Memory.decompress(bytes(bad))
    for bad_blob in (blob[:-1], blob[:100], b"", b"not a blob at all", blob + b"\0"):
        with pytest.raises(IntegrityError):
            kvmem.Memory.decompress(bad_blob)
    assert kvmem.Memory.decompress(memoryview(bytearray(blob)))["k"].shape == kv_value["k"].shape


# -- contains / delete / info / stats ---------------------------------------------------------------------------
def test_contains_and_delete(memory: kvmem.Memory) -> None:
    assert not memory.contains("k")
    memory.store("k", b"v")
    assert memory.contains("k")
    assert memory.delete("k") is True
    assert not memory.contains("k") and memory.load("k", MISSING) is MISSING and memory.info("k") is None
    assert memory.delete("k") is False


def test_locate_many_names_the_fastest_tier_holding_each_key(tmp_path: Path) -> None:
    with kvmem.Memory(tmp_path / "kv", cpu_bytes="8MiB") as mem:
        mem.store("a", b"v", namespace="n")
        assert mem.locate_many(["a", "b"], namespace="n") == ["cpu", None]
        assert mem.locate_many(["a"]) == [None]  # another namespace
    with kvmem.Memory(tmp_path / "kv", cpu_bytes=0) as disk_only:
        assert disk_only.locate_many(["b", "a"], namespace="n") == [None, "disk"]
        assert disk_only.contains_many(["b", "a"], namespace="n") == [False, True]


def test_info(memory: kvmem.Memory) -> None:
    value = torch.zeros(256, dtype=torch.float16)
    memory.store("img", value, metadata={"dim": 512, "tags": ["a", "b"], "nested": {"x": None}}, namespace="clip")
    info = memory.info("img", namespace="clip")
    assert info is not None
    assert info.metadata == {"dim": 512, "tags": ["a", "b"], "nested": {"x": None}}
    assert (info.namespace, info.kind, info.size, info.codec, info.version) == ("clip", "tensor", 512, "none", 1)
    assert info.stored_size > info.size
    assert set(info.tiers) == {"cpu", "disk"}
    assert info.created <= info.last_access
    assert memory.info("img") is None
    memory.load("img", namespace="clip")
    memory.load("img", namespace="clip")
    assert memory.info("img", namespace="clip").hits == 2  # type: ignore[union-attr]


def test_stats_count_hits_and_misses(memory: kvmem.Memory) -> None:
    for i in range(3):
        memory.store(f"k{i}", torch.full((100,), float(i)))
    for i in range(3):
        memory.load(f"k{i}")
    memory.load("absent")
    memory.load("absent2")
    s = memory.stats()
    assert (s.entries, s.hits, s.misses) == (3, 3, 2)
    assert s.hit_rate == pytest.approx(0.6)
    assert s.size == 3 * 400 and s.stored_size > s.size
    assert s.crc_failures == 0 and s.tier_errors == 0
    assert [t.name for t in s.tiers] == ["cpu", "disk"] and [t.entries for t in s.tiers] == [3, 3]
    assert memory.metrics.value("kvmem_hit_rate") == pytest.approx(0.6)


# -- namespaces and tenants -----------------------------------------------------------------------------------
def test_namespaces_never_collide(memory: kvmem.Memory) -> None:
    k1 = memory.store("same", torch.ones(3), namespace="model-a")
    k2 = memory.store("same", torch.zeros(3), namespace="model-b")
    assert k1 != k2
    assert torch.equal(memory.load("same", namespace="model-a"), torch.ones(3))
    assert torch.equal(memory.load("same", namespace="model-b"), torch.zeros(3))
    assert memory.load("same", MISSING) is MISSING
    assert memory.delete("same", namespace="model-a")
    assert not memory.contains("same", namespace="model-a")
    assert torch.equal(memory.load("same", namespace="model-b"), torch.zeros(3))
    assert memory.info("same", namespace="model-b").namespace == "model-b"  # type: ignore[union-attr]


def test_tenant_salt_separates(tmp_path: Path) -> None:
    path = str(tmp_path / "shared")
    with (
        kvmem.Memory(path, cpu_bytes="4MiB", disk_bytes="16MiB", fsync="never", tenant_salt="acme") as acme,
        kvmem.Memory(path, cpu_bytes="4MiB", disk_bytes="16MiB", fsync="never", tenant_salt="globex") as globex,
    ):
        acme.store("secret", b"acme data")
        assert acme.storage_key("secret") != globex.storage_key("secret")
        assert not globex.contains("secret")
        assert globex.load("secret", MISSING) is MISSING
        globex.store("secret", b"globex data")
        assert acme.load("secret") == b"acme data"
    with kvmem.Memory(path, cpu_bytes="4MiB", disk_bytes="16MiB", fsync="never", tenant_salt="acme") as again:
        assert again.load("secret") == b"acme data"


# -- offload -------------------------------------------------------------------------------------------------
def test_small_cpu_tier_demotes_to_disk_and_promotes_on_hit(tmp_path: Path) -> None:
    with kvmem.Memory(str(tmp_path / "m"), cpu_bytes=4 * ENTRY, disk_bytes="8MiB", fsync="never") as mem:
        cpu, disk = mem._tiers.tiers
        for i in range(6):
            mem.store(f"e{i}", torch.full((4096,), float(i)))
            assert cpu.usage() <= 0.7 * cpu.capacity
        s = mem.stats()
        assert s.demotions >= 4 and s.evictions == 0
        assert mem.info("e0").tiers == ["disk"]  # type: ignore[union-attr]
        assert torch.equal(mem.load("e0"), torch.full((4096,), 0.0))
        assert mem.metrics.value("kvmem_hits_total", tier="disk", kind="tensor") == 1
        assert mem.metrics.value("kvmem_promotions_total", tier="cpu") == 1
        assert mem.info("e0").tiers == ["cpu", "disk"]  # type: ignore[union-attr]
        assert torch.equal(mem.load("e0"), torch.full((4096,), 0.0))
        assert mem.metrics.value("kvmem_hits_total", tier="cpu", kind="tensor") == 1
        for i in range(6):
            assert torch.equal(mem.load(f"e{i}"), torch.full((4096,), float(i)))
        assert mem.stats().entries == 6


def test_write_back_reaches_disk(tmp_path: Path) -> None:
    with kvmem.Memory(
        str(tmp_path / "m"), cpu_bytes="8MiB", disk_bytes="8MiB", fsync="never", write_policy="back"
    ) as mem:
        for i in range(10):
            mem.store(f"k{i}", torch.full((256,), float(i)))
    with kvmem.Memory(str(tmp_path / "m"), cpu_bytes="8MiB", disk_bytes="8MiB", fsync="never") as mem:
        for i in range(10):
            assert torch.equal(mem.load(f"k{i}"), torch.full((256,), float(i)))


# -- versions ---------------------------------------------------------------------------------------------------
def test_versions_copy_on_write(memory: kvmem.Memory) -> None:
    memory.store("w", torch.full((1000,), 1.0))
    t1 = memory.load("w")
    memory.store("w", torch.full((1000,), 2.0))
    assert torch.equal(t1, torch.full((1000,), 1.0)), "a reader that holds version 1 keeps it"
    assert torch.equal(memory.load("w"), torch.full((1000,), 2.0))
    assert memory.info("w").version == 2  # type: ignore[union-attr]
    assert memory.stats().entries == 1


def test_versions_from_disk_tier(tmp_path: Path) -> None:
    with kvmem.Memory(str(tmp_path / "m"), cpu_bytes=0, disk_bytes="8MiB", fsync="never") as mem:
        mem.store("w", {"a": torch.full((1000,), 1.0)})
        t1 = mem.load("w")
        mem.store("w", {"a": torch.full((1000,), 2.0)})
        assert torch.equal(t1["a"], torch.full((1000,), 1.0))
        assert torch.equal(mem.load("w")["a"], torch.full((1000,), 2.0))
        assert mem.info("w").version == 2  # type: ignore[union-attr]


# -- lifecycle ----------------------------------------------------------------------------------------------------
def test_memory_is_a_context_manager(tmp_path: Path) -> None:
    with kvmem.Memory(str(tmp_path / "m"), cpu_bytes="1MiB", disk_bytes="4MiB") as mem:
        assert isinstance(mem, kvmem.Memory)
        mem.store("k", torch.arange(5))
    mem.close()  # idempotent
    with kvmem.Memory(str(tmp_path / "m"), cpu_bytes="1MiB", disk_bytes="4MiB") as mem:
        assert torch.equal(mem.load("k"), torch.arange(5))
        assert mem.info("k").version == 1  # type: ignore[union-attr]


def test_entries_listing(memory: kvmem.Memory) -> None:
    memory.store("a", 1, namespace="x")
    memory.store("b", 2, namespace="y")
    memory.load("a", namespace="x")
    assert {e.namespace for e in memory.entries()} == {"x", "y"}
    assert [e.key for e in memory.entries(namespace="y")] == [memory.storage_key("b", "y")]
    assert len(list(memory.entries(limit=1))) == 1


# -- module-level API ---------------------------------------------------------------------------------------------
@pytest.fixture
def default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[kvmem.Memory]:
    """A module default Memory under ``tmp_path``; the previous default comes back afterwards."""
    monkeypatch.setattr(kvmem.api, "_default", None)
    mem = kvmem.configure(path=str(tmp_path / "default"), cpu_bytes="8MiB", disk_bytes="32MiB", fsync="never")
    yield mem
    current = kvmem.api._default
    if current is not None:
        current.close()
    mem.close()


def test_configure_replaces_the_default(default: kvmem.Memory, tmp_path: Path) -> None:
    assert kvmem.default_memory() is default
    assert default.config.path == str(tmp_path / "default")
    k = kvmem.store("visual_" + "ab12", torch.ones(4), metadata={"dim": 4})
    assert is_storage_key(k) and k == default.storage_key("visual_ab12")
    assert torch.equal(kvmem.load("visual_ab12"), torch.ones(4))
    assert default.info("visual_ab12").metadata == {"dim": 4}  # type: ignore[union-attr]
    second = kvmem.configure(path=str(tmp_path / "second"), cpu_bytes="1MiB", disk_bytes="4MiB", fsync="never")
    assert kvmem.default_memory() is second and second is not default
    assert kvmem.load("visual_ab12", MISSING) is MISSING, "the new default has its own data"
    with kvmem.Memory(str(tmp_path / "default"), cpu_bytes="1MiB", disk_bytes="4MiB") as first_again:
        assert torch.equal(first_again.load("visual_ab12"), torch.ones(4)), "the replaced default was flushed"


def test_module_functions(default: kvmem.Memory, kv_value: dict[str, torch.Tensor]) -> None:
    assert not kvmem.contains("x")
    kvmem.store("x", kv_value, namespace="ns")
    assert kvmem.contains("x", namespace="ns") and not kvmem.contains("x")
    back = kvmem.load("x", namespace="ns", device="cpu")
    assert_bit_exact(kv_value["k"], back["k"])
    assert kvmem.load("missing", default=MISSING) is MISSING
    assert kvmem.load("lazy", regenerate=lambda: "built") == "built" and kvmem.contains("lazy")
    assert kvmem.delete("x", namespace="ns") and not kvmem.contains("x", namespace="ns")
    blob = kvmem.compress(kv_value, codec="int8+lz4")
    assert kvmem.decompress(blob)["v"].shape == kv_value["v"].shape
    assert kvmem.content_hash([1, 2, 3], "model-x") == kvmem.content_hash(np.array([1, 2, 3]), "model-x")
    assert len(kvmem.chunk_hashes(list(range(600)), default.config.block_size, "m")) == 2
    assert default.stats().hits >= 1
