"""Values <-> blobs: flatten a value, run each tensor through its codec, frame it.

A value is a tensor, a numpy array, ``bytes``, ``str``, a JSON scalar, or a
dict (``str`` keys) / list / tuple nesting of those. Its structure goes into
the JSON header; array bytes go into aligned payload segments, so decoding a
lossless tensor is a zero-copy view of the blob buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quote
from typing import Any, NamedTuple

import numpy as np
import torch

from kvmem import blob
from kvmem.codecs import LZ4, CodecSpec, tensor_codec
from kvmem.codecs.cast import CastCodec
from kvmem.errors import IntegrityError, UnsupportedValueError
from kvmem.rows import Source, nbytes_of

__all__ = [
    "encode_value",
    "decode_value",
    "decode_tensor_range",
    "tensor_parts_range",
    "value_kind",
    "check_owner",
    "plain_tensor",
    "stored_as_is",
    "torch_dtype",
]

_KEY_NAMES = frozenset({"k", "key", "keys", "key_states", "key_cache"})
_LZ4_MIN_GAIN = 0.97  # keep the lz4 output only when it saves at least 3 %


@dataclass
class _Leaf:
    kind: str  # tensor | ndarray | bytes | str
    obj: Any
    axis: int = -1


@dataclass
class _Segments:
    align: int = blob.ALIGN
    arrays: list[Source] = field(default_factory=list)
    offset: int = 0

    def add(self, src: Source, itemsize: int, spec: CodecSpec) -> dict[str, Any]:
        """Lay out ``src`` (bytes of any layout; kept as it is unless lz4 compresses it) as the next segment."""
        entry: dict[str, Any] = {}
        size = nbytes_of(src)
        if spec.lz4 and size:
            raw = src if isinstance(src, np.ndarray) else _contiguous_bytes(src)
            packed = LZ4.compress(raw, itemsize)
            if packed.size < size * _LZ4_MIN_GAIN:
                entry = {"raw": size, "shuffle": itemsize}
                src, size = packed, packed.size
        self.offset = -(-self.offset // self.align) * self.align
        entry.update(off=self.offset, n=size)
        self.offset += size
        self.arrays.append(src)
        return entry


def value_kind(value: object) -> str:
    """``tensor``, ``ndarray``, ``bytes``, ``str``, ``json`` or ``tree``: what ``kvmem ls`` shows."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, np.ndarray):
        return "ndarray"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(value, str):
        return "str"
    return "tree"


def _flatten(value: object, path: str, leaves: list[_Leaf], axis_hint: int) -> Any:
    if isinstance(value, torch.Tensor):
        leaves.append(_Leaf("tensor", value, axis_hint))
        return {"T": len(leaves) - 1}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise UnsupportedValueError(
                f"numpy array of dtype {value.dtype} at {path or 'value'}: "
                "object arrays cannot be stored; use a numeric dtype"
            )
        leaves.append(_Leaf("ndarray", value))
        return {"N": len(leaves) - 1}
    if isinstance(value, (bytes, bytearray, memoryview)):
        leaves.append(_Leaf("bytes", bytes(value)))
        return {"B": len(leaves) - 1}
    if isinstance(value, str):
        leaves.append(_Leaf("str", value.encode("utf-8", "surrogatepass")))
        return {"S": len(leaves) - 1}
    if value is None or isinstance(value, (bool, int, float)):
        return {"J": value}
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedValueError(
                    f"dict key {k!r} ({type(k).__name__}) at {path or 'value'}: dict keys must be str"
                )
            hint = -2 if k.lower() in _KEY_NAMES else axis_hint
            items.append([k, _flatten(v, f"{path}[{k!r}]", leaves, hint)])
        return {"D": items}
    if isinstance(value, (list, tuple)):
        tag = "L" if isinstance(value, list) else "U"
        return {tag: [_flatten(v, f"{path}[{i}]", leaves, axis_hint) for i, v in enumerate(value)]}
    raise UnsupportedValueError(
        f"value of type {type(value).__name__} at {path or 'value'}: accepted torch.Tensor, numpy.ndarray, "
        "bytes, str, int, float, bool, None, and dict (str keys) / list / tuple of those"
    )


