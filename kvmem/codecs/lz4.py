"""``lz4`` on top of any tensor codec, after a byte shuffle.

lz4 on raw bf16 KV compresses by 1.00x: the low byte of every element is noise.
Grouping byte 0 of every element, then byte 1, ... (a shuffle, as blosc does)
puts the compressible exponent bytes together: 1.20-1.25x on bf16 KV.
"""

from __future__ import annotations

import lz4.block
import numpy as np

from kvmem.errors import CodecError

__all__ = ["Lz4Codec"]


class Lz4Codec:
    """Byte shuffle by element width, then lz4 block compression."""

    name = "lz4"

    def compress(self, data: np.ndarray, itemsize: int) -> np.ndarray:
        if itemsize > 1 and data.size % itemsize == 0:
            data = np.ascontiguousarray(data.reshape(-1, itemsize).T)
        return np.frombuffer(lz4.block.compress(data, store_size=False, return_bytearray=True), dtype=np.uint8)

    def decompress(self, data: np.ndarray, raw_nbytes: int, itemsize: int) -> np.ndarray:
        try:
            raw = lz4.block.decompress(data, uncompressed_size=raw_nbytes, return_bytearray=True)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"lz4 segment cannot be decompressed: {exc}") from None
        out = np.frombuffer(raw, dtype=np.uint8)
        if itemsize > 1 and raw_nbytes % itemsize == 0:
            out = np.ascontiguousarray(out.reshape(itemsize, -1).T).reshape(-1)
        return out
