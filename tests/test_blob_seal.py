"""Lazy sealing (kvmem/blob.py): ``encode`` frames without CRCs, ``seal`` fills fixed-width slots in place."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from kvmem import blob as blobfmt
from kvmem.codecs import parse_codec
from kvmem.codecs.serialization import decode_value, encode_value
from kvmem.errors import IntegrityError
from kvmem.stores.files import write_blob
from tests.bounds import assert_bit_exact

_SLOT = re.compile(rb"\[(\d+),( {9}0)\]")


def segments() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [
        torch.randn(3, 50, generator=g),
        torch.randint(0, 2**31 - 1, (17,), generator=g, dtype=torch.int32),
        torch.randn(2, 8, generator=g).to(torch.bfloat16),
    ]


def fresh() -> blobfmt.EncodedBlob:
    return blobfmt.encode({"kind": "test", "note": "seal"}, segments())


def header_text(enc: blobfmt.EncodedBlob) -> bytes:
    hlen = int.from_bytes(enc.head[12:16].tobytes(), "little")
    return enc.head[24 : 24 + hlen].tobytes()


def test_encode_is_unsealed_with_fixed_width_zero_crc_slots() -> None:
    enc = fresh()
    assert not enc.sealed
    assert enc.head[:8].tobytes() == blobfmt.MAGIC
    assert enc.head[20:24].tobytes() == bytes(4), "the header CRC is filled before sealing"
    text = header_text(enc)
    header = json.loads(text)
    assert [crc for _end, crc in header["segments"]] == [0, 0, 0]
    slots = _SLOT.findall(text)
    assert [int(end) for end, _ in slots] == [end for end, _crc in header["segments"]]
    assert len(enc.crc_slots()) == 3
    for at in enc.crc_slots():
        assert enc.head[at : at + 10].tobytes() == b"         0"
    assert [crc for _end, crc in enc.header["segments"]] == [0, 0, 0]  # type: ignore[index]
    with pytest.raises(IntegrityError, match="header CRC32C mismatch"):
        blobfmt.parse_head(torch.from_numpy(enc.head.copy()))  # an unsealed head does not pass its CRC


def test_seal_fills_the_slots_in_place_and_is_idempotent() -> None:
    enc = fresh()
    start, nbytes = enc.start, enc.nbytes
    enc.seal()
    assert enc.sealed and enc.start == start and enc.nbytes == nbytes, "sealing moved the payload"
    sealed_head = enc.head.tobytes()
    text = header_text(enc)
    header = json.loads(text)
    for at, (_end, crc) in zip(enc.crc_slots(), header["segments"]):
        assert enc.head[at : at + 10].tobytes() == f"{crc:10d}".encode()
    assert [tuple(seg) for seg in header["segments"]] == list(enc.header["segments"])  # type: ignore[index]
    enc.seal()
    enc.seal([1, 2, 3])  # sealed already: CRCs given now change nothing
    assert enc.head.tobytes() == sealed_head
    buf = enc.to_tensor()
    parsed, pstart = blobfmt.verify(buf)
    assert pstart == start and parsed["segments"] == enc.header["segments"]  # type: ignore[index]
    # each segment CRC covers its bytes, leading padding included, computed here independently
    payload = buf.numpy()[start:]
    prev = 0
    for end, crc in header["segments"]:
        assert crc32c.crc32c(payload[prev:end]) == crc
        prev = end
    assert enc.crc == blobfmt.stored_crc(buf)


def test_to_tensor_and_parts_seal_first() -> None:
    a, b = fresh(), fresh()
    buf = a.to_tensor()
    assert a.sealed
    blobfmt.verify(buf)
    parts = b.parts
    assert b.sealed
    assert b"".join(p.tobytes() for p in parts) == buf.numpy().tobytes()
    c = fresh()
    assert c.crc == a.crc and c.sealed


def test_seal_with_the_crcs_a_writer_computed_gives_the_same_head(tmp_path: Path) -> None:
    reference = fresh()
    reference.seal()
    given = fresh()
    given.seal([crc for _end, crc in reference.header["segments"]])  # type: ignore[index]
    assert given.head.tobytes() == reference.head.tobytes()
    # the disk tier's writer: CRCs taken in its own pass over the bytes, then the head sealed with them
    written = fresh()
    path = tmp_path / "blob.kvb"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_blob(fd, written)
    finally:
        os.close(fd)
    assert written.sealed and written.head.tobytes() == reference.head.tobytes()
    assert path.read_bytes() == reference.to_tensor().numpy().tobytes()
    blobfmt.verify(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))


@pytest.mark.parametrize("codec, dtype", [("none", torch.float32), ("bf16", torch.bfloat16)])
def test_a_strided_leaf_is_not_copied_by_encode_and_round_trips(codec: str, dtype: torch.dtype) -> None:
    kv = torch.randn(2, 4, 64, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    sl = kv[:, :, 8:40]
    assert not sl.is_contiguous()
    enc, raw = encode_value(sl, parse_codec(codec))
    assert raw == sl.numel() * sl.element_size()
    assert not enc.sealed
    (piece,) = enc.pieces
    assert isinstance(piece.source, torch.Tensor)
    assert piece.source.data_ptr() == sl.data_ptr(), "encode copied the strided leaf"
    assert piece.source.stride() == sl.stride()
    buf = enc.to_tensor()
    value, header = decode_value(buf, head=blobfmt.verify(buf))
    assert header["leaves"][0]["dtype"] == str(dtype).removeprefix("torch.")
    assert_bit_exact(sl.contiguous(), value)


def test_a_value_that_must_be_converted_is_encoded_from_a_new_tensor() -> None:
    kv = torch.randn(2, 4, 64, 32, generator=torch.Generator().manual_seed(6))
    sl = kv[:, :, 8:40]
    enc, _ = encode_value(sl, parse_codec("fp16"))
    sources = [p.source for p in enc.pieces]
    assert all(not (isinstance(s, torch.Tensor) and s.data_ptr() == sl.data_ptr()) for s in sources)
    buf = enc.to_tensor()
    value, _ = decode_value(buf, head=blobfmt.verify(buf))
    assert torch.equal(value, sl.to(torch.float16).to(torch.float32))


def test_numpy_segments_seal_like_tensors() -> None:
    arr = np.arange(300, dtype=np.uint8)
    enc = blobfmt.encode({"kind": "bytes"}, [arr, arr[::3]])
    enc.seal()
    header, start = blobfmt.verify(enc.to_tensor())
    (end0, crc0), (end1, crc1) = header["segments"]
    assert crc0 == crc32c.crc32c(arr.tobytes()) and end0 == 300
    assert end1 - 320 == 100  # the second segment starts on the next 64-byte boundary
    assert crc1 == crc32c.crc32c(bytes(20) + arr[::3].tobytes())
