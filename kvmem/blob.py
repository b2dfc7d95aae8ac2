"""The blob format: framing, per-segment CRC32C and header parsing. Pure functions, no I/O.

Layout (all integers little-endian)::

    0   magic          8 bytes  b"KVMEMBL\\x00"
    8   format         u16      1 or 2 (FORMATS); FORMAT_VERSION is written by default
    10  flags          u16      format 1: 0; format 2: log2 of the alignment A (6..12)
    12  header_len     u32
    16  reserved       u32      0
    20  header_crc     u32      CRC32C of bytes [0, 20) and [24, P)
    24  header         JSON, UTF-8: kind, codec, tree, leaves, metadata,
                       payload_nbytes, segments = [[end, crc], ...]
    ..  zero padding up to P, a multiple of A
    P   payload        segments, each starting at a multiple of A from P

The alignment ``A`` is 64 bytes in format 1. Format 2 records it in ``flags`` and
picks 4096 (a page) for blobs of 1 MiB and more: every segment of a large blob,
one layer of a KV chunk, then starts on a page of its file, which is what
``O_DIRECT``, GPUDirect Storage and page-granular reads want; small blobs keep
64 so they do not grow. Readers read both formats; ``kvmem migrate`` rewrites
a data directory's blobs from one to the other.

Segment ``i``'s CRC covers payload bytes ``[end_{i-1}, end_i)`` (its leading
padding included), so every byte of a blob is covered by exactly one CRC, and a
reader can check any one segment -- one layer of a KV chunk -- without reading
the rest: that is what layer-wise loading needs. :class:`StreamVerifier` checks a
whole blob in one pass as its bytes arrive (a copy, a read).

A blob is handled as a 1-D ``torch.uint8`` tensor (any device) once it is
contiguous, or as an :class:`EncodedBlob` (a list of parts) while it is being
written, so tensor bytes are never concatenated just to be written out.
"""

from __future__ import annotations

import bisect
import json
import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import crc32c
import numpy as np
import torch

from kvmem.errors import IntegrityError
from kvmem.rows import Source, byte_rows, nbytes_of

__all__ = [
    "MAGIC",
    "FORMATS",
    "FORMAT_VERSION",
    "ALIGN",
    "PAGE",
    "HEAD_PROBE",
    "alignment",
    "format_of",
    "EncodedBlob",
    "Piece",
    "PlainTensor",
    "Frame",
    "Header",
    "chain_crc",
    "StreamVerifier",
    "Verified",
    "encode",
    "parse",
    "parse_head",
    "header_extent",
    "verify",
    "copy_verified",
    "payload_start",
    "segment_offsets",
    "stored_crc",
    "empty_buffer",
    "covering_range",
    "verify_range",
]

MAGIC = b"KVMEMBL\x00"
FORMATS = (1, 2)
FORMAT_VERSION = 2
ALIGN = 64
PAGE = 4096
_PAGE_FROM = 1 << 20  # format 2: blobs of this many payload bytes or more align their segments to PAGE
_ALIGNS = frozenset(1 << n for n in range(6, 13))  # format 2 alignments: 64 .. PAGE
HEAD_PROBE = 4096
"""Bytes to read first when only the header is wanted (most headers fit)."""
_PREFIX = struct.Struct("<8sHHIII")
_CRC_AT = 20
_ZEROS = np.zeros(PAGE, dtype=np.uint8)
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=True, check_circular=False)
_CRC_WIDTH = 10  # NOTE: a u32 in decimal: the header's CRC slots are this wide, so sealing never moves a byte
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


