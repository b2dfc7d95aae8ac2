"""The blob format to the byte: framing, header, alignment, CRC32C, and every way a blob can be damaged."""

from __future__ import annotations

import json
import struct

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem import blob
from kvmem.errors import IntegrityError


def make_blob(
    sizes: tuple[int, ...] = (5, 130, 0, 64, 7), meta: dict | None = None, blob_format: int = 2, align: int = blob.ALIGN
) -> tuple[torch.Tensor, list[np.ndarray], dict]:
    """A framed blob of random segments of ``sizes``; the header records their offsets and sizes."""
    rng = np.random.default_rng(sum(sizes))
    segments = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
    header = {"kind": "test", "offsets": blob.segment_offsets(list(sizes), align), "sizes": list(sizes), **(meta or {})}
    return blob.encode(header, segments, blob_format, align).to_tensor(), segments, header


def flipped(buf: torch.Tensor, pos: int, mask: int = 0x01) -> torch.Tensor:
    out = buf.clone()
    out[pos] ^= mask
    return out


# -- framing -----------------------------------------------------------------------------------
def _head_crc(raw: bytes, start: int) -> int:
    """The documented header CRC: bytes [0, 20) and [24, payload start)."""
    return crc32c.crc32c(raw[24:start], crc32c.crc32c(raw[:20]))


@pytest.mark.parametrize("blob_format, align, flags", [(1, 64, 0), (2, 64, 6), (2, 4096, 12)])
def test_round_trip_layout_to_the_byte(blob_format: int, align: int, flags: int) -> None:
    buf, segments, header = make_blob(blob_format=blob_format, align=align)
    raw = buf.numpy().tobytes()
    magic, version, got_flags, hlen, reserved, head_crc = struct.unpack_from("<8sHHIII", raw)
    assert (magic, version, got_flags, reserved) == (b"KVMEMBL\x00", blob_format, flags, 0)
    assert blob.format_of(buf) == (blob_format, align)
    parsed, start = blob.parse(buf)
    assert {k: v for k, v in parsed.items() if k not in ("payload_nbytes", "segments")} == header
    assert json.loads(raw[24 : 24 + hlen]) == {**parsed, "segments": [list(seg) for seg in parsed["segments"]]}
    assert start == blob.payload_start(hlen, align) and start % align == 0
    assert all(off % align == 0 for off in header["offsets"])
    assert raw[24 + hlen : start] == b"\0" * (start - 24 - hlen)
    for off, seg in zip(header["offsets"], segments):
        assert raw[start + off : start + off + seg.size] == seg.tobytes()
    assert len(raw) == start + parsed["payload_nbytes"]
    assert head_crc == _head_crc(raw, start) == blob.stored_crc(buf)
    # segment i's CRC covers [end_{i-1}, end_i) of the payload: its leading padding included
    prev = 0
    for (end, crc), off, seg in zip(parsed["segments"], header["offsets"], segments):
        assert end == off + seg.size
        assert crc == crc32c.crc32c(raw[start + prev : start + end])
        prev = end
    blob.verify(buf)


def test_format_2_aligns_large_blobs_to_pages_and_small_ones_as_format_1() -> None:
    assert blob.FORMAT_VERSION == 2 and blob.FORMATS == (1, 2)
    assert blob.alignment(1, 1 << 30) == 64 and blob.alignment(2, (1 << 20) - 1) == 64
    assert blob.alignment(2, 1 << 20) == blob.PAGE == 4096
    with pytest.raises(IntegrityError, match="format 3"):
        blob.alignment(3, 10)
    for fmt, align in [(1, 4096), (2, 96), (2, 8192), (3, 64)]:
        with pytest.raises(IntegrityError, match=f"format {fmt} with alignment {align}"):
            blob.encode({"kind": "x"}, [], fmt, align)


@pytest.mark.parametrize(
    "version, flags, match", [(1, 6, "flags 0x0006"), (2, 5, "flags 0x0005"), (2, 13, "flags 0x000d")]
)
def test_alignments_a_format_does_not_allow_are_refused(version: int, flags: int, match: str) -> None:
    buf, _, _ = make_blob()
    raw = bytearray(buf.numpy().tobytes())
    struct.pack_into("<HH", raw, 8, version, flags)
    damaged = torch.frombuffer(raw, dtype=torch.uint8)
    for check in (blob.verify, blob.parse, blob.format_of):
        with pytest.raises(IntegrityError, match=match):
            check(damaged)


