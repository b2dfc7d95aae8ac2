"""Reading one version of a blob in parts: its header first, then the parts a caller needs, into its tensors.

A load into the caller's tensor (``Memory.load(key, out=t)``) and the layer-wise KV
loader both read a blob part by part: they parse the header, then want one tensor
leaf's bytes, or one layer's, in a tensor of their own (a slice of the model's cache).
A :class:`BlobReader` is that access, opened once per blob so that every part comes
from the same version of it (a file stays open; a memory tier's pages stay held):

- :meth:`BlobReader.part_into` puts a part's bytes straight into a tensor of any
  layout: one copy from a memory tier's pages, one ``preadv`` from a file, one
  ``recv_into`` from Redis, with the part's CRC segment checked in the same pass where
  the tier checks CRCs;
- :meth:`BlobReader.read` returns whole CRC segments, checked, for parts a codec
  must decode first (int8/int4, lz4);
- :meth:`BlobReader.rows_into` puts a part's bytes into several tensors (the rows of
  a "scatter load" into a paged KV cache's blocks): read straight into them from a
  file or a socket, else its segment read and checked once, then one copy per row.

:class:`RangeReader` reads a blob by ranges through a tier's ``read_range`` (Redis,
the GPU tier); :class:`FileReader` reads a file; the CPU tier has a reader of its own
over its pages. :class:`GuardedReader` wraps any of them so that a tier fault in a read
gets the tiered store's failure handling (counted, tier backed off).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import crc32c
import numpy as np
import torch

from kvmem import blob as blobfmt
from kvmem.errors import IntegrityError
from kvmem.rows import TORCH_COPY_FROM, copy_rows, steps, stream_copy, writable_rows
from kvmem.stores.files import preadv_all

__all__ = [
    "BlobReader",
    "FileReader",
    "Guard",
    "GuardedReader",
    "RangeReader",
    "check_rows",
    "check_size",
    "copy_part",
    "open_by_ranges",
]

Header = dict[str, Any]
T = TypeVar("T")
_STEP = 1 << 20  # read 1 MiB, then CRC it while it is still in cache


class BlobReader:
    """One version of one blob, for partial reads (a tier's reader implements :meth:`read_bytes` and
    :meth:`head_bytes`; checking, part placement and segment lookup are shared).

    Args:
        head: ``(header, payload_start)``, the header parsed (and checked where the tier checks CRCs).
        tier: name of the tier it came from.
        ends: where the CRC segments end (payload offsets), when the caller has them already.

    Attributes:
        header, start: the parsed header and the payload's offset.
        tier: the serving tier's name.
        checks_crc: whether the parts read are CRC-checked here.
        lends_views: whether :meth:`read` lends views of a tier's memory rather than new bytes.
        fills: whether parts are read straight into the caller's tensors (:meth:`_fill`: a file, a socket).
    """

    checks_crc = False
    lends_views = False  # True where read() lends views of a tier's memory (no copy), not new bytes
    fills = False

    def __init__(self, head: tuple[Header, int], tier: str, ends: list[int] | None = None) -> None:
        self.header, self.start = head
        self.tier = tier
        self._ends = ends if ends is not None else [int(end) for end, _crc in self.header["segments"]]

    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def segment_of(self, part: dict[str, Any]) -> tuple[int, int, int]:
        """``(first byte, CRC, index)`` of the CRC segment that ends where ``part`` (``{"off", "n"}``) ends.

        Raises:
            IntegrityError: no segment ends there (the header does not describe its payload).
        """
        end = int(part["off"]) + int(part["n"])
        i = bisect.bisect_left(self._ends, end)
        if i == len(self._ends) or self._ends[i] != end or int(part["off"]) < (self._ends[i - 1] if i else 0):
            raise IntegrityError(f"blob header: a part ending at payload byte {end} is not a whole segment")
        return (self._ends[i - 1] if i else 0), int(self.header["segments"][i][1]), i

    def head_bytes(self) -> np.ndarray:
        """The blob's first ``start`` bytes (prefix, header, padding) as read."""
        raise NotImplementedError

    def part_into(self, part: dict[str, Any], dst: torch.Tensor) -> None:
        """Put the bytes of ``part`` (a leaf's ``{"off", "n"}``, not lz4-compressed) into ``dst``.

        Raises:
            IntegrityError: ``dst`` does not hold exactly ``part["n"]`` bytes, or the part's segment
                fails its CRC.
        """
        check_size(part, dst)
        rows = writable_rows(dst) if self.fills else None
        if rows is not None:
            self._fill_part(part, rows)
            return
        seg_lo, _crc, _i = self.segment_of(part)
        # NOTE: the whole segment is read (its leading padding is at most one alignment unit), so that
        # its CRC is checked before a byte of it reaches dst (``read`` checks where the tier needs it)
        data = self.read(seg_lo, int(part["off"]) + int(part["n"]))
        copy_part(data[int(part["off"]) - seg_lo :], dst)

    def rows_into(self, part: dict[str, Any], rows: Sequence[torch.Tensor | None]) -> None:
        """Put the bytes of ``part`` into ``rows``: its ``i``-th ``1/len(rows)`` into ``rows[i]`` (``None``: skipped).

        Where the tier reads straight into arrays (:attr:`fills`), the rows are read into and their segment
        checked as they arrive; else the segment is read once (:meth:`read`: a view of a memory tier's pages)
        and checked before a byte of it reaches a row, then each row is one copy out of it.

        Raises:
            IntegrityError: the rows do not hold exactly ``part["n"]`` bytes, or the segment fails its CRC.
        """
        step = check_rows(part, rows)
        arrays = _row_arrays(rows, step) if self.fills else None
        if arrays is not None:
            self._fill_part(part, arrays)
            return
        seg_lo, _crc, _i = self.segment_of(part)
        data = self.read(seg_lo, int(part["off"]) + int(part["n"]))
        at = int(part["off"]) - seg_lo
        for i, dst in enumerate(rows):
            if dst is not None:
                copy_part(data[at + i * step : at + (i + 1) * step], dst)

    def _fill_part(self, part: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Read ``part``'s segment straight into ``arrays`` (the segment's leading padding first, into a buffer
        of its own) and check its CRC.

        NOTE: the bytes reach the caller's tensors before the check; a failed check raises, and the load is a
        miss whose tensors hold no value (a KV cache recomputes those blocks).

        Raises:
            IntegrityError: the blob ends before the part does, or the segment fails its CRC.
        """
        seg_lo, crc, i = self.segment_of(part)
        end = int(part["off"]) + int(part["n"])
        pad = blobfmt.empty_buffer(int(part["off"]) - seg_lo).numpy()
        got, computed = self._fill(self.start + seg_lo, [pad, *arrays])
        if got != end - seg_lo:  # NOTE: else arrays keep what they held: it may match the CRC
            raise IntegrityError(
                f"blob in tier {self.tier} truncated: payload bytes [{seg_lo}, {end}) end at {seg_lo + got}"
            )
        if computed != crc:
            raise IntegrityError(f"segment {i} CRC32C mismatch: stored {crc:#010x}, computed {computed:#010x}")

    def _fill(self, at: int, arrays: list[np.ndarray]) -> tuple[int, int]:
        """Blob bytes from ``at`` into ``arrays`` (contiguous uint8), in order: ``(bytes read, their CRC32C)``,
        fewer bytes where the blob ends sooner. Readers with :attr:`fills` implement it."""
        raise NotImplementedError

    def read_bytes(self, lo: int, hi: int) -> torch.Tensor:
        """Blob bytes ``[lo, hi)`` (fewer if the blob is shorter), unchecked: :meth:`read` checks."""
        raise NotImplementedError

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Payload bytes ``[lo, hi)``, whole CRC segments (see :func:`kvmem.blob.covering_range`), checked.

        Raises:
            IntegrityError: a short read, or a segment that does not match its CRC.
        """
        data = self.read_bytes(self.start + lo, self.start + hi)
        if data.numel() != hi - lo:
            raise IntegrityError(
                f"blob in tier {self.tier} truncated: payload bytes [{lo}, {hi}) read as {data.numel()} bytes"
            )
        blobfmt.verify_range(self.header, data, lo, check=self.checks_crc)
        return data

    def advise(self, lo: int, hi: int) -> None:
        """A hint: payload bytes ``[lo, hi)`` will be read soon. Nothing to do in memory."""
        return None

    def close(self) -> None:
        """Release what the reader holds (a file descriptor, pages)."""
        return None


