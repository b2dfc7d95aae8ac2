"""Image inputs: their content hash, and decoding them for an encoder.

An image may come as encoded bytes (PNG, JPEG, ... as read from a file or a
request), a file path, or a decoded ``PIL.Image``:

- bytes and paths are hashed as they are (sha256 of the file's bytes: 0.05 ms
  for a 640x480 JPEG), without decoding; a path and the bytes of its file share
  one hash;
- a ``PIL.Image`` is hashed by mode, size, palette and pixel bytes.

So the same picture given once as PNG bytes and once as the decoded image gets
two hashes (and two cache entries with equal tokens): hashing pixels would
mean decoding every input, and hashing bytes of a re-encoding would depend on
the encoder. Decoding applies the EXIF orientation (the picture as a viewer
shows it), so rotated JPEGs encode upright; a ``PIL.Image`` is taken as given.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Union

from PIL import Image, ImageOps, UnidentifiedImageError

from kvmem.errors import UnsupportedValueError

__all__ = ["ImageInput", "decode_image", "image_digest"]

ImageInput = Union[Image.Image, bytes, bytearray, memoryview, str, os.PathLike]  # noqa: UP007  a runtime alias
_ACCEPTED = "a PIL.Image, encoded image bytes, or a path to an image file"


def _read(path: str | os.PathLike[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UnsupportedValueError(
            f"image {os.fspath(path)!r}: cannot be read ({exc.strerror}); accepted: {_ACCEPTED}"
        ) from None


def _raw(image: ImageInput) -> bytes | None:
    """The encoded bytes of ``image``, or None for a decoded image."""
    if isinstance(image, Image.Image):
        return None
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        return _read(image)
    raise UnsupportedValueError(f"image of type {type(image).__name__}: accepted {_ACCEPTED}")


def image_digest(image: ImageInput) -> str:
    """sha256 hex of ``image``'s encoded bytes, or of a decoded image's mode, size, palette and pixels.

    Raises:
        UnsupportedValueError: not an image input, or a path that cannot be read.
    """
    raw = _raw(image)
    if raw is not None:
        return hashlib.sha256(b"kvmem/image/bytes\0" + raw).hexdigest()
    assert isinstance(image, Image.Image)
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    head = json.dumps({"mode": image.mode, "size": list(image.size), "palette": palette}).encode()
    h = hashlib.sha256(b"kvmem/image/pixels\0" + head + b"\0")
    h.update(image.tobytes())
    return h.hexdigest()


def decode_image(image: ImageInput) -> Image.Image:
    """``image`` as a loaded RGB ``PIL.Image`` (bytes and files upright by their EXIF orientation).

    Raises:
        UnsupportedValueError: not an image input, or bytes no installed decoder reads.
    """
    raw = _raw(image)
    if raw is None:
        assert isinstance(image, Image.Image)
        return image.convert("RGB")
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            return ImageOps.exif_transpose(opened).convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        where = repr(os.fspath(image)) if isinstance(image, (str, os.PathLike)) else f"of {len(raw)} bytes"
        raise UnsupportedValueError(f"image {where}: not a decodable image ({exc}); accepted: {_ACCEPTED}") from None
