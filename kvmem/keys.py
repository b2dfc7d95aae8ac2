"""Content hashes and storage keys. Pure functions, no I/O.

Every key is the hex sha256 of a length-prefixed encoding of its parts, so two
different part lists can never produce the same bytes to hash (``("ab", "c")``
and ``("a", "bc")`` differ). Same inputs give the same key in every process and
on every machine: nothing here depends on ``PYTHONHASHSEED``, the platform's
byte order or the Python version.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable

import numpy as np

from kvmem.errors import InvalidKeyError

__all__ = ["KEY_RE", "content_hash", "storage_key", "namespace_id", "chunk_hashes", "is_storage_key"]

KEY_RE = re.compile(r"^[0-9a-f]{64}$")
"""A storage key: 64 lowercase hex digits. Only such strings ever become file names."""

_STORAGE_DOMAIN = b"kvmem/storage-key/v1"
_CONTENT_DOMAIN = b"kvmem/content/v1"
_CHUNK_DOMAIN = b"kvmem/chunk/v1"
_NAMESPACE_DOMAIN = b"kvmem/namespace/v1"


def _as_bytes(part: object, what: str) -> bytes:
    if isinstance(part, bytes):
        return part
    if isinstance(part, (bytearray, memoryview)):
        return bytes(part)
    if isinstance(part, str):
        return part.encode("utf-8", "surrogatepass")
    raise InvalidKeyError(f"{what}={part!r:.80}: expected str or bytes, got {type(part).__name__}")


def _digest(domain: bytes, parts: Iterable[bytes]) -> str:
    h = hashlib.sha256(domain)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _token_bytes(token_ids: object) -> bytes:
    """Token ids as little-endian int64 bytes (a torch tensor, numpy array or sequence)."""
    if hasattr(token_ids, "detach"):  # torch.Tensor, without importing torch here
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.dtype.kind not in "iu" and arr.size:
        raise InvalidKeyError(f"token_ids of dtype {arr.dtype}: expected integer token ids")
    return np.ascontiguousarray(arr.reshape(-1), dtype="<i8").tobytes()


def content_hash(data: object, *namespace: str | bytes) -> str:
    """Deterministic hex sha256 of ``data`` folded with ``namespace`` parts.

    Args:
        data: ``str``, ``bytes``, or a sequence / array / tensor of integer token ids
            (hashed as little-endian int64, so ``[1, 2]`` and ``np.array([1, 2])`` agree).
        *namespace: strings that scope the hash, e.g. the model name.

    Returns:
        64 lowercase hex digits.
    """
    if isinstance(data, (str, bytes, bytearray, memoryview)):
        payload = b"b" + _as_bytes(data, "data")
    else:
        payload = b"t" + _token_bytes(data)
    return _digest(_CONTENT_DOMAIN, [payload, *(_as_bytes(n, "namespace") for n in namespace)])


def namespace_id(namespace: str | bytes | None, tenant_salt: str = "") -> str:
    """The digest that scopes storage keys: namespace and tenant salt together."""
    if isinstance(namespace, (str, bytes, type(None))) and isinstance(tenant_salt, str):
        return _namespace_id(namespace or "", tenant_salt)
    return _namespace_id.__wrapped__(namespace or "", tenant_salt)  # unhashable: raises InvalidKeyError


@functools.lru_cache(maxsize=1024)
def _namespace_id(namespace: str | bytes, tenant_salt: str) -> str:
    # cached: every store and load derives a storage key, from a handful of namespaces
    return _digest(_NAMESPACE_DOMAIN, [_as_bytes(namespace, "namespace"), _as_bytes(tenant_salt, "tenant_salt")])


def storage_key(key: str | bytes, namespace: str | None = None, tenant_salt: str = "") -> str:
    """The storage key of a user key: ``sha256(namespace ‖ tenant salt ‖ key)``.

    The same ``key`` in two namespaces (or under two salts) gives two unrelated
    storage keys, so entries never collide or leak across them.

    Raises:
        InvalidKeyError: ``key`` is not ``str`` or ``bytes``.
    """
    if (
        isinstance(key, (str, bytes))
        and len(key) <= _CACHED_KEY_LEN
        and isinstance(namespace, (str, bytes, type(None)))
        and isinstance(tenant_salt, str)
    ):
        return _cached_storage_key(key, namespace or "", tenant_salt)
    return _storage_key(key, namespace, tenant_salt)


_CACHED_KEY_LEN = 512


def _storage_key(key: str | bytes, namespace: str | bytes | None, tenant_salt: str) -> str:
    return _digest(_STORAGE_DOMAIN, [namespace_id(namespace, tenant_salt).encode(), _as_bytes(key, "key")])


# NOTE: cached: a hot key is stored or loaded again and again (a 64 KiB load is ~30 us in all, the hash
# and its encodes ~3 us of it); keys longer than _CACHED_KEY_LEN are hashed each time and never held
_cached_storage_key = functools.lru_cache(maxsize=1 << 16)(_storage_key)


def chunk_hashes(token_ids: object, block_size: int, namespace: str | bytes = "") -> list[str]:
    """Prefix-chained hashes of the full ``block_size`` chunks of ``token_ids``.

    ``h_i = sha256(h_{i-1} ‖ tokens_i ‖ namespace)``, so chunk ``i``'s hash names the
    whole prefix up to and including it. A trailing partial chunk gets no hash.

    Args:
        token_ids: a 1-D sequence / array / tensor of integer token ids.
        block_size: tokens per chunk (> 0).
        namespace: model fingerprint, dtype, codec, salt... folded into every hash.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise InvalidKeyError(f"block_size={block_size!r}: expected a positive integer")
    raw = _token_bytes(token_ids)
    ns = _as_bytes(namespace, "namespace")
    step = block_size * 8
    hashes: list[str] = []
    prev = b""
    for start in range(0, len(raw) - step + 1, step):
        prev = _digest(_CHUNK_DOMAIN, [prev, raw[start : start + step], ns]).encode()
        hashes.append(prev.decode())
    return hashes


def is_storage_key(key: str) -> bool:
    """Whether ``key`` is a well-formed storage key (safe as a file name)."""
    return bool(KEY_RE.match(key))