class RangeReader(BlobReader):
    """A blob read by ranges through its tier's ``read_range`` (a remote or device tier): the header first,
    then only the parts asked for, so a layer-wise load streams from it too.

    NOTE: the parts come from separate reads; a blob rewritten between them fails the CRC of
    the part that changed (content-hash keys, KV chunks among them, never change).

    Args:
        read_range: ``(start, stop) -> bytes or None`` of the blob.
        tier: name of the tier.
        checks_crc: whether the tier's bytes must be CRC-checked.
        head: the blob's first bytes, as read.
        read_into: ``(start, arrays) -> (bytes read, their CRC32C)``: the blob's bytes from ``start`` received
            straight into ``arrays`` (a socket), where the tier can.

    Raises:
        IntegrityError: the head is not an intact blob header (or the blob went between reads).
    """

    def __init__(
        self,
        read_range: Callable[[int, int], torch.Tensor | None],
        tier: str,
        checks_crc: bool,
        head: torch.Tensor,
        read_into: Callable[[int, list[np.ndarray]], tuple[int, int]] | None = None,
    ) -> None:
        self._read_range = read_range
        self._read_into = read_into
        self.fills = read_into is not None
        self.checks_crc = checks_crc
        extent = blobfmt.header_extent(head)
        if extent > head.numel():
            head = self.read_bytes(0, extent)
        super().__init__(blobfmt.parse_head(head), tier)
        self._head = head[: self.start].cpu().numpy()

    def head_bytes(self) -> np.ndarray:
        return self._head

    def read_bytes(self, lo: int, hi: int) -> torch.Tensor:
        got = self._read_range(lo, hi)
        if got is None:
            raise IntegrityError(f"blob went from tier {self.tier} while it was being read")
        return got

    def _fill(self, at: int, arrays: list[np.ndarray]) -> tuple[int, int]:
        assert self._read_into is not None
        return self._read_into(at, arrays)


