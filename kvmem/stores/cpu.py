"""The CPU tier: blobs in the pages of one host pool allocated when the tier opens.

A put copies the blob's bytes once, from wherever they are (a strided KV cache slice,
a file, a socket buffer), into pages of the pool (:mod:`kvmem.pool`); nothing is
allocated per entry. A load copies them once, out of the pages into the caller's
tensor. Eviction drops the entry's pages; a view handed out earlier (``get``,
``read_range``) keeps them until it is gone, so bytes once handed out never change.

Integrity: bytes enter this tier CRC-checked (read from disk or Redis) or from the
caller (whose CRCs are computed when first needed: by the write to a persistent tier,
in the same pass, or by the catalog's background flush). Loads trust the pages they
copy from; with ``verify=True`` every load checks the CRCs again (a second pass over
the bytes; see docs/design/integrity.md for its cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob, Piece, PlainTensor
from kvmem.codecs.serialization import plain_tensor
from kvmem.errors import CapacityError, IntegrityError
from kvmem.outputs import Out, mismatch
from kvmem.pool import Allocation, HostPool
from kvmem.rows import (
    TORCH_COPY_FROM,
    byte_rows,
    copy_rows,
    flat_address,
    memmove,
    nbytes_of,
    stream_copy,
    writable_rows,
)
from kvmem.stores.base import BatchWrites, LendsBlobs, OpensBlobs, SharesBuffers, VerifiedReads
from kvmem.stores.memory import MemoryTier
from kvmem.stores.readers import BlobReader, check_size, copy_part
from kvmem.threads import copy_pool

__all__ = ["CpuTier"]

_ZEROS = np.zeros(blobfmt.PAGE, dtype=np.uint8)


class _Entry(NamedTuple):
    """One stored blob: its pages, the blob they hold (head and payload are views of the pages), where
    its CRC segments end (payload offsets), and, when it is one tensor stored as it is in one run of
    pages, that tensor (``plain``, payload-relative) and the host address of the payload (``payload``).

    NOTE: few objects per entry: every one that outlives a store is scanned by each full
    garbage collection, which with torch loaded costs ~0.5 us per object on this VM; so
    ``ends`` is a tuple of ints (the collector stops tracking it) and ``plain`` is the
    encoder's shared description of the shape, not a per-entry one.
    """

    alloc: Allocation
    blob: EncodedBlob
    ends: tuple[int, ...]
    plain: PlainTensor | None
    payload: int

    @property
    def nbytes(self) -> int:
        return self.alloc.nbytes


class CpuTier(MemoryTier[_Entry], SharesBuffers, VerifiedReads, OpensBlobs, LendsBlobs, BatchWrites):
    """Host-memory tier on a :class:`~kvmem.pool.HostPool` (pinned when CUDA is present).

    Its loads lend views of its pages (:class:`~kvmem.stores.base.SharesBuffers`); the tiers
    below are written from its copy of a new entry (:class:`~kvmem.stores.base.LendsBlobs`).

    Args:
        capacity: bytes of pages this tier may use (``usage`` counts the pool's pages in use).
        verify: CRC-check every load (default: trust the pages; see the module docstring).
        eviction: the order entries leave in (``lru`` or ``arc``: :mod:`kvmem.stores.eviction`).

    Attributes:
        checks_crc: ``verify``: whether loads from this tier check CRCs.

    Pages are 4 KiB, smaller for a small tier (at least 1024 pages, 64 B at least),
    so that the unused tail of each entry's last page wastes little. The pool holds 1/16
    more than ``capacity`` (and 16 pages), for views that outlive their entry and for
    the tail of the entry being put; a put that still finds too few pages raises
    :class:`~kvmem.errors.CapacityError`, which the tiered store answers by making room
    and trying once more, then by treating the value as refused here.
    """

    def __init__(self, capacity: int, verify: bool = False, eviction: str = "lru") -> None:
        super().__init__(eviction)
        self.name = "cpu"
        self.capacity = capacity
        self.checks_crc = verify
        page = _page_bytes(capacity)
        self.pool = HostPool(capacity + capacity // 16 + 16 * page, page_bytes=page)

    # -- writes ----------------------------------------------------------------
    def put(self, key: str, blob: EncodedBlob) -> None:
        self._insert([(key, self._copy_in(blob, key))])

    def put_many(self, items: Sequence[tuple[str, EncodedBlob]]) -> None:
        """``put`` for every item; values of 1 MiB and more are copied in several at a time.

        NOTE: measured on 2 vCPUs, sixteen 32 MiB slices of a KV tensor (each a strided view):
        through torch's copy_, one after another 49-50 ms, two at a time 41 ms, a plain memcpy of the
        same bytes 41-42 ms; with streaming stores (:func:`kvmem.rows.stream_copy`) one after another
        32-34 ms, two at a time 19-27 ms. One thread does not reach memory speed.

        Raises:
            CapacityError: the pool has too few free pages for one of them; then none is put.
        """
        big = sum(blob.nbytes >= TORCH_COPY_FROM for _key, blob in items)
        if big > 1:
            entries = list(copy_pool().map(lambda item: self._copy_in(item[1], item[0]), items))
        else:
            entries = [self._copy_in(blob, key) for key, blob in items]
        self._insert([(key, entry) for (key, _blob), entry in zip(items, entries)])

    def _insert(self, entries: list[tuple[str, _Entry]]) -> None:
        with self._lock:
            for key, entry in entries:
                self._place(key, entry, entry.nbytes)

    def _copy_in(self, blob: EncodedBlob, key: str) -> _Entry:
        """``blob``'s bytes copied once into newly allocated pages, as ``key``'s entry.

        Raises:
            CapacityError: the pool has too few free pages (or none long enough for the head).
        """
        alloc = self.pool.allocate(blob.nbytes)
        base = None if alloc is None else alloc.address(0, blob.nbytes)
        spans = [] if alloc is None else alloc.array() if base is None else [alloc.pool.array(base, blob.nbytes)]
        if alloc is None or spans[0].size < min(blob.start, blob.nbytes):
            free = self.pool.free_bytes
            raise CapacityError(f"CPU tier: {blob.nbytes} bytes do not fit in the pool ({free} bytes of pages free)")
        spans[0][: blob.start] = blob.head
        for piece in blob.pieces:
            if piece.pad:
                _copy(spans, piece.offset - piece.pad, _ZEROS[: piece.pad])
            _copy(spans, piece.offset, piece.source, base)
        header, start = blob.header, blob.start
        if header is None:  # a whole blob wrapped from bytes (a promotion): its head is parsed once, here
            header, start = blobfmt.parse_head(torch.from_numpy(spans[0][: min(blob.nbytes, blob.start)]))
        else:
            header = {**header}  # NOTE: its own: sealing the pooled blob replaces its "segments"
        # NOTE: plain views of the pages: the blob's owner (the allocation) keeps them while anyone holds the blob
        if len(spans) == 1:
            pieces = [Piece(start, spans[0][start : blob.nbytes])] if blob.nbytes > start else []
        else:
            pieces, at = [], start
            for arr in alloc.array(start):
                pieces.append(Piece(at, arr))
                at += arr.size
        pooled = EncodedBlob(
            spans[0][:start], tuple(pieces), blob.nbytes, header, blob.crc_slots(), sealed=blob.sealed, owner=alloc
        )
        if self.checks_crc:
            pooled.seal()  # NOTE: verified loads need CRCs taken as the bytes came in, not when first needed
        plain = _plain(blob, header, key)
        if plain is None:
            payload = None
        elif base is not None:  # the whole blob lies in one run of pages
            payload = base + start
        else:
            payload = alloc.address(start, start + plain.offset + plain.nbytes)
        ends = tuple([int(end) for end, _crc in header["segments"]])
        return _Entry(alloc, pooled, ends, plain if payload is not None else None, payload or 0)

    # -- reads -----------------------------------------------------------------
    def lookup(self, key: str) -> _Entry | None:
        """``key``'s entry (marked recently used), or ``None``. Its ``alloc`` stays valid while it is held."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._hit(key)
            return entry

    def blob(self, key: str) -> EncodedBlob | None:
        """``key``'s blob as this tier holds it (views of its pages), for writing it elsewhere without a copy.

        Not a read: its place in the eviction order stays (a write-through or a demotion lends it)."""
        with self._lock:
            entry = self._entries.get(key)
        return None if entry is None else entry.blob

    def get(self, key: str) -> torch.Tensor | None:
        """The sealed blob: a view of its pages (one run), else a gathered copy. Never written to while it lives."""
        entry = self.lookup(key)
        return None if entry is None else self._sealed(entry)

    def read_verified(self, key: str) -> blobfmt.Verified | None:
        """``get`` with the header this tier parsed when the blob came in; CRC-checked only with ``verify``.

        Raises:
            IntegrityError: ``verify`` is on and the blob does not match its CRCs.
        """
        entry = self.lookup(key)
        if entry is None:
            return None
        buf = self._sealed(entry)
        head = blobfmt.verify(buf) if self.checks_crc else entry.blob.parsed
        return blobfmt.Verified(buf, head)

    @staticmethod
    def _sealed(entry: _Entry) -> torch.Tensor:
        entry.blob.seal()  # once per entry: its CRCs are computed from its pages when first needed
        if entry.alloc.contiguous:
            return entry.alloc.view()
        out = blobfmt.empty_buffer(entry.nbytes)
        copy_rows([out.numpy()], entry.alloc.array())
        return out

    def copy_plain(self, key: str, out: Out | None) -> tuple[Out, dict[str, Any]] | None:
        """``key``'s tensor copied once into ``out`` (a tensor, or rows: row ``i`` into ``out[i]``, ``None`` rows
        skipped; or into a new CPU tensor) and the blob's header, when the entry is one tensor stored as it is
        that ``out`` can hold and this tier does not re-check CRCs; ``None`` otherwise, with nothing written (a
        reader then loads it, or says why it cannot).

        NOTE: the loads of small tensors come this way: one lookup and one copy (~5x the copy in all); rows
        are one copy each, straight out of the pages, chosen as for a whole tensor.
        """
        entry = None if self.checks_crc else self.lookup(key)
        if entry is None or entry.plain is None:
            return None
        plain, address = entry.plain, entry.payload + entry.plain.offset
        if out is None:
            out = self._fresh(plain)
        elif mismatch(out, plain.shape, plain.dtype) is not None:
            return None
        if isinstance(out, torch.Tensor):
            self._copy_out(address, plain.nbytes, out)
        else:
            step = plain.nbytes // len(out) if out else 0
            for i, dst in enumerate(out):
                if dst is not None:
                    self._copy_out(address + i * step, step, dst)
        return out, entry.blob.header or {}

    def _copy_out(self, address: int, nbytes: int, dst: torch.Tensor) -> None:
        """Copy ``nbytes`` of the pool at host ``address`` (one run of pages) into ``dst`` (any layout, device)."""
        to = flat_address(dst) if nbytes < TORCH_COPY_FROM else None
        if to is not None:
            memmove(to, address, nbytes)
        elif not stream_copy(dst, pages := self.pool.array(address, nbytes)):
            # NOTE: strided in short rows or on a device: torch's copy (threads, strides, transfers)
            dst.copy_(torch.from_numpy(pages).view(dst.dtype).view(dst.shape))

    def _fresh(self, plain: PlainTensor) -> torch.Tensor:
        """A new tensor for a plain load of ``plain``: the pool's own pages when it is large and a run of them is
        free, else a new buffer.

        NOTE: a large new buffer costs its first-touch page faults, several times the copy itself (a 32 MiB
        load: ~0.15x a warm memcpy into fresh pages, kept alive as a caller keeps what it loads); the
        pool's pages are faulted in ahead of use and reused lowest first (see :mod:`kvmem.pool`). Leased
        pages count in :meth:`usage` until the tensor and its views are gone (as :meth:`lease`'s do), so
        loaded values share the tier's budget.
        """
        if plain.nbytes >= TORCH_COPY_FROM:
            lent = self.lease(plain.nbytes)
            if lent is not None:
                return lent.view(plain.dtype).view(plain.shape)
            return blobfmt.empty_buffer(plain.nbytes).view(plain.dtype).view(plain.shape)
        return torch.empty(plain.shape, dtype=plain.dtype)

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor | None:
        """Bytes ``[start, stop)`` of ``key``'s blob: a view of the pages when they lie in one run."""
        entry = self.lookup(key)
        if entry is None:
            return None
        stop = min(stop, entry.nbytes)
        pieces = entry.alloc.pieces(start, stop) if start < stop else []
        if len(pieces) <= 1:
            return pieces[0] if pieces else torch.empty(0, dtype=torch.uint8)
        out = blobfmt.empty_buffer(stop - start)
        copy_rows([out.numpy()], [p.numpy() for p in pieces])
        return out

    def open_blob(self, key: str) -> BlobReader | None:
        entry = self.lookup(key)
        return None if entry is None else _PoolReader(entry, self.name, self.checks_crc)

    def lease(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of the pool's pages for another user (a cache offloading KV), one contiguous tensor.

        The pages count in :meth:`usage` (so the tiered store makes room for them as for
        entries) until the tensor and every view of it are gone. ``None`` when no run of
        free pages is that long.
        """
        alloc = self.pool.allocate(nbytes)
        if alloc is None or not alloc.contiguous:
            return None
        return alloc.view(0, nbytes)

    def usage(self) -> int:
        """Bytes of the pool's pages in use: by entries, by lent pages, and by views still held.

        The pool's usage is the tier's usage, so the tiered store makes room for a put
        against the pages really free, whoever holds the others.
        """
        return self.pool.used_bytes

    def _forget(self, entry: _Entry) -> None:
        return None  # its pages go back to the pool when the last view of them goes (refcount)


class _PoolReader(BlobReader):
    """An entry's blob read in parts: one copy per part, out of the pages (held while the reader lives)."""

    lends_views = True

    def __init__(self, entry: _Entry, tier: str, verify: bool) -> None:
        self._entry = entry
        self.checks_crc = verify
        if verify:
            entry.blob.seal()
            blobfmt.parse_head(torch.from_numpy(entry.blob.head))  # the head in the pages, checked as parts are
        super().__init__((entry.blob.header, entry.blob.start), tier, entry.ends)  # type: ignore[arg-type]

    def head_bytes(self) -> np.ndarray:
        return self._entry.blob.head

    def part_into(self, part: dict[str, Any], dst: torch.Tensor) -> None:
        check_size(part, dst)
        seg_lo, crc, i = self.segment_of(part)
        lo = self.start + int(part["off"])
        hi = lo + int(part["n"])
        if self.checks_crc:
            got = blobfmt.chain_crc(self._entry.alloc.array(self.start + seg_lo, hi))
            if got != crc:
                raise IntegrityError(f"segment {i} CRC32C mismatch: stored {crc:#010x}, computed {got:#010x}")
        alloc = self._entry.alloc
        address = alloc.address(lo, hi)
        if address is not None:  # the common case: the part lies in one run of pages, one copy
            to = flat_address(dst) if hi - lo < TORCH_COPY_FROM else None
            if to is not None:
                memmove(to, address, hi - lo)
            else:
                copy_part(torch.from_numpy(alloc.pool.array(address, hi - lo)), dst)
            return
        spans = self._entry.alloc.array(lo, hi)
        rows = writable_rows(dst, min_row=0)
        if rows is None:
            tmp = blobfmt.empty_buffer(int(part["n"]))
            copy_rows([tmp.numpy()], spans)
            dst.copy_(tmp.view(dst.dtype).view(dst.shape))
        else:
            copy_rows(rows, spans)

    def read_bytes(self, lo: int, hi: int) -> torch.Tensor:
        pieces = self._entry.alloc.pieces(lo, hi) if lo < hi else []
        if len(pieces) <= 1:
            return pieces[0] if pieces else torch.empty(0, dtype=torch.uint8)
        out = blobfmt.empty_buffer(hi - lo)
        copy_rows([out.numpy()], [p.numpy() for p in pieces])
        return out


def _plain(blob: EncodedBlob, header: dict[str, Any], key: str) -> PlainTensor | None:
    """The tensor of a blob that holds one tensor stored as it is and names ``key`` as its owner (checked
    here, once): as its encoder said (``blob.plain``), else found by walking its header (a blob that came
    from a file or Redis)."""
    info = header.get("info")
    if not isinstance(info, dict) or info.get("storage_key") != key:
        return None
    if blob.plain is not None:
        return blob.plain
    found = plain_tensor(header)
    if found is None:
        return None
    leaf, part = found
    dtype = getattr(torch, str(leaf["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        return None
    return PlainTensor(dtype, tuple(int(n) for n in leaf["shape"]), int(part["off"]), int(part["n"]))


def _page_bytes(capacity: int) -> int:
    """4 KiB, or the largest power of two giving the tier at least 1024 pages (64 B at least)."""
    size = blobfmt.PAGE
    while size > 64 and capacity // size < 1024:
        size //= 2
    return size


def _copy(spans: list[np.ndarray], offset: int, src: torch.Tensor | np.ndarray, base: int | None = None) -> None:
    """Copy ``src`` (any layout) to byte ``offset`` of the pages ``spans`` (in order): one copy, no temporary.

    ``base``: the host address of the pages when they are one run (a small contiguous tensor is then one
    ``memmove``)."""
    n = nbytes_of(src)
    if not n:
        return
    if base is not None and n < TORCH_COPY_FROM and isinstance(src, torch.Tensor):
        address = flat_address(src)
        if address is not None:
            memmove(base + offset, address, n)
            return
    for span in spans:  # one span in the common case (an entry in one run of pages)
        if offset >= span.size:
            offset -= span.size
            continue
        if offset + n <= span.size:
            dst = span[offset : offset + n]
            if isinstance(src, np.ndarray) and src.dtype == np.uint8 and src.ndim == 1:
                dst[:] = src  # the head, padding: one slice assignment
            elif isinstance(src, torch.Tensor) and n >= TORCH_COPY_FROM:
                if not stream_copy(dst, src):
                    torch.from_numpy(dst).view(src.dtype).view(src.shape).copy_(src.detach())
            else:
                copy_rows([dst], byte_rows(src))
            return
        break
    copy_rows(_from(spans, offset), byte_rows(src))


def _from(spans: list[np.ndarray], offset: int) -> list[np.ndarray]:
    """``spans`` from byte ``offset`` on."""
    out = []
    for span in spans:
        if offset < span.size:
            out.append(span[offset:])
        offset = max(0, offset - span.size)
    return out