def _contiguous_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def _encode_tensor(t: torch.Tensor, axis: int, spec: CodecSpec, segs: _Segments) -> dict[str, Any]:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    name = spec.tensor if t.is_floating_point() else "none"
    codec = tensor_codec(name)
    # a lossless or pass-through leaf keeps its layout (a KV cache slice is copied once, by the tier
    # that takes it); a codec that computes from the values gets contiguous input
    parts, meta = codec.encode(t if _passes_through(codec, t) else t.contiguous(), axis)
    entry: dict[str, Any] = {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "codec": name,
        "meta": meta,
        "parts": {},
    }
    for pname, p in parts.items():
        entry["parts"][pname] = {
            "dtype": str(p.dtype).removeprefix("torch."),
            "shape": list(p.shape),
            **segs.add(p, p.element_size(), spec),
        }
    return entry


def _passes_through(codec: Any, t: torch.Tensor) -> bool:
    """Whether ``codec`` stores ``t`` as it is (``none``; ``fp16``/``bf16`` of a 16-bit tensor)."""
    return codec.name == "none" or (isinstance(codec, CastCodec) and t.element_size() <= 2)


def encode_value(
    value: object,
    spec: CodecSpec,
    metadata: dict[str, Any] | None = None,
    info: dict[str, Any] | None = None,
    blob_format: int = blob.FORMAT_VERSION,
) -> tuple[blob.EncodedBlob, int]:
    """Encode ``value`` as a blob.

    Args:
        value: what to store (see the module docstring).
        spec: the codec to apply to floating-point tensors (other leaves are lossless).
        metadata: the caller's JSON-able metadata, stored in the header.
        info: kvmem's own facts about the entry (namespace, key preview), stored in the header.
        blob_format: the blob format to write (:data:`kvmem.blob.FORMATS`).

    Returns:
        ``(blob, raw_nbytes)``: the encoded blob and the value's uncompressed array bytes.

    Raises:
        UnsupportedValueError: a type kvmem cannot store, or metadata that is not JSON.
    """
    if isinstance(value, torch.Tensor):
        plain = _encode_plain(value, spec, metadata, info, blob_format)
        if plain is not None:
            return plain
    return _encode_tree(value, spec, metadata, info, blob_format)


def _encode_tree(
    value: object, spec: CodecSpec, metadata: dict[str, Any] | None, info: dict[str, Any] | None, blob_format: int
) -> tuple[blob.EncodedBlob, int]:
    """:func:`encode_value` of any value: flattened, each leaf through its codec, the header rendered."""
    leaves: list[_Leaf] = []
    tree = _flatten(value, "", leaves, -1)
    # the alignment is chosen before layout, from the raw size (compression only shrinks it)
    segs = _Segments(blob.alignment(blob_format, sum(_leaf_nbytes(leaf) for leaf in leaves)))
    entries: list[dict[str, Any]] = []
    raw = 0
    for leaf in leaves:
        if leaf.kind == "tensor":
            entries.append(_encode_tensor(leaf.obj, leaf.axis, spec, segs))
            raw += leaf.obj.numel() * leaf.obj.element_size()
        elif leaf.kind == "ndarray":
            arr = np.ascontiguousarray(leaf.obj).reshape(leaf.obj.shape)  # ascontiguousarray makes 0-d 1-d
            entries.append(
                {
                    "dtype": arr.dtype.str,
                    "shape": list(arr.shape),
                    "data": segs.add(arr.reshape(-1).view(np.uint8), arr.itemsize, spec),
                }
            )
            raw += arr.nbytes
        else:
            data = np.frombuffer(leaf.obj, dtype=np.uint8)
            entries.append({"data": segs.add(data, 1, spec)})
            raw += data.size
    header = {
        "kind": value_kind(value),
        "codec": str(spec),
        "tree": tree,
        "leaves": entries,
        "metadata": metadata or {},
        "info": info or {},
        "raw_nbytes": raw,
    }
    _check_json(metadata)
    return blob.encode(header, segs.arrays, blob_format, segs.align), raw


class _Plain(NamedTuple):
    """What every blob of one tensor stored as it is shares, for one (dtype, shape, codec, format): the
    header without ``metadata`` and ``info``, its JSON without the closing brace, and the blob's frame."""

    header: dict[str, Any]  # NOTE: shared by the blobs of this shape: read, never changed
    text: str
    frame: blob.Frame
    tensor: blob.PlainTensor