def open_by_ranges(
    read_range: Callable[[int, int], torch.Tensor | None],
    tier: str,
    checks_crc: bool,
    read_into: Callable[[int, list[np.ndarray]], tuple[int, int]] | None = None,
) -> RangeReader | None:
    """A :class:`RangeReader` over ``read_range`` (one blob's ``(start, stop) -> bytes or None``) and, where the
    tier has it, ``read_into``; ``None`` when the blob is absent.

    Raises:
        IntegrityError: the head is not an intact blob header.
    """
    head = read_range(0, blobfmt.HEAD_PROBE)
    return None if head is None else RangeReader(read_range, tier, checks_crc, head, read_into)


class Guard(Protocol):
    """Runs one read under its tier's failure handling (see :meth:`kvmem.stores.tiered.TieredStore.open_blob`)."""

    def __call__(self, fn: Callable[[], T]) -> T: ...


class GuardedReader(BlobReader):
    """Another tier's reader whose reads all run through ``guard``: the tiered store's failure handling.

    Args:
        inner: the tier's reader (closed by :meth:`close`).
        guard: runs a read; raises ``TierUnavailable`` when the tier fails (counted, backed off) or is skipped.
    """

    def __init__(self, inner: BlobReader, guard: Guard) -> None:
        super().__init__((inner.header, inner.start), inner.tier, inner._ends)
        self.checks_crc = inner.checks_crc
        self.lends_views = inner.lends_views
        self._inner = inner
        self._guard = guard

    def head_bytes(self) -> np.ndarray:
        return self._inner.head_bytes()

    def part_into(self, part: dict[str, Any], dst: torch.Tensor) -> None:
        self._guard(lambda: self._inner.part_into(part, dst))

    def rows_into(self, part: dict[str, Any], rows: Sequence[torch.Tensor | None]) -> None:
        self._guard(lambda: self._inner.rows_into(part, rows))

    def read_bytes(self, lo: int, hi: int) -> torch.Tensor:
        return self._guard(lambda: self._inner.read_bytes(lo, hi))

    def read(self, lo: int, hi: int) -> torch.Tensor:
        return self._guard(lambda: self._inner.read(lo, hi))

    def advise(self, lo: int, hi: int) -> None:
        self._inner.advise(lo, hi)  # a hint, which never fails (a failing read that follows is handled)

    def close(self) -> None:
        self._inner.close()


