"""Loads into the caller's tensors: a stored tensor's bytes go straight into ``out``.

A lossless tensor (codec ``none``, or ``fp16``/``bf16`` of a tensor that already had
that dtype) is read in one copy, from a memory tier's pages or a file, into ``out``,
whatever its layout (a slice of a KV cache); into rows (see :mod:`kvmem.outputs`), its
CRC segment is read and checked once, then each row copied out of it. Other codecs
decode first, then copy.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob, Piece
from kvmem.codecs.serialization import check_owner, decode_tensor_range, stored_as_is
from kvmem.errors import OutputMismatch
from kvmem.outputs import Out, check_out, mismatch, whole
from kvmem.stores.readers import BlobReader

__all__ = ["check_out", "copy_into", "fill", "read_back"]


def copy_into(out: Out, value: object) -> Out:
    """``out`` after copying ``value`` (a tensor of its shape and dtype, e.g. a regenerated value) into it; into
    rows, row ``i`` of ``value`` goes into ``out[i]`` (``None`` rows skipped).

    Raises:
        OutputMismatch: ``value`` is not such a tensor (nothing is written).
    """
    if not isinstance(value, torch.Tensor):
        raise OutputMismatch(f"out= cannot hold a {type(value).__name__}: the value must be one tensor")
    why = mismatch(out, value.shape, value.dtype)
    if why is not None:
        raise OutputMismatch(why)
    if isinstance(out, torch.Tensor):
        return out.copy_(value)
    for row, dst in zip(value, out):
        if dst is not None:
            dst.copy_(row)
    return out


def fill(reader: BlobReader, skey: str, out: Out) -> dict[str, Any]:
    """Write the tensor stored in ``reader``'s blob into ``out`` (a tensor, or its rows); the blob's header.

    Raises:
        IntegrityError: the blob is not ``skey``'s, or a part read fails its CRC.
        OutputMismatch: the value is not one tensor ``out`` can hold (``out`` untouched).
    """
    header = reader.header
    check_owner(header, skey)
    leaf = _tensor_leaf(header, out)
    part = stored_as_is(leaf)
    if part is None:  # a codec changed the bytes: the tensor is decoded once, then copied
        lo, hi = blobfmt.covering_range(header, [leaf])
        copy_into(out, decode_tensor_range(reader.read(lo, hi), lo, leaf))
    elif isinstance(out, torch.Tensor):
        reader.part_into(part, out)
    else:
        reader.rows_into(part, out)
    return header


def read_back(reader: BlobReader, out: Out) -> EncodedBlob | None:
    """The blob :func:`fill` just read, rebuilt from its head and ``out`` (to promote it without reading it
    again); ``None`` unless ``out`` holds its whole payload (one tensor stored as it is, every row given).

    NOTE: rows make one piece each, back to back in the one CRC segment: the tier taking the blob copies
    each row once into its pages, and its CRCs are the ones the read checked (the blob stays sealed).
    """
    header = reader.header
    part = stored_as_is(header["leaves"][0])
    sources = [out] if isinstance(out, torch.Tensor) else out
    if part is None or len(header["segments"]) != 1 or not sources or not whole(out):
        return None
    pad = int(part["off"])  # the one segment starts at payload byte 0: its leading padding is the offset
    step = int(part["n"]) // len(sources)
    pieces = tuple(
        [
            Piece(reader.start + pad + i * step, src if src.device.type == "cpu" else src.cpu(), pad if i == 0 else 0)
            for i, src in enumerate(sources)
            if src is not None
        ]
    )
    return EncodedBlob(reader.head_bytes(), pieces, reader.start + int(header["payload_nbytes"]), header)


def _tensor_leaf(header: dict[str, Any], out: Out) -> dict[str, Any]:
    """The header entry of the value's one tensor, checked against ``out``."""
    tree = header.get("tree", {})
    if set(tree) != {"T"}:
        raise OutputMismatch(
            f"the stored value is a {header.get('kind', 'tree')}, not one tensor: out= needs a "
            "tensor value (load without out=)"
        )
    leaf = header["leaves"][tree["T"]]
    dtype = getattr(torch, str(leaf["dtype"]), None)
    why = mismatch(out, leaf["shape"], dtype if isinstance(dtype, torch.dtype) else None)
    if why is not None:
        raise OutputMismatch(why)
    return leaf
