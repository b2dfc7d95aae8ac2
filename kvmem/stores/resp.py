"""A RESP command packer that sends a blob's large parts to the socket from where they lie (no joined copy)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from redis.connection import Encoder, PythonRespSerializer

__all__ = ["GATHER_FROM", "Gathered", "GatherPacker"]

GATHER_FROM = 64 * 1024  # blob parts this large are sent from where they lie; smaller ones are copied into
# the command's framing (a copy of a few KiB costs less than a send of its own)


class Gathered:
    """A value redis-py sends as its parts, one after another: the bytes are never joined in memory."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Sequence[np.ndarray], nbytes: int) -> None:
        self.parts, self.nbytes = parts, nbytes


class GatherPacker(PythonRespSerializer):
    """redis-py's RESP packer (``command_packer=``) that also frames a :class:`Gathered` argument.

    NOTE: redis-py writes each item of a packed command with its own ``sendall``: the large parts of a
    blob go straight from the codec's buffers to the socket, as a ``bytes`` value would, so ``put``
    costs no joined copy of the blob (33.5 MB per KV chunk).
    """

    def __init__(self) -> None:
        super().__init__(6000, Encoder("utf-8", "strict", False).encode)  # redis-py's defaults

    def pack(self, *args: object) -> list[bytes | memoryview]:
        if not any(isinstance(a, Gathered) for a in args):
            return super().pack(*args)
        out: list[bytes | memoryview] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if not isinstance(arg, Gathered):
                data = self.encode(arg)
                buff += b"$%d\r\n%s\r\n" % (len(data), data)
                continue
            buff += b"$%d\r\n" % arg.nbytes
            for part in arg.parts:
                if part.size < GATHER_FROM:
                    buff += part.tobytes()
                else:
                    out += [buff, part.data]
                    buff = b""
            buff += b"\r\n"
        out.append(buff)
        return out