_PLAINS: dict[tuple[torch.dtype, tuple[int, ...], CodecSpec, int], _Plain | None] = {}
_MAX_PLAINS = 1024
_UNSEEN: Any = object()  # a shape not seen yet (None: seen, and its codec changes its bytes)


def _encode_plain(
    t: torch.Tensor, spec: CodecSpec, metadata: dict[str, Any] | None, info: dict[str, Any] | None, blob_format: int
) -> tuple[blob.EncodedBlob, int] | None:
    """:func:`encode_value` of a CPU tensor its codec stores as it is (lossless; fp16/bf16 of a 16-bit tensor),
    its header and frame made once per shape and only ``metadata`` and ``info`` rendered per call; ``None`` for
    any other tensor (the general path encodes it).

    NOTE: rendering the whole header took ~15 us of a 64 KiB store here.
    """
    if spec.lz4 or not t.is_cpu:
        return None
    key = (t.dtype, tuple(t.shape), spec, blob_format)
    plain = _PLAINS.get(key, _UNSEEN)
    if plain is _UNSEEN:
        plain = _plain_of(t, spec, blob_format)
        if len(_PLAINS) >= _MAX_PLAINS:
            _PLAINS.clear()
        _PLAINS[key] = plain
    if plain is None:
        return None
    if metadata is not None:
        _check_json(metadata)
    varying = {"metadata": metadata or {}, "info": info or {}}
    body = f'{plain.text},"metadata":{_json(varying["metadata"])},"info":{_json(varying["info"])}}}'
    src = t.detach() if t.requires_grad else t
    return plain.frame.blob({**plain.header, **varying}, body, (src,), plain.tensor), plain.tensor.nbytes


def _json(obj: dict[str, Any]) -> str:
    """``obj`` as the header's encoder writes it; a dict of strings (``info``) without the encoder's set-up
    (~3 us a call here, for three strings)."""
    parts = []
    for k, v in obj.items():  # NOTE: a loop, not generator expressions: this runs on every store
        if type(k) is not str or type(v) is not str:
            return blob._ENCODER.encode(obj)
        parts.append(f"{_quote(k)}:{_quote(v)}")
    return "{" + ",".join(parts) + "}"


def _plain_of(t: torch.Tensor, spec: CodecSpec, blob_format: int) -> _Plain | None:
    """The shared part of the header the general path gives ``t`` (``None``: its codec changes the bytes)."""
    if not _passes_through(tensor_codec(spec.tensor if t.is_floating_point() else "none"), t):
        return None
    encoded, raw = _encode_tree(t, spec, None, None, blob_format)
    assert encoded.header is not None
    header = {k: v for k, v in encoded.header.items() if k not in ("metadata", "info", "segments")}
    frame = blob.Frame.of([raw], blob_format, blob.alignment(blob_format, raw))
    tensor = blob.PlainTensor(t.dtype, tuple(t.shape), frame.offsets[0], raw)
    return _Plain(header, blob._ENCODER.encode(header)[:-1], frame, tensor)


def _leaf_nbytes(leaf: _Leaf) -> int:
    if leaf.kind == "tensor":
        return int(leaf.obj.numel() * leaf.obj.element_size())
    return int(leaf.obj.nbytes) if leaf.kind == "ndarray" else len(leaf.obj)