def test_encoded_blob_parts_sizes_and_crc() -> None:
    segments = [np.arange(100, dtype=np.uint8), np.arange(3, dtype=np.uint8)]
    enc = blob.encode({"kind": "x"}, segments)
    assert enc.nbytes == sum(p.size for p in enc.parts) == enc.to_tensor().numel()
    joined = b"".join(p.tobytes() for p in enc.parts)
    start = blob.payload_start(int.from_bytes(joined[12:16], "little"))
    assert enc.crc == _head_crc(joined, start) == int.from_bytes(joined[20:24], "little")
    back = blob.EncodedBlob.from_buffer(enc.to_tensor())
    assert (back.nbytes, back.crc) == (enc.nbytes, enc.crc)
    assert back.to_tensor().numpy().tobytes() == joined


def test_to_tensor_on_another_device() -> None:
    enc = blob.encode({"kind": "x"}, [np.arange(10, dtype=np.uint8)])
    assert enc.to_tensor("meta").device.type == "meta"


@pytest.mark.parametrize("sizes", [(), (0,), (1,), (63,), (64,), (65,), (1, 1, 1), (200, 3, 64, 129)])
def test_segments_aligned_to_64(sizes: tuple[int, ...]) -> None:
    buf, segments, header = make_blob(sizes)
    parsed, start = blob.parse(buf)
    assert start % 64 == 0
    offsets = header["offsets"]
    assert all(off % 64 == 0 for off in offsets)
    assert all(b >= a + n for a, b, n in zip(offsets, offsets[1:], sizes))  # no overlap
    raw = buf.numpy()
    for off, seg in zip(offsets, segments):
        np.testing.assert_array_equal(raw[start + off : start + off + seg.size], seg)
    expected_payload = offsets[-1] + sizes[-1] if sizes else 0
    assert parsed["payload_nbytes"] == expected_payload


@settings(max_examples=60, deadline=None)
@given(
    segments=st.lists(st.binary(max_size=300), max_size=6),
    meta=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=20), st.none()), max_size=4),
    flip=st.integers(min_value=0),
    mask=st.integers(min_value=1, max_value=255),
)
def test_any_blob_round_trips_and_any_flip_is_caught(segments: list[bytes], meta: dict, flip: int, mask: int) -> None:
    arrays = [np.frombuffer(s, dtype=np.uint8) for s in segments]
    header = {"m": meta, "offsets": blob.segment_offsets([a.size for a in arrays])}
    buf = blob.encode(header, arrays).to_tensor()
    parsed, start = blob.parse(buf)
    blob.verify(buf)
    assert parsed["m"] == meta and start % 64 == 0
    for off, s in zip(header["offsets"], segments):
        assert buf[start + off : start + off + len(s)].numpy().tobytes() == s
    with pytest.raises(IntegrityError):
        blob.verify(flipped(buf, flip % buf.numel(), mask))


def test_segment_offsets_examples() -> None:
    assert blob.segment_offsets([]) == []
    assert blob.segment_offsets([1, 1, 1]) == [0, 64, 128]
    assert blob.segment_offsets([64, 64]) == [0, 64]
    assert blob.segment_offsets([0, 5]) == [0, 0]
    assert blob.segment_offsets([65, 1]) == [0, 128]


def test_header_carries_non_ascii_and_non_finite_floats() -> None:
    buf, _, _ = make_blob(meta={"name": "ключ 🔑", "x": float("inf")})
    header, _ = blob.parse(buf)
    assert header["name"] == "ключ 🔑" and header["x"] == float("inf")


# -- damage --------------------------------------------------------------------------------------
def test_bad_magic() -> None:
    buf, _, _ = make_blob()
    for pos in range(8):
        with pytest.raises(IntegrityError, match="magic"):
            blob.parse(flipped(buf, pos))


