"""Keys to the byte: pinned digests, the documented construction rebuilt with hashlib, determinism."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvmem.errors import InvalidKeyError
from kvmem.keys import chunk_hashes, content_hash, is_storage_key, namespace_id, storage_key

# Digests computed once with kvmem 0.1.0 and frozen: a change here breaks every existing cache.
PINNED = {
    "content_str": "1e2d904943d350fcb670323757db7fa5027e1ed6f42faa3ae22569ab4012e826",
    "content_tokens": "13fb60338d6da4d8a1e51397ef2d1b92d313fc79da1eefe836794351de02c9b7",
    "content_bytes": "89e06c216151b70b5d7e3e8d6dc80a72ded760369bae4aa77199652bb196861b",
    "namespace_salted": "37e9d277fcaa9541db22422962c4d24782db2ba58d36f832fe8d2b27902d4028",
    "namespace_none": "9c8eb406f107b985a20adf5bd878995239aeb56d99ae0dbf8f09f9fa7763cf52",
    "storage_plain": "bb5291472b8b180fd6cfa3530d48f322b755b9cf44698780d9a344db1de662b0",
    "storage_salted": "2ea5c2c9725249e40dcf086b602a9050d667b43c188cfb81e011d18904449e28",
    "chunks": [
        "57728756ce8675ab7ea1efd5471fa9c2de5bf7e78f67489088afe5259b4ca23f",
        "795df6cf1810b71039d0d7b22e363f1924c3c473f272957898a3fb2018a36ec1",
    ],
}


# -- the documented construction, written out independently ------------------------------
def ref_digest(domain: bytes, *parts: bytes) -> str:
    """sha256(domain ‖ for each part: u64 little-endian length ‖ part)."""
    h = hashlib.sha256(domain)
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()


def ref_tokens(ids: list[int]) -> bytes:
    return b"".join(i.to_bytes(8, "little", signed=True) for i in ids)


def ref_content(data: str | bytes | list[int], *ns: str) -> str:
    if isinstance(data, str):
        payload = b"b" + data.encode()
    elif isinstance(data, bytes):
        payload = b"b" + data
    else:
        payload = b"t" + ref_tokens(data)
    return ref_digest(b"kvmem/content/v1", payload, *(n.encode() for n in ns))


def ref_namespace(ns: str | None, salt: str = "") -> str:
    return ref_digest(b"kvmem/namespace/v1", (ns or "").encode(), salt.encode())


def ref_storage(key: str, ns: str | None = None, salt: str = "") -> str:
    return ref_digest(b"kvmem/storage-key/v1", ref_namespace(ns, salt).encode(), key.encode())


def ref_chunks(ids: list[int], block: int, ns: str) -> list[str]:
    out, prev = [], b""
    for i in range(0, len(ids) - block + 1, block):
        prev = ref_digest(b"kvmem/chunk/v1", prev, ref_tokens(ids[i : i + block]), ns.encode()).encode()
        out.append(prev.decode())
    return out


# -- pinned values, and the construction that produces them --------------------------------
def test_content_hash_pinned_and_constructed() -> None:
    assert content_hash("hello", "model-x") == PINNED["content_str"] == ref_content("hello", "model-x")
    assert content_hash([1, 2, 3], "model-x") == PINNED["content_tokens"] == ref_content([1, 2, 3], "model-x")
    assert content_hash(b"hello") == PINNED["content_bytes"] == ref_content(b"hello")


def test_namespace_id_pinned_and_constructed() -> None:
    assert namespace_id("ns", "salt") == PINNED["namespace_salted"] == ref_namespace("ns", "salt")
    assert namespace_id(None) == PINNED["namespace_none"] == ref_namespace(None)
    assert namespace_id(None) == namespace_id("")


def test_storage_key_pinned_and_constructed() -> None:
    assert storage_key("visual_abc") == PINNED["storage_plain"] == ref_storage("visual_abc")
    salted = storage_key("visual_abc", "ns", "salt")
    assert salted == PINNED["storage_salted"] == ref_storage("visual_abc", "ns", "salt")


def test_chunk_hashes_pinned_and_constructed() -> None:
    ids = list(range(10))
    assert chunk_hashes(ids, 4, "m") == PINNED["chunks"] == ref_chunks(ids, 4, "m")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_construction_matches_on_random_inputs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(-(2**40), 2**40, size=int(rng.integers(0, 300)))]
    ns = "model-" + str(rng.integers(1000))
    key = "".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, size=20))
    assert content_hash(ids, ns) == ref_content(ids, ns)
    assert content_hash(key, ns, "fp16") == ref_content(key, ns, "fp16")
    assert storage_key(key, ns, "t") == ref_storage(key, ns, "t")
    assert chunk_hashes(ids, 7, ns) == ref_chunks(ids, 7, ns)


def test_length_prefix_separates_part_boundaries() -> None:
    assert content_hash("x", "ab", "c") != content_hash("x", "a", "bc")
    assert content_hash("abc") != content_hash("ab", "c")
    assert storage_key("k", "ns1") != storage_key("1k", "ns")


def test_keys_are_storage_keys() -> None:
    for k in (content_hash("a"), storage_key("a"), namespace_id("a"), *chunk_hashes([1, 2], 1)):
        assert is_storage_key(k)
    assert not is_storage_key("../../etc/passwd")
    assert not is_storage_key("A" * 64)
    assert not is_storage_key("a" * 63)


# -- determinism ---------------------------------------------------------------------------
_CHILD = """
import json, sys
from kvmem.keys import chunk_hashes, content_hash, namespace_id, storage_key
print(json.dumps([content_hash("hello", "model-x"), content_hash([1, 2, 3], "model-x"),
                  storage_key("visual_abc", "ns", "salt"), namespace_id("ns", "salt"),
                  chunk_hashes(list(range(10)), 4, "m"), hash("hello")]))