def _align(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def alignment(blob_format: int, nbytes: int) -> int:
    """The segment alignment a blob of ``blob_format`` with ``nbytes`` of payload gets.

    Raises:
        IntegrityError: ``blob_format`` is not one of :data:`FORMATS`.
    """
    if blob_format not in FORMATS:
        raise IntegrityError(f"blob format {blob_format!r} is not supported: this kvmem reads and writes {FORMATS}")
    return PAGE if blob_format >= 2 and nbytes >= _PAGE_FROM else ALIGN


def payload_start(header_len: int, align: int = ALIGN) -> int:
    """Offset of the payload for a header of ``header_len`` bytes."""
    return _align(_PREFIX.size + header_len, align)


class Piece(NamedTuple):
    """Payload bytes of a blob: ``source`` (any layout) goes at blob offset ``offset``, after ``pad`` zero bytes
    that belong to the same CRC segment."""

    offset: int
    source: Source
    pad: int = 0


class PlainTensor(NamedTuple):
    """A blob that is one tensor stored as it is: its dtype and shape, and where its bytes lie (payload offset,
    size). A tier that knows this copies the tensor in and out without parsing the header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


_SEALING = threading.Lock()  # fills a blob's CRC slots (one lock for all blobs: sealing is short)


class EncodedBlob:
    """A blob ready to be copied or written once: its head (prefix, header, padding) and its payload pieces.

    The pieces are the value's own bytes (a strided KV cache slice stays strided: it is
    copied once, into pool pages or a file, never first into a contiguous temporary).
    The CRCs are computed when first needed (:meth:`seal`): by the tier that writes the
    bytes out (in the same pass as the write), by the catalog, or by a reader of
    :attr:`parts`. Until then the header's CRC fields hold zeros, in fixed-width slots,
    so sealing rewrites the head in place and never moves the payload.

    Attributes:
        head: prefix + JSON header + padding, ``start`` bytes (a view into a tier's pages
            for a blob a tier holds).
        pieces: payload pieces by increasing offset; bytes no piece covers are zero.
        nbytes: total size in bytes.
        header: the parsed header (segment CRCs filled once sealed), or ``None`` when
            wrapped from bytes (:meth:`from_buffer`).
        owner: what keeps the memory of ``head`` and ``pieces`` alive, when they are views.
        plain: set when the blob is known to hold one tensor stored as it is (by its encoder), else ``None``.
    """

    def __init__(
        self,
        head: np.ndarray,
        pieces: tuple[Piece, ...],
        nbytes: int,
        header: Header | None,
        crc_at: tuple[int, ...] = (),
        sealed: bool = True,
        owner: object = None,
        plain: PlainTensor | None = None,
    ) -> None:
        self.head = head
        self.pieces = pieces
        self.nbytes = nbytes
        self.header = header
        self.owner = owner  # keeps the memory that head and pieces show alive (a tier's pages)
        self.plain = plain
        self._crc_at = crc_at  # offsets in head of each segment's 10-digit CRC slot
        self._sealed = sealed

    @classmethod
    def from_buffer(cls, buf: torch.Tensor, parsed: tuple[Header, int] | None = None) -> EncodedBlob:
        """Wrap a whole, sealed blob (e.g. one a tier read) without copying it.

        Args:
            buf: the blob's bytes.
            parsed: ``(header, payload_start)`` as its check parsed them; without it the
                blob is not parsed at all, and its :attr:`head` is the whole blob.
        """
        host = buf if buf.device.type == "cpu" else buf.cpu()
        arr = host.numpy()
        if parsed is None:
            return cls(arr, (), arr.size, None)
        header, start = parsed
        return cls(arr[:start], (Piece(start, arr[start:]),) if arr.size > start else (), arr.size, header)

    def crc_slots(self) -> tuple[int, ...]:
        """Where the segment CRCs go in :attr:`head` (for a copy of this blob that will be sealed on its own)."""
        return self._crc_at

    @property
    def start(self) -> int:
        """Offset of the payload (the head's size)."""
        return self.head.size

    @property
    def parsed(self) -> tuple[Header, int] | None:
        """``(header, payload start)``; ``None`` for a blob wrapped from bytes unparsed (:meth:`from_buffer`)."""
        return None if self.header is None else (self.header, self.start)

    @property
    def sealed(self) -> bool:
        """Whether the CRCs are in place."""
        return self._sealed

    @property
    def crc(self) -> int:
        """The header CRC32C (it covers the segment CRCs, so it names the whole content); seals first."""
        self.seal()
        return int.from_bytes(self.head[_CRC_AT : _PREFIX.size].tobytes(), "little")

    def seal(self, crcs: Sequence[int] | None = None) -> None:
        """Fill in the segment CRCs (computed from the pieces unless given) and the header CRC. Idempotent.

        Args:
            crcs: the segments' CRCs as a writer computed them in its own pass over the bytes.
        """
        if self._sealed:
            return
        assert self.header is not None
        if crcs is None:  # NOTE: outside the lock: blobs are sealed in parallel (two sealers of one compute twice)
            crcs = [chain_crc(self.segment_rows(i)) for i in range(len(self._crc_at))]
        with _SEALING:
            if self._sealed:
                return
            head = self.head.data
            for at, crc in zip(self._crc_at, crcs):
                head[at : at + _CRC_WIDTH] = f"{crc:{_CRC_WIDTH}d}".encode()
            # NOTE: a tuple of (end, crc) tuples of ints: the garbage collector stops tracking it (see
            # kvmem.stores.cpu._Entry), where a list of lists was 2 objects more per stored entry
            self.header["segments"] = tuple([(end, crc) for (end, _zero), crc in zip(self.header["segments"], crcs)])
            head[_CRC_AT : _PREFIX.size] = _header_crc(self.head).to_bytes(4, "little")
            self._sealed = True

    def segment_rows(self, i: int) -> list[np.ndarray]:
        """Contiguous byte rows of CRC segment ``i`` (its leading padding included)."""
        assert self.header is not None
        table = self.header["segments"]
        return self.rows(self.start + (table[i - 1][0] if i else 0), self.start + table[i][0])

    def rows(self, lo: int, hi: int) -> list[np.ndarray]:
        """Contiguous byte rows of payload bytes ``[lo, hi)`` (blob offsets), padding as zeros.

        NOTE: a piece is cut only if its source is contiguous (a tier's pages); pieces of
        a value's own tensors are whole segments, so segment bounds never cut them.
        """
        rows: list[np.ndarray] = []
        for piece in self.pieces:
            first, end = piece.offset - piece.pad, piece.offset + nbytes_of(piece.source)
            if end <= lo or first >= hi:
                continue
            if piece.offset > max(lo, first):
                rows.append(_ZEROS[: piece.offset - max(lo, first)])
            if lo <= piece.offset and end <= hi:
                rows += byte_rows(piece.source)
            else:
                (whole,) = byte_rows(piece.source, min_row=0) or [_ZEROS[:0]]
                rows.append(whole[max(lo, piece.offset) - piece.offset : min(hi, end) - piece.offset])
        return rows

    @property
    def parts(self) -> tuple[np.ndarray, ...]:
        """The sealed blob as contiguous uint8 arrays, in order (strided pieces are copied to make them so)."""
        self.seal()
        out = [self.head]
        for piece in self.pieces:
            if piece.pad:
                out.append(_ZEROS[: piece.pad])
            out += byte_rows(piece.source)
        return tuple(out)

    def to_tensor(self, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
        """One contiguous uint8 tensor holding the sealed blob (a single copy of each part)."""
        out = empty_buffer(self.nbytes, pin_memory)
        dst = out.numpy()
        offset = 0
        for part in self.parts:
            dst[offset : offset + part.size] = part
            offset += part.size
        return out if torch.device(device).type == "cpu" else out.to(device)


def chain_crc(rows: Sequence[np.ndarray]) -> int:
    """CRC32C of the concatenation of ``rows``."""
    crc = 0
    for row in rows:
        crc = crc32c.crc32c(row.data, crc)
    return crc


def encode(
    header: Header,
    segments: Sequence[Source],
    blob_format: int = FORMAT_VERSION,
    align: int = ALIGN,
    body: str | None = None,
) -> EncodedBlob:
    """Frame ``segments`` behind ``header``; their CRCs are computed when the blob is sealed.

    Each segment's offset (from the payload start) and size are recorded by the
    caller in ``header`` (see :func:`segment_offsets`); this function lays them out
    at ``align`` boundaries and adds ``payload_nbytes`` and ``segments``.

    Args:
        header: JSON-able dict without ``payload_nbytes`` or ``segments``.
        segments: the segments' bytes (uint8 arrays, or tensors of any dtype and layout),
            in the order of their recorded offsets; they are not copied.
        blob_format: one of :data:`FORMATS`.
        align: segment alignment: :data:`ALIGN` in format 1; in format 2 a power of two
            from 64 to :data:`PAGE` (:func:`alignment` picks it).
        body: ``header`` with its ``payload_nbytes`` already rendered as compact JSON by the caller
            (a cached rendering of a header shape seen before), else rendered here.
    """
    frame = Frame.of([nbytes_of(seg) for seg in segments], blob_format, align)
    if body is None:
        body = _ENCODER.encode({**header, "payload_nbytes": frame.payload_nbytes})
    return frame.blob(header, body, segments)


class Frame(NamedTuple):
    """How :func:`encode` lays out segments of given sizes: the same for every blob of those sizes, so a
    caller that stores many values of one shape computes it once (only the header body differs per blob).

    Attributes:
        offsets: each segment's payload offset (aligned).
        pads: zero bytes before each segment.
        ends: each segment's payload end.
        payload_nbytes: the payload's size.
        tail: the header's closing ``"segments":[...]}``, its CRC slots zeros.
        slots: where in ``tail`` each segment's CRC slot starts.
        blob_format: the blob format.
        align: the segment alignment.
        zero_crcs: the header's ``segments`` before sealing, ``(end, 0)`` each (shared: a tuple of ints).
    """

    offsets: tuple[int, ...]
    pads: tuple[int, ...]
    ends: tuple[int, ...]
    payload_nbytes: int
    tail: str
    slots: tuple[int, ...]
    blob_format: int
    align: int
    zero_crcs: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, sizes: Sequence[int], blob_format: int = FORMAT_VERSION, align: int = ALIGN) -> Frame:
        """The frame of segments of ``sizes`` bytes.

        Raises:
            IntegrityError: an unknown format, or an alignment it does not allow.
        """
        if (blob_format, align) != (1, ALIGN) and not (blob_format == 2 and align in _ALIGNS):
            raise IntegrityError(
                f"blob format {blob_format!r} with alignment {align!r}: accepted format 1 with "
                f"{ALIGN}, format 2 with a power of two from {ALIGN} to {PAGE}"
            )
        offsets = segment_offsets(list(sizes), align)
        ends = [at + size for at, size in zip(offsets, sizes)]
        pads = [at - prev for at, prev in zip(offsets, [0, *ends])]
        tail, slots = '"segments":[', []
        for i, end in enumerate(ends):
            tail += f"[{end},"
            slots.append(len(tail))
            tail += " " * (_CRC_WIDTH - 1) + "0]" + ("," if i + 1 < len(ends) else "")
        payload = ends[-1] if ends else 0
        zero_crcs = tuple([(end, 0) for end in ends])
        return cls(
            tuple(offsets),
            tuple(pads),
            tuple(ends),
            payload,
            tail + "]}",
            tuple(slots),
            blob_format,
            align,
            zero_crcs,
        )

    def blob(
        self, header: Header, body: str, segments: Sequence[Source], plain: PlainTensor | None = None
    ) -> EncodedBlob:
        """The blob of ``segments`` (of the sizes this frame was made for) behind ``header``, rendered as
        ``body`` (compact JSON of ``header`` with its ``payload_nbytes``); ``plain``: see
        :attr:`EncodedBlob.plain`."""
        text = body[:-1] + ("," if len(body) > 2 else "")
        hjson = (text + self.tail).encode()
        start = payload_start(len(hjson), self.align)
        head = bytearray(start)
        flags = self.align.bit_length() - 1 if self.blob_format == 2 else 0
        _PREFIX.pack_into(head, 0, MAGIC, self.blob_format, flags, len(hjson), 0, 0)
        head[_PREFIX.size : _PREFIX.size + len(hjson)] = hjson
        parsed = {**header, "payload_nbytes": self.payload_nbytes, "segments": self.zero_crcs}
        pieces = tuple([Piece(start + at, seg, pad) for at, seg, pad in zip(self.offsets, segments, self.pads)])
        slots = tuple([_PREFIX.size + len(text) + at for at in self.slots])
        head_arr = np.frombuffer(head, np.uint8)
        return EncodedBlob(head_arr, pieces, start + self.payload_nbytes, parsed, slots, sealed=False, plain=plain)


def _header_crc(head: np.ndarray) -> int:
    """CRC32C of a blob's head (prefix + header + padding), its own CRC field skipped."""
    data = head.data
    return crc32c.crc32c(data[_PREFIX.size :], crc32c.crc32c(data[:_CRC_AT]))


def segment_offsets(sizes: list[int], align: int = ALIGN) -> list[int]:
    """Payload-relative offsets :func:`encode` gives segments of these sizes."""
    offsets, offset = [], 0
    for size in sizes:
        offset = _align(offset, align)
        offsets.append(offset)
        offset += size
    return offsets


def _host(buf: torch.Tensor, start: int, stop: int) -> np.ndarray:
    piece = buf[start:stop]
    return (piece if piece.device.type == "cpu" else piece.cpu()).numpy()


def _extent(prefix: bytes) -> tuple[int, int, int]:
    """``(payload start, header length, stored header CRC)`` from a blob's first 24 bytes.

    Raises:
        IntegrityError: fewer than 24 bytes, bad magic or an unknown format version.
    """
    if len(prefix) < _PREFIX.size:
        raise IntegrityError(f"blob truncated: {len(prefix)} bytes, smaller than the {_PREFIX.size}-byte prefix")
    magic, version, flags, hlen, _reserved, crc = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise IntegrityError(f"bad magic {magic!r}: expected {MAGIC!r} (not a kvmem blob)")
    return payload_start(hlen, _prefix_align(version, flags)), hlen, crc


def _prefix_align(version: int, flags: int) -> int:
    """The segment alignment a blob prefix of ``version`` and ``flags`` declares.

    Raises:
        IntegrityError: an unknown format version, or flags it does not allow.
    """
    if version == 1 and flags == 0:
        return ALIGN
    if version == 2 and (1 << flags) in _ALIGNS:
        return 1 << flags
    if version not in FORMATS:
        raise IntegrityError(f"blob format version {version} is not supported: this kvmem reads {FORMATS}")
    raise IntegrityError(f"blob format {version} with flags {flags:#06x}: not a valid alignment")


def format_of(buf: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """``(format, segment alignment)`` of a blob (a tensor, or a uint8 array of its first bytes), off its prefix.

    Raises:
        IntegrityError: fewer than 24 bytes, bad magic, an unknown format or alignment.
    """
    prefix = (buf[: _PREFIX.size] if isinstance(buf, np.ndarray) else _host(buf, 0, _PREFIX.size)).tobytes()
    _extent(prefix)
    _magic, version, flags, *_ = _PREFIX.unpack(prefix)
    return version, _prefix_align(version, flags)


def _parse_head(arr: np.ndarray) -> tuple[Header, int]:
    """:func:`parse_head` of a host uint8 array (no tensor round trips: a load's fixed cost)."""
    prefix = arr[: _PREFIX.size].tobytes()
    start, hlen, stored = _extent(prefix)
    if arr.size < start:
        raise IntegrityError(f"blob truncated: header ends at byte {start}, got {arr.size} bytes")
    actual = crc32c.crc32c(arr[_PREFIX.size : start].data, crc32c.crc32c(prefix[:_CRC_AT]))
    if actual != stored:
        raise IntegrityError(f"header CRC32C mismatch: stored {stored:#010x}, computed {actual:#010x}")
    try:
        header = json.loads(arr[_PREFIX.size : _PREFIX.size + hlen].tobytes())
        # as a sealed blob holds it: (end, crc) tuples, which the garbage collector stops tracking
        table = header["segments"] = tuple([(end, crc) for end, crc in header["segments"]])
        ends = [int(end) for end, _crc in table]
        if (
            ends != sorted(ends)
            or (ends and ends[-1] != int(header["payload_nbytes"]))
            or (not ends and int(header["payload_nbytes"]) != 0)
        ):
            raise ValueError("segment table does not tile the payload")
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"blob header is not valid JSON with a segment table: {exc}") from None
    return header, start


def header_extent(head: torch.Tensor) -> int:
    """Bytes from the blob start to its payload, read off the first 24 bytes.

    Raises:
        IntegrityError: fewer than 24 bytes, bad magic or an unknown format version.
    """
    return _extent(_host(head, 0, _PREFIX.size).tobytes())[0]


def parse_head(head: torch.Tensor) -> tuple[Header, int]:
    """Check and read the header from the first bytes of a blob (at least :func:`header_extent` of them).

    Returns:
        ``(header, payload_start)``; the header's CRC has been checked.

    Raises:
        IntegrityError: bad magic or version, a truncated head, a CRC mismatch, a bad header.
    """
    if head.device.type == "cpu":
        return _parse_head(head.numpy())
    return _parse_head(_host(head, 0, min(header_extent(head), head.numel())))


def parse(buf: torch.Tensor) -> tuple[Header, int]:
    """Check the framing and header CRC of a whole blob and read its header (segments not checked).

    Returns:
        ``(header, payload_start)``.

    Raises:
        IntegrityError: bad magic, unknown format version, truncation, a bad header.
    """
    header, start = parse_head(buf)
    expected = start + int(header["payload_nbytes"])
    if expected != buf.numel():
        raise IntegrityError(f"blob truncated or padded: header says {expected} bytes, got {buf.numel()}")
    return header, start


def stored_crc(buf: torch.Tensor) -> int:
    """The header CRC32C of a blob (what the catalog records)."""
    if buf.numel() < _PREFIX.size:
        raise IntegrityError(f"blob truncated: {buf.numel()} bytes")
    return int.from_bytes(_host(buf, _CRC_AT, _PREFIX.size).tobytes(), "little")


class StreamVerifier:
    """Checks a blob's CRCs in one pass, as its bytes become available in order.

    Call :meth:`feed` each time more leading bytes of the buffer are filled (by a
    copy or a read), then :meth:`finish`. Each step is checked right after it
    arrived, while it is still in cache.
    """

    def __init__(self) -> None:
        self.header: Header | None = None
        self.start = 0
        self._pos = 0
        self._seg = 0
        self._crc = 0

    @property
    def parsed(self) -> tuple[Header, int] | None:
        """``(header, payload start)`` once the header has been checked, else ``None``."""
        return None if self.header is None else (self.header, self.start)

    def feed(self, data: np.ndarray, upto: int) -> None:
        """Bytes ``[0, upto)`` of ``data`` are in place: check what they complete.

        Raises:
            IntegrityError: the header or a completed segment does not match its CRC.
        """
        if self.header is None:
            if upto < _PREFIX.size or upto < _extent(data[: _PREFIX.size].tobytes())[0]:
                return
            self.header, self.start = _parse_head(data[:upto])
            self._pos = self.start
        table = self.header["segments"]
        while self._seg < len(table):
            end, crc = table[self._seg]
            if self._pos >= upto and self.start + end > upto:
                break  # an empty segment completes without new bytes; others wait for theirs
            stop = min(upto, self.start + end)
            self._crc = crc32c.crc32c(data[self._pos : stop].data, self._crc)
            self._pos = stop
            if stop == self.start + end:
                if self._crc != crc:
                    raise IntegrityError(
                        f"segment {self._seg} CRC32C mismatch: stored {crc:#010x}, computed {self._crc:#010x}"
                    )
                self._seg += 1
                self._crc = 0

    def finish(self, nbytes: int) -> tuple[Header, int]:
        """Check that the whole blob of ``nbytes`` was seen and every CRC matched.

        Raises:
            IntegrityError: truncated, padded, or never fed a whole header.
        """
        if self.header is None:
            raise IntegrityError(f"blob truncated: {nbytes} bytes do not hold a whole header")
        expected = self.start + int(self.header["payload_nbytes"])
        if expected != nbytes or self._seg != len(self.header["segments"]):
            raise IntegrityError(f"blob truncated or padded: header says {expected} bytes, got {nbytes}")
        return self.header, self.start


class Verified(NamedTuple):
    """A CRC-checked, caller-owned blob buffer and the ``(header, payload_start)`` its check parsed.

    ``head`` is ``None`` where the reader did not parse the header (a decoder then parses it).
    """

    buf: torch.Tensor
    head: tuple[Header, int] | None = None


def verify(buf: torch.Tensor) -> tuple[Header, int]:
    """Check every CRC of a whole CPU blob.

    Returns:
        ``(header, payload_start)``, as :func:`parse` gives them.

    Raises:
        IntegrityError: truncation, a bad header, or a segment that does not match its CRC.
    """
    checker = StreamVerifier()
    checker.feed(buf.numpy(), buf.numel())
    return checker.finish(buf.numel())


def copy_verified(
    src: torch.Tensor | np.ndarray, pin_memory: bool = False, checker: StreamVerifier | None = None
) -> torch.Tensor:
    """Copy a CPU blob and check its CRCs in the same pass.

    ``src`` is a tensor or a uint8 array (e.g. a read-only view of received bytes).
    ``checker``: a fresh verifier to check with; afterwards its ``header`` and
    ``start`` are those of the returned copy (so a load need not parse them again).

    The CRCs are computed over the *destination* one step (``_COPY_STEP``) at a
    time, while that step is still in cache, so checking costs little more than
    the copy, and the bytes checked are exactly the bytes returned.

    Raises:
        IntegrityError: the copy does not match its CRCs.
    """
    s = src if isinstance(src, np.ndarray) else src.numpy()
    n = s.size
    # NOTE: filled as a numpy array and wrapped once at the end: torch's wrappers cost as much as
    # copying and checking a small blob (a 64 KiB load from Redis)
    dst = empty_buffer(n, pin_memory) if pin_memory else None
    d = dst.numpy() if dst is not None else np.empty(n, dtype=np.uint8)
    checker = checker if checker is not None else StreamVerifier()
    for start in range(0, n, _COPY_STEP):
        stop = min(start + _COPY_STEP, n)
        d[start:stop] = s[start:stop]
        checker.feed(d, stop)
    checker.finish(n)
    return dst if dst is not None else torch.from_numpy(d)


def covering_range(header: Header, leaves: list[dict[str, Any]]) -> tuple[int, int]:
    """Payload-relative ``[lo, hi)`` of the whole CRC segments that hold ``leaves``' bytes."""
    spans = [
        (p["off"], p["off"] + p["n"])
        for leaf in leaves
        for p in (leaf["parts"].values() if "parts" in leaf else [leaf["data"]])
    ]
    first, last = min(a for a, _ in spans), max(b for _, b in spans)
    ends = [end for end, _crc in header["segments"]]  # ascending
    below = bisect.bisect_right(ends, first)
    above = bisect.bisect_left(ends, last)
    if above == len(ends):
        raise IntegrityError(f"blob header: leaf bytes end at {last}, past the last CRC segment ({ends[-1:]})")
    return (ends[below - 1] if below else 0), ends[above]


def verify_range(header: Header, data: torch.Tensor, lo: int, check: bool = True) -> None:
    """Check the CRC of every segment inside payload bytes ``[lo, lo + len(data))``.

    Raises:
        IntegrityError: a short read, or a segment that does not match its CRC.
    """
    total = int(header["payload_nbytes"])
    if lo + data.numel() > total:
        raise IntegrityError(f"range [{lo}, {lo + data.numel()}) reads past the payload end ({total} bytes)")
    if not check:
        return
    arr = _host(data, 0, data.numel())
    prev = 0
    for i, (end, crc) in enumerate(header["segments"]):
        if prev >= lo and end <= lo + data.numel():
            actual = crc32c.crc32c(arr[prev - lo : end - lo].data)
            if actual != crc:
                raise IntegrityError(f"segment {i} CRC32C mismatch: stored {crc:#010x}, computed {actual:#010x}")
        prev = end