@pytest.mark.parametrize("version", [0, 3, 255, 65535])
def test_unknown_format_version(version: int) -> None:
    buf, _, _ = make_blob()
    bad = buf.clone()
    bad.numpy()[8:10] = np.frombuffer(struct.pack("<H", version), dtype=np.uint8)
    with pytest.raises(IntegrityError, match=f"version {version}"):
        blob.parse(bad)


def test_not_a_blob_at_all() -> None:
    with pytest.raises(IntegrityError):
        blob.parse(torch.from_numpy(np.frombuffer(b"PK\x03\x04" + b"\0" * 60, dtype=np.uint8).copy()))
    with pytest.raises(IntegrityError):
        blob.parse(torch.empty(0, dtype=torch.uint8))


def test_header_length_lies() -> None:
    buf, _, _ = make_blob()
    for hlen in (0, 1, 2**31, 2**32 - 1):
        bad = buf.clone()
        bad.numpy()[12:16] = np.frombuffer(struct.pack("<I", hlen), dtype=np.uint8)
        with pytest.raises(IntegrityError):
            blob.parse(bad)


def test_header_not_json_or_without_a_segment_table() -> None:
    """Headers with a *valid* header CRC but unusable content are refused by the parser itself."""
    for header_bytes in (
        b"{not json",
        b"[1, 2]",
        b'{"kind": 1}',
        b'{"payload_nbytes": "x", "segments": []}',
        b'{"payload_nbytes": 5, "segments": []}',
        b'{"payload_nbytes": 5, "segments": [[9, 0]]}',
        b'{"payload_nbytes": 9, "segments": [[9, 0], [3, 0]]}',
        b"\xff\xfe",
    ):
        raw = bytearray(struct.pack("<8sHHIII", blob.MAGIC, 1, 0, len(header_bytes), 0, 0) + header_bytes)
        raw += b"\0" * (blob.payload_start(len(header_bytes)) - len(raw))
        raw[20:24] = _head_crc(bytes(raw), len(raw)).to_bytes(4, "little")
        with pytest.raises(IntegrityError, match="header"):
            blob.parse(torch.frombuffer(raw, dtype=torch.uint8))


def test_truncation_at_every_offset_is_refused() -> None:
    buf, _, _ = make_blob()
    n = buf.numel()
    for cut in range(n):
        piece = buf[:cut].clone()
        with pytest.raises(IntegrityError):
            blob.parse(piece)
        with pytest.raises(IntegrityError, match="truncated" if cut < 24 else None):
            blob.verify(piece)
        with pytest.raises(IntegrityError):
            blob.copy_verified(piece)


def test_trailing_garbage_is_refused() -> None:
    buf, _, _ = make_blob()
    longer = torch.cat([buf, torch.zeros(64, dtype=torch.uint8)])
    with pytest.raises(IntegrityError, match="truncated or padded"):
        blob.parse(longer)


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF, 0x5A])
def test_any_single_byte_flip_fails_the_crc(mask: int) -> None:
    """Every byte is covered: the prefix (magic, version, length, reserved), header, padding, payload."""
    buf, _, _ = make_blob()
    blob.verify(buf)
    for pos in range(buf.numel()):
        bad = flipped(buf, pos, mask)
        # magic, version and alignment flags are named as such; everything else fails a CRC (or the lengths
        # it implies)
        with pytest.raises(IntegrityError, match="magic|version|alignment|CRC32C mismatch|truncated"):
            blob.verify(bad)
        with pytest.raises(IntegrityError):
            blob.copy_verified(bad)


def test_two_byte_bursts_fail_the_crc() -> None:
    buf, _, _ = make_blob((40, 9))
    rng = np.random.default_rng(7)
    for pos in range(buf.numel() - 1):
        bad = buf.clone()
        bad[pos] ^= int(rng.integers(1, 256))
        bad[pos + 1] ^= int(rng.integers(1, 256))
        with pytest.raises(IntegrityError):
            blob.verify(bad)


# -- copy_verified ----------------------------------------------------------------------------------
def test_copy_verified_returns_an_equal_independent_copy() -> None:
    buf, _, _ = make_blob()
    out = blob.copy_verified(buf)
    assert torch.equal(out, buf)
    assert out.data_ptr() != buf.data_ptr()
    buf[20] ^= 1
    assert not torch.equal(out, buf), "the copy does not share memory with its source"