"""


def test_same_keys_in_other_processes_with_other_hash_seeds() -> None:
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "12345")
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out))
    assert results[0][-1] != results[1][-1], "the two children did use different str hash seeds"
    expected = [
        PINNED["content_str"],
        PINNED["content_tokens"],
        PINNED["storage_salted"],
        PINNED["namespace_salted"],
        PINNED["chunks"],
    ]
    assert results[0][:-1] == results[1][:-1] == expected


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.int16])
def test_list_numpy_torch_token_ids_agree(dtype: type) -> None:
    ids = [5, 17, 3000, 0, 12, 9, 1, 2]
    expected = content_hash(ids, "m")
    arr = np.array(ids, dtype=dtype)
    assert content_hash(arr, "m") == expected
    assert content_hash(tuple(ids), "m") == expected
    assert chunk_hashes(arr, 4, "m") == chunk_hashes(ids, 4, "m")
    if dtype != np.uint16:
        tensor = torch.from_numpy(arr)
        assert content_hash(tensor, "m") == expected
        assert chunk_hashes(tensor, 4, "m") == chunk_hashes(ids, 4, "m")


def test_torch_token_ids_non_contiguous_and_with_grad_graph() -> None:
    ids = torch.arange(32, dtype=torch.int64)
    strided = torch.arange(64, dtype=torch.int64)[::2]
    assert not strided.is_contiguous()
    assert content_hash(strided, "m") == content_hash(list(range(0, 64, 2)), "m")
    assert content_hash(ids.view(4, 8), "m") == content_hash(ids, "m")


def test_token_ids_are_not_the_same_as_text() -> None:
    assert content_hash([104, 105]) != content_hash("hi")
    assert content_hash(b"") != content_hash([])


# -- chunking --------------------------------------------------------------------------------
def test_prefix_chaining() -> None:
    shared = list(range(1000, 1000 + 12))
    a = chunk_hashes(shared + [1, 2, 3, 4, 5, 6, 7, 8], 4, "m")
    b = chunk_hashes(shared + [1, 2, 9, 4, 5, 6, 7, 8], 4, "m")
    assert len(a) == len(b) == 5
    assert a[:3] == b[:3]
    assert a[3] != b[3]
    assert a[4] != b[4], "a chunk's hash names its whole prefix: identical chunk 4 after a divergence differs"
    # Same tokens at a different position (different prefix) hash differently.
    assert chunk_hashes([7, 7, 7, 7, 7, 7, 7, 7], 4, "m")[1] != chunk_hashes([7, 7, 7, 7], 4, "m")[0]


def test_partial_chunk_is_not_hashed() -> None:
    ids = list(range(11))
    assert len(chunk_hashes(ids, 4, "m")) == 2
    assert chunk_hashes(ids, 4, "m") == chunk_hashes(ids[:8], 4, "m")
    assert chunk_hashes(ids[:3], 4, "m") == []
    assert chunk_hashes([], 4, "m") == []
    assert len(chunk_hashes(ids, 1, "m")) == 11
    assert len(chunk_hashes(list(range(512)), 256, "m")) == 2


def test_namespace_separation() -> None:
    ids = list(range(16))
    assert chunk_hashes(ids, 4, "llama") != chunk_hashes(ids, 4, "llama-finetune")
    assert set(chunk_hashes(ids, 4, "a")).isdisjoint(chunk_hashes(ids, 4, "b"))
    assert content_hash(ids, "a") != content_hash(ids, "b")
    assert content_hash(ids, "a") != content_hash(ids)
    assert storage_key("k", "a") != storage_key("k", "b") != storage_key("k")
    assert storage_key("k", "a", "t1") != storage_key("k", "a", "t2")
    assert storage_key("k", "a") == storage_key(b"k", "a")
    assert chunk_hashes(ids, 4, "m") == chunk_hashes(ids, 4, b"m")


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data", [1.5, None, {"a": 1}, ["a", "b"], [1.0, 2.0], np.array([0.5]), torch.tensor([1.0, 2.0]), object()]
)
def test_content_hash_refuses_non_token_data(data: object) -> None:
    with pytest.raises(InvalidKeyError):
        content_hash(data)


@pytest.mark.parametrize("ns", [1, None, 2.0, ["a"]])
def test_namespace_parts_must_be_str_or_bytes(ns: object) -> None:
    with pytest.raises(InvalidKeyError, match="namespace"):
        content_hash("x", ns)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [1, 1.5, None, ["k"], ("k",), object()])
def test_storage_key_refuses_non_str_keys(key: object) -> None:
    with pytest.raises(InvalidKeyError, match="key"):
        storage_key(key)  # type: ignore[arg-type]


@pytest.mark.parametrize("block", [0, -4, 2.0, "4", None, True])
def test_chunk_hashes_refuses_bad_block_size(block: object) -> None:
    with pytest.raises(InvalidKeyError, match="block_size"):
        chunk_hashes([1, 2, 3, 4], block)  # type: ignore[arg-type]


def test_chunk_hashes_refuses_float_tokens_and_bad_namespace() -> None:
    with pytest.raises(InvalidKeyError):
        chunk_hashes([1.0, 2.0], 1)
    with pytest.raises(InvalidKeyError):
        chunk_hashes([1, 2], 1, 5)  # type: ignore[arg-type]


def test_invalid_key_error_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        storage_key(3)  # type: ignore[arg-type]