class FileReader(BlobReader):
    """A blob file opened once: the header read and CRC-checked, then parts read straight into tensors.

    Args:
        fd: an open descriptor of the file (closed by :meth:`close`).
        tier: name of the tier.

    Raises:
        IntegrityError: the file's head is not an intact blob header.
        OSError: the read failed.
    """

    checks_crc = True
    fills = True

    def __init__(self, fd: int, tier: str) -> None:
        self._fd = fd  # owned from here on: closed by close(), also when this constructor fails
        try:
            head = _pread(fd, 0, blobfmt.HEAD_PROBE)
            extent = blobfmt.header_extent(head)
            if extent > head.numel():
                head = _pread(fd, 0, extent)
            super().__init__(blobfmt.parse_head(head), tier)
        except BaseException:
            self.close()
            raise
        self._head = head[: self.start].numpy()

    def head_bytes(self) -> np.ndarray:
        return self._head

    def _fill(self, at: int, arrays: list[np.ndarray]) -> tuple[int, int]:
        """One ``preadv`` per step (about 1 MiB), each step CRC'd before the next is read."""
        total = sum(a.size for a in arrays)
        if total > _STEP:
            # NOTE: a cold file read in steps gets the kernel's readahead, which starts at a few pages; asked
            # for the whole part first, the disk gets it in large requests (measured: 16 cold 32 MiB chunks,
            # 0.53-0.56 s -> 0.35 s, as fast as 4 threads of raw readinto); a warm file pays a page-cache walk
            self.advise(at - self.start, at - self.start + total)
        got = crc = 0
        for group in steps(arrays, _STEP):
            n = preadv_all(self._fd, group, at + got)
            got += n
            if n != sum(row.size for row in group):
                break
            for row in group:
                crc = crc32c.crc32c(row.data, crc)
        return got, crc

    def read_bytes(self, lo: int, hi: int) -> torch.Tensor:
        return _pread(self._fd, lo, hi)

    def advise(self, lo: int, hi: int) -> None:
        """Start reading payload bytes ``[lo, hi)`` into the page cache (``POSIX_FADV_WILLNEED``).

        The kernel submits the whole range at once; a cold ``pread`` instead ramps
        its readahead up from a few pages.
        """
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd, self.start + lo, max(0, hi - lo), os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # a hint only: the read that follows does the work, or reports the failure

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


def copy_part(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the bytes ``src`` (uint8, contiguous) into ``dst`` (any layout and device): one copy."""
    if not dst.numel() or stream_copy(dst, src):
        return
    rows = writable_rows(dst, min_row=0) if src.numel() < TORCH_COPY_FROM and src.is_cpu else None
    if rows is not None:
        copy_rows(rows, [src.numpy()])
    else:
        dst.copy_(src.view(dst.dtype).view(dst.shape))


def _row_arrays(rows: Sequence[torch.Tensor | None], step: int) -> list[np.ndarray] | None:
    """The arrays a read fills for ``rows`` of ``step`` bytes each: each row's contiguous runs, a buffer of its own
    for each ``None`` row (read into and dropped: one ``preadv`` fills several arrays before their CRC is taken);
    ``None`` where a row cannot be read into (not host memory, or no contiguous runs)."""
    skipped = blobfmt.empty_buffer(step * sum(row is None for row in rows)).numpy()
    out: list[np.ndarray] = []
    for row in rows:
        if row is None:
            out.append(skipped[:step])
            skipped = skipped[step:]
            continue
        runs = writable_rows(row)
        if runs is None:
            return None
        out += runs
    return out


def check_size(part: dict[str, Any], dst: torch.Tensor) -> None:
    if "raw" in part or int(part["n"]) != dst.numel() * dst.element_size():
        raise IntegrityError(
            f"a part of {part['n']} bytes{' (lz4)' if 'raw' in part else ''} cannot be read "
            f"into a tensor of {dst.numel() * dst.element_size()} bytes"
        )


def check_rows(part: dict[str, Any], rows: Sequence[torch.Tensor | None]) -> int:
    """Bytes per row when ``part`` splits evenly into ``rows`` and each given row holds that many.

    Raises:
        IntegrityError: it does not (the header does not describe a tensor of that many rows), or is lz4.
    """
    n = int(part["n"])
    step = n // len(rows) if rows else 0
    sizes = {dst.numel() * dst.element_size() for dst in rows if dst is not None}
    if "raw" in part or step * len(rows) != n or not sizes <= {step}:
        raise IntegrityError(
            f"a part of {n} bytes{' (lz4)' if 'raw' in part else ''} cannot be read into "
            f"{len(rows)} rows of {sorted(sizes)} bytes"
        )
    return step


def _pread(fd: int, lo: int, hi: int) -> torch.Tensor:
    """Bytes ``[lo, hi)`` of ``fd`` (fewer at its end) in a new buffer."""
    buf = blobfmt.empty_buffer(max(0, hi - lo))
    got = preadv_all(fd, [buf.numpy()], lo) if buf.numel() else 0
    return buf[:got]
