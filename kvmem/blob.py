"""The blob format: framing, CRC32C and header parsing. Pure functions, no I/O.

Layout (all integers little-endian)::

    0   magic          8 bytes  b"KVMEMBL\\x00"
    8   format         u16      FORMAT_VERSION
    10  reserved       u16      0
    12  header_len     u32
    16  header         JSON, UTF-8 (kind, codec, tree, leaves, metadata, payload_nbytes)
    ..  zero padding up to a multiple of ALIGN
    P   payload        segments, each starting at a multiple of ALIGN from P
    ..  crc32c         u32      over every byte before it

A blob is handled as a 1-D ``torch.uint8`` tensor (any device) once it is
contiguous, or as an :class:`EncodedBlob` (a list of parts) while it is being
written, so tensor bytes are never concatenated just to be written out.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from kvmem.errors import IntegrityError

__all__ = [
    "MAGIC", "FORMAT_VERSION", "ALIGN", "EncodedBlob", "Header",
    "encode", "parse", "verify", "copy_verified", "payload_start", "crc_of",
    "segment_offsets", "stored_crc", "empty_buffer",
]

MAGIC = b"KVMEMBL\x00"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sHHI")
_TRAILER = struct.Struct("<I")
_ZEROS = np.zeros(ALIGN, dtype=np.uint8)
# NOTE: copy+CRC in 4 MiB steps: the CRC reads each step while it is still in (L3) cache.
# Measured on a 33.5 MB blob (2-core EPYC VM): copy+CRC ran at 0.75-0.83 of a plain
# copy with 4 MiB steps, 0.63-0.77 with 1 MiB steps, 0.72-0.76 with 8 MiB steps.
_COPY_STEP = 4 << 20

Header = dict[str, Any]


def empty_buffer(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """A new uint8 CPU tensor of ``nbytes``.

    NOTE: allocated through numpy unless pinned: numpy asks the kernel for huge
    pages on large arrays, and first-touch page faults then cost ~10x less than
    with torch's allocator (measured here: 6.2 vs 0.5 GB/s for a fresh 32 MiB copy).
    """
    if pin_memory:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def payload_start(header_len: int) -> int:
    """Offset of the payload for a header of ``header_len`` bytes."""
    return _align(_PREFIX.size + header_len)


def crc_of(parts: list[np.ndarray], value: int = 0) -> int:
    """CRC32C over ``parts`` in order (continuing from ``value``)."""
    for part in parts:
        value = crc32c.crc32c(part, value)
    return value


@dataclass(frozen=True)
class EncodedBlob:
    """A blob as parts (uint8 arrays) ready to be written or copied once.

    Attributes:
        parts: prefix, header, padding, payload segments and the CRC trailer, in order.
        nbytes: total size in bytes.
        crc: the CRC32C stored in the trailer.
    """

    parts: tuple[np.ndarray, ...]
    nbytes: int
    crc: int

    @classmethod
    def from_buffer(cls, buf: torch.Tensor) -> "EncodedBlob":
        """Wrap a contiguous blob (e.g. one held by a tier) without copying it."""
        host = buf if buf.device.type == "cpu" else buf.cpu()
        arr = host.numpy()
        return cls(parts=(arr,), nbytes=arr.size, crc=int.from_bytes(arr[-4:].tobytes(), "little"))

    def to_tensor(self, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
        """One contiguous uint8 tensor holding the blob (a single copy of each part)."""
        out = empty_buffer(self.nbytes, pin_memory)
        dst = out.numpy()
        offset = 0
        for part in self.parts:
            dst[offset:offset + part.size] = part
            offset += part.size
        return out if torch.device(device).type == "cpu" else out.to(device)


def encode(header: Header, segments: list[np.ndarray]) -> EncodedBlob:
    """Frame ``segments`` behind ``header`` and append the CRC.

    Each segment's offset (from the payload start) and size are recorded by the
    caller in ``header``; this function lays them out at ``ALIGN`` boundaries and
    adds ``payload_nbytes``.

    Args:
        header: JSON-able dict; must not contain ``payload_nbytes``.
        segments: uint8 arrays, in the order of their recorded offsets.
    """
    offset = 0
    body: list[np.ndarray] = []
    for seg in segments:
        pad = _align(offset) - offset
        if pad:
            body.append(_ZEROS[:pad])
        body.append(seg)
        offset += pad + seg.size
    header = {**header, "payload_nbytes": offset}
    hjson = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    prefix = np.frombuffer(_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hjson)), dtype=np.uint8)
    head = [prefix, np.frombuffer(hjson, dtype=np.uint8)]
    pad = payload_start(len(hjson)) - _PREFIX.size - len(hjson)
    if pad:
        head.append(_ZEROS[:pad])
    parts = head + body
    crc = crc_of(parts)
    parts.append(np.frombuffer(_TRAILER.pack(crc), dtype=np.uint8))
    return EncodedBlob(tuple(parts), sum(p.size for p in parts), crc)


def segment_offsets(sizes: list[int]) -> list[int]:
    """Payload-relative offsets :func:`encode` gives segments of these sizes."""
    offsets, offset = [], 0
    for size in sizes:
        offset = _align(offset)
        offsets.append(offset)
        offset += size
    return offsets


def _host_bytes(buf: torch.Tensor, start: int, stop: int) -> bytes:
    piece = buf[start:stop]
    return (piece if piece.device.type == "cpu" else piece.cpu()).numpy().tobytes()


def parse(buf: torch.Tensor) -> tuple[Header, int]:
    """Check framing and read the header of a contiguous blob (CRC not checked).

    Returns:
        ``(header, payload_start)``.

    Raises:
        IntegrityError: bad magic, unknown format version, truncation or a bad header.
    """
    n = buf.numel()
    if n < _PREFIX.size + _TRAILER.size:
        raise IntegrityError(f"blob truncated: {n} bytes, smaller than the {_PREFIX.size + 4}-byte frame")
    magic, version, _reserved, hlen = _PREFIX.unpack(_host_bytes(buf, 0, _PREFIX.size))
    if magic != MAGIC:
        raise IntegrityError(f"bad magic {magic!r}: expected {MAGIC!r} (not a kvmem blob)")
    if version != FORMAT_VERSION:
        raise IntegrityError(f"blob format version {version} is not supported: this kvmem reads {FORMAT_VERSION}")
    start = payload_start(hlen)
    if start + _TRAILER.size > n:
        raise IntegrityError(f"blob truncated: header of {hlen} bytes does not fit in {n} bytes")
    try:
        header = json.loads(_host_bytes(buf, _PREFIX.size, _PREFIX.size + hlen))
        expected = start + int(header["payload_nbytes"]) + _TRAILER.size
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"blob header is not valid JSON with payload_nbytes: {exc}") from None
    if expected != n:
        raise IntegrityError(f"blob truncated or padded: header says {expected} bytes, got {n}")
    return header, start


def stored_crc(buf: torch.Tensor) -> int:
    """The CRC32C in a blob's trailer."""
    return int(_TRAILER.unpack(_host_bytes(buf, buf.numel() - 4, buf.numel()))[0])