def test_copy_verified_agrees_with_verify_on_a_multi_step_blob() -> None:
    """A blob over several 1 MiB copy steps: the CRC is carried across steps, damage anywhere is seen."""
    rng = np.random.default_rng(3)
    seg = rng.integers(0, 256, size=(2 << 20) + 12345, dtype=np.uint8)
    buf = blob.encode({"kind": "big"}, [seg]).to_tensor()
    assert torch.equal(blob.copy_verified(buf), buf)
    blob.verify(buf)
    n = buf.numel()
    step = 1 << 20
    for pos in (0, 17, step - 1, step, step + 1, 2 * step - 1, 2 * step, n - 5, n - 4, n - 1):
        bad = flipped(buf, pos)
        with pytest.raises(IntegrityError):
            blob.verify(bad)
        with pytest.raises(IntegrityError):
            blob.copy_verified(bad)


def test_copy_verified_and_verify_on_tiny_inputs() -> None:
    for n in range(24):
        tiny = torch.zeros(n, dtype=torch.uint8)
        with pytest.raises(IntegrityError, match="truncated"):
            blob.copy_verified(tiny)
        with pytest.raises(IntegrityError, match="truncated"):
            blob.verify(tiny)


# -- partial reads: header first, then single segments ------------------------------------------------
def test_parse_head_needs_only_the_head() -> None:
    buf, _, header = make_blob((5000, 7))
    start = blob.header_extent(buf[:24].clone())
    parsed, start2 = blob.parse_head(buf[:start].clone())
    assert start2 == start and parsed["offsets"] == header["offsets"]
    with pytest.raises(IntegrityError, match="truncated"):
        blob.parse_head(buf[: start - 1].clone())
    with pytest.raises(IntegrityError, match="header CRC32C"):
        blob.parse_head(flipped(buf, 30)[:start].clone())


def test_verify_range_checks_just_the_covering_segments() -> None:
    buf, segments, header = make_blob((100, 3000, 0, 64))
    parsed, start = blob.parse(buf)
    leaves = [{"data": {"off": off, "n": seg.size}} for off, seg in zip(header["offsets"], segments)]
    lo, hi = blob.covering_range(parsed, [leaves[1]])
    ends = [e for e, _ in parsed["segments"]]
    assert (lo, hi) == (ends[0], ends[1]) and lo <= header["offsets"][1] < header["offsets"][1] + 3000 == hi
    piece = buf[start + lo : start + hi].clone()
    blob.verify_range(parsed, piece, lo)
    with pytest.raises(IntegrityError, match="segment 1 CRC32C"):
        blob.verify_range(parsed, flipped(piece, 1234), lo)
    # damage outside the range is not this read's business
    blob.verify_range(parsed, flipped(buf, start + 1)[start + lo : start + hi].clone(), lo)
    blob.verify_range(parsed, flipped(piece, 5), lo, check=False)  # a tier that needs no check (GPU)
    with pytest.raises(IntegrityError, match="reads past the payload end"):
        blob.verify_range(parsed, torch.zeros(hi - lo + 9999, dtype=torch.uint8), lo)
    assert blob.covering_range(parsed, leaves[1:3]) == (ends[0], ends[2])  # an empty segment still owns its padding


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), max_size=5), cuts=st.lists(st.integers(1, 4000), max_size=8))
def test_stream_verifier_agrees_with_verify_whatever_the_pieces(sizes: list[int], cuts: list[int]) -> None:
    buf, _, _ = make_blob(tuple(sizes))
    arr = buf.numpy()
    checker = blob.StreamVerifier()
    upto = 0
    for step in cuts + [arr.size]:
        upto = min(arr.size, upto + step)
        checker.feed(arr, upto)
    header, start = checker.finish(arr.size)
    assert (header, start) == blob.parse(buf)


def test_empty_buffer() -> None:
    buf = blob.empty_buffer(1000)
    assert buf.dtype == torch.uint8 and buf.numel() == 1000 and buf.device.type == "cpu"
