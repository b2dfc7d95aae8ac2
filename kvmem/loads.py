"""Loads into the caller's tensors: a stored tensor's bytes go straight into ``out``.

A lossless tensor (codec ``none``, or ``fp16``/``bf16`` of a tensor that already had
that dtype) is read in one copy, from a memory tier's pages or a file, into ``out``,
whatever its layout (a slice of a KV cache). Other codecs decode first, then copy.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmem import blob as blobfmt
from kvmem.blob import EncodedBlob, Piece
from kvmem.codecs.serialization import check_owner, decode_tensor_range, stored_as_is
from kvmem.errors import OutputMismatch
from kvmem.stores.readers import BlobReader

__all__ = ["check_out", "copy_into", "fill", "read_back"]


def check_out(out: object) -> torch.Tensor:
    """``out`` if it is a tensor a load can write into.

    Raises:
        OutputMismatch: anything else.
    """
    if not isinstance(out, torch.Tensor):
        raise OutputMismatch(f"out={type(out).__name__}: expected a torch.Tensor to load the value into")
    return out


def copy_into(out: torch.Tensor, value: object) -> torch.Tensor:
    """``out`` after copying ``value`` (a tensor of its shape and dtype, e.g. a regenerated value) into it.

    Raises:
        OutputMismatch: ``value`` is not such a tensor.
    """
    if not isinstance(value, torch.Tensor) or value.shape != out.shape or value.dtype != out.dtype:
        what = f"{list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise OutputMismatch(f"out of shape {list(out.shape)} and dtype {out.dtype} cannot hold {what}")
    return out.copy_(value)


def fill(reader: BlobReader, skey: str, out: torch.Tensor) -> dict[str, Any]:
    """Write the tensor stored in ``reader``'s blob into ``out``; the blob's header.

    Raises:
        IntegrityError: the blob is not ``skey``'s, or a part read fails its CRC.
        OutputMismatch: the value is not one tensor of ``out``'s shape and dtype (``out`` untouched).
    """
    header = reader.header
    check_owner(header, skey)
    leaf = _tensor_leaf(header, out)
    part = stored_as_is(leaf)
    if part is not None:
        reader.part_into(part, out)
        return header
    lo, hi = blobfmt.covering_range(header, [leaf])
    out.copy_(decode_tensor_range(reader.read(lo, hi), lo, leaf))
    return header


def read_back(reader: BlobReader, out: torch.Tensor) -> EncodedBlob | None:
    """The blob :func:`fill` just read, rebuilt from its head and ``out`` (to promote it without reading it
    again); ``None`` unless ``out`` holds its whole payload (one tensor stored as it is)."""
    header = reader.header
    part = stored_as_is(header["leaves"][0])
    if part is None or len(header["segments"]) != 1:
        return None
    pad = int(part["off"])  # the one segment starts at payload byte 0: its leading padding is the offset
    piece = Piece(reader.start + pad, out if out.device.type == "cpu" else out.cpu(), pad)
    return EncodedBlob(reader.head_bytes(), (piece,), reader.start + int(header["payload_nbytes"]), header)


def _tensor_leaf(header: dict[str, Any], out: torch.Tensor) -> dict[str, Any]:
    """The header entry of the value's one tensor, checked against ``out``."""
    tree = header.get("tree", {})
    if set(tree) != {"T"}:
        raise OutputMismatch(
            f"the stored value is a {header.get('kind', 'tree')}, not one tensor: out= needs a "
            "tensor value (load without out=)"
        )
    leaf = header["leaves"][tree["T"]]
    if out.shape != tuple(leaf["shape"]) or out.dtype != getattr(torch, str(leaf["dtype"]), None):
        raise OutputMismatch(
            f"out of shape {list(out.shape)} and dtype {str(out.dtype).removeprefix('torch.')} "
            f"cannot hold the stored tensor of shape {leaf['shape']} and dtype {leaf['dtype']}"
        )
    return leaf