def verify(buf: torch.Tensor) -> None:
    """Check a CPU blob's CRC32C.

    Raises:
        IntegrityError: the CRC does not match (or the blob is too short to hold one).
    """
    if buf.numel() < _TRAILER.size:
        raise IntegrityError(f"blob truncated: {buf.numel()} bytes")
    arr = buf.numpy()
    actual = crc32c.crc32c(arr[:-4])
    if actual != stored_crc(buf):
        raise IntegrityError(f"CRC32C mismatch: stored {stored_crc(buf):#010x}, computed {actual:#010x}")


def copy_verified(src: torch.Tensor, pin_memory: bool = False) -> torch.Tensor:
    """Copy a CPU blob and check its CRC in the same pass.

    The CRC is computed over the *destination* one step (``_COPY_STEP``) at a time,
    while that step is still in cache, so checking costs little more than the copy itself,
    and the bytes checked are exactly the bytes returned.

    Raises:
        IntegrityError: the CRC of the copy does not match its trailer.
    """
    n = src.numel()
    if n < _TRAILER.size:
        raise IntegrityError(f"blob truncated: {n} bytes")
    dst = empty_buffer(n, pin_memory)
    s, d = src.numpy(), dst.numpy()
    body = n - _TRAILER.size
    value = 0
    for start in range(0, body, _COPY_STEP):
        stop = min(start + _COPY_STEP, body)
        np.copyto(d[start:stop], s[start:stop])
        value = crc32c.crc32c(d[start:stop], value)
    d[body:] = s[body:]
    if value != stored_crc(dst):
        raise IntegrityError(f"CRC32C mismatch: stored {stored_crc(dst):#010x}, computed {value:#010x}")
    return dst