def reframe(buf: torch.Tensor, blob_format: int, head: tuple[dict[str, Any], int] | None = None) -> blob.EncodedBlob:
    """The blob in ``buf`` laid out in ``blob_format``: the same header and segment bytes, new framing.

    Encoded segments are copied as they are (a quantized tensor is never decoded and
    quantized again); only padding, offsets and CRCs change. A blob already in
    ``blob_format`` is returned as it is.

    Args:
        buf: a CPU blob whose CRCs were checked.
        blob_format: the format to write.
        head: ``(header, payload_start)`` as its check parsed them (parsed here if ``None``).

    Raises:
        IntegrityError: ``buf`` is not an intact blob, or ``blob_format`` is unknown.
    """
    header, start = head if head is not None else blob.parse(buf)
    old_format, old_align = blob.format_of(buf)
    align = blob.alignment(blob_format, int(header.get("raw_nbytes", header["payload_nbytes"])))
    if (old_format, old_align) == (blob_format, align):
        return blob.EncodedBlob.from_buffer(buf)
    payload = buf.numpy()[start:]
    starts, arrays, prev = [], [], 0
    for end, _crc in header["segments"]:
        starts.append(-(-prev // old_align) * old_align)  # a segment's bytes follow its leading padding
        arrays.append(payload[starts[-1] : end])
        prev = end
    moved = dict(zip(starts, blob.segment_offsets([a.size for a in arrays], align)))
    fresh = {k: v for k, v in header.items() if k not in ("segments", "payload_nbytes")}
    fresh["leaves"] = [_moved(leaf, moved) for leaf in header["leaves"]]
    return blob.encode(fresh, arrays, blob_format, align)


def _moved(leaf: dict[str, Any], moved: dict[int, int]) -> dict[str, Any]:
    """``leaf`` with each part's ``off`` mapped through ``moved`` (old segment start -> new)."""
    if "parts" in leaf:
        return {**leaf, "parts": {name: {**p, "off": moved[p["off"]]} for name, p in leaf["parts"].items()}}
    return {**leaf, "data": {**leaf["data"], "off": moved[leaf["data"]["off"]]}}


def _check_json(metadata: object) -> None:
    import json

    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise UnsupportedValueError(f"metadata of type {type(metadata).__name__}: expected a JSON-able dict")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(
            f"metadata is not JSON-able ({exc}): accepted dicts of str, numbers, bools, None, lists and dicts"
        ) from None


def _segment(buf: torch.Tensor, start: int, part: dict[str, Any]) -> torch.Tensor:
    seg = buf[start + part["off"] : start + part["off"] + part["n"]]
    if "raw" in part:
        host = seg if seg.device.type == "cpu" else seg.cpu()
        out = torch.from_numpy(LZ4.decompress(host.numpy(), part["raw"], part["shuffle"]))
        return out if seg.device.type == "cpu" else out.to(seg.device)
    return seg


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a blob header names.

    Raises:
        IntegrityError: no such dtype.
    """
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise IntegrityError(f"blob names an unknown torch dtype {name!r}")
    return dtype


def _tensor_parts(buf: torch.Tensor, start: int, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    parts = {}
    for pname, part in entry["parts"].items():
        seg = _segment(buf, start, part)
        parts[pname] = seg.view(torch_dtype(part["dtype"])).reshape(part["shape"])
    return parts


def _decode_tensor(buf: torch.Tensor, start: int, entry: dict[str, Any]) -> torch.Tensor:
    parts = _tensor_parts(buf, start, entry)
    dtype = torch_dtype(entry["dtype"])
    shape = tuple(entry["shape"])
    out = tensor_codec(entry["codec"]).decode(parts, entry["meta"], dtype, shape)
    return out if out.shape == shape else out.reshape(shape)


def decode_tensor_range(data: torch.Tensor, lo: int, entry: dict[str, Any]) -> torch.Tensor:
    """Decode one tensor leaf from ``data``, which holds payload bytes from offset ``lo`` on.

    For ranged reads (one layer of a KV chunk): ``data`` must cover the leaf's parts
    (see :func:`kvmem.blob.covering_range`) and have been checked by
    :func:`kvmem.blob.verify_range`. Lossless leaves are views of ``data``.
    """
    return _decode_tensor(data, -lo, entry)


def tensor_parts_range(data: torch.Tensor, lo: int, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The codec parts of one tensor leaf in ``data`` (as :func:`decode_tensor_range` takes it), not decoded.

    What the leaf's codec would decode (e.g. ``q``/``step``/``lo`` of an int8 leaf), typed
    and shaped as stored, lz4 undone; parts that were not lz4-compressed are views of ``data``.
    For callers that decode a leaf elsewhere (the fused dequantize of :mod:`kvmem.kv.stream`).
    """
    return _tensor_parts(data, -lo, entry)


def _decode_leaf(buf: torch.Tensor, start: int, entry: dict[str, Any], kind: str, copy: bool) -> object:
    if kind == "T":
        t = _decode_tensor(buf, start, entry)
        return t.clone() if copy and _within(t, buf) else t
    seg = _segment(buf, start, entry["data"])
    host = (seg if seg.device.type == "cpu" else seg.cpu()).numpy()
    if kind == "N":
        dtype = np.dtype(entry["dtype"])
        if dtype.hasobject:
            raise IntegrityError(f"blob names numpy dtype {entry['dtype']!r}: object arrays are never loaded")
        arr = host.view(dtype).reshape(entry["shape"])
        return arr.copy() if copy and "raw" not in entry["data"] else arr
    data = host.tobytes()
    return data if kind == "B" else data.decode("utf-8", "surrogatepass")


def _within(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``t`` shows bytes of ``buf`` (a lossless leaf decodes to a view of the blob)."""
    lo = buf.data_ptr()
    return t.device == buf.device and lo <= t.data_ptr() < lo + buf.numel()


def _unflatten(tree: Any, leaves: list[dict[str, Any]], buf: torch.Tensor, start: int, copy: bool) -> object:
    ((tag, body),) = tree.items()
    if tag == "J":
        return body
    if tag == "D":
        return {k: _unflatten(v, leaves, buf, start, copy) for k, v in body}
    if tag in ("L", "U"):
        items = [_unflatten(v, leaves, buf, start, copy) for v in body]
        return items if tag == "L" else tuple(items)
    return _decode_leaf(buf, start, leaves[body], tag, copy)


def decode_value(
    buf: torch.Tensor,
    device: torch.device | str | None = None,
    head: tuple[dict[str, Any], int] | None = None,
    copy: bool = False,
) -> tuple[object, dict[str, Any]]:
    """Decode a verified blob buffer. Lossless tensors are views of ``buf`` unless ``copy``.

    Args:
        buf: a contiguous uint8 blob (CRC already checked where required).
        device: move tensors there (``None``: leave them where ``buf`` is).
        head: ``(header, payload_start)`` as the CRC check of exactly these bytes parsed
            them (:class:`kvmem.blob.Verified`); ``None``: parse (and check) the header here.
        copy: ``buf`` is not the caller's (a view of a memory tier's pages): every leaf that
            would be a view of it is copied out (leaves a codec decoded are new already).

    Returns:
        ``(value, header)``.

    Raises:
        IntegrityError: the framing or header is wrong.
    """
    header, start = head if head is not None else blob.parse(buf)
    try:
        value = _unflatten(header["tree"], header["leaves"], buf, start, copy and device is None)
    except (KeyError, ValueError, TypeError, RuntimeError, AttributeError) as exc:
        raise IntegrityError(f"blob header does not describe its payload: {type(exc).__name__}: {exc}") from None
    if device is not None:
        value = _to_device(value, torch.device(device), copy)
    return value, header


def stored_as_is(leaf: dict[str, Any]) -> dict[str, Any] | None:
    """The part holding ``leaf``'s bytes as they are (no codec applied, no lz4), or ``None``."""
    parts = leaf.get("parts", {})
    data = parts.get("data") if len(parts) == 1 else None
    if data is None or "raw" in data or data.get("dtype") != leaf.get("dtype"):
        return None
    return data


def plain_tensor(header: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(leaf, part)`` of a value that is one tensor whose bytes are stored as they are, else ``None``."""
    tree = header.get("tree", {})
    if set(tree) != {"T"}:
        return None
    leaf = header["leaves"][tree["T"]]
    part = stored_as_is(leaf)
    return None if part is None else (leaf, part)


def check_owner(header: dict[str, Any], key: str) -> None:
    """Check that a blob's header names ``key`` as the storage key it was written for.

    A blob renamed, copied or swapped onto another entry's name is intact
    (its CRC matches); only the storage key recorded in its header tells it apart.

    Raises:
        IntegrityError: the header names another storage key, or none.
    """
    info = header.get("info")
    owner = info.get("storage_key") if isinstance(info, dict) else None
    if owner != key:
        raise IntegrityError(
            f"blob was written for storage key {owner!r}, not {key!r} "
            "(a file moved or copied onto another entry's name)"
        )


def _to_device(value: object, device: torch.device, copy: bool) -> object:
    if isinstance(value, torch.Tensor):
        return value.to(device, copy=copy)
    if isinstance(value, dict):
        return {k: _to_device(v, device, copy) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device, copy) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device, copy) for v in value)
    return value
