"""RESP where redis-py copies: a command packer that sends a blob's large parts to the socket from where they
lie (no joined copy), and a reader that receives a bulk reply straight into the caller's arrays."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

import crc32c
import numpy as np
import redis
from redis.connection import Encoder, PythonRespSerializer

__all__ = ["GATHER_FROM", "Gathered", "GatherPacker", "getrange_into", "read_bulk"]

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


def getrange_into(client: redis.Redis, key: str, start: int, arrays: Sequence[np.ndarray]) -> tuple[int, int]:
    """``GETRANGE key`` from ``start``, as many bytes as ``arrays`` (contiguous uint8) hold, received straight
    into them in order (:func:`read_bulk`); ``(bytes received, their CRC32C)``: fewer bytes where the value ends
    sooner (0: absent or empty), the arrays past them untouched. Each array's CRC is taken as soon as it is
    filled, while its bytes are in cache.

    Raises:
        redis.ConnectionError, redis.TimeoutError, redis.ResponseError: as :func:`read_bulk`.
    """
    crc = 0

    def arrays_for(_n: int) -> Sequence[np.ndarray]:
        nonlocal crc
        crc = 0  # NOTE: a retried command starts over
        return arrays

    def filled(view: memoryview) -> None:
        nonlocal crc
        crc = crc32c.crc32c(view, crc)

    stop = start + sum(a.size for a in arrays) - 1
    got = read_bulk(client, ("GETRANGE", key, start, stop), arrays_for, filled)
    return max(got, 0), crc


def read_bulk(
    client: redis.Redis,
    command: tuple[str | int, ...],
    arrays_for: Callable[[int], Sequence[np.ndarray]],
    filled: Callable[[memoryview], None],
) -> int:
    """Send ``command`` (one whose reply is a bulk string: ``GET``, ``GETEX``, ``GETRANGE``) and receive its reply
    straight into ``arrays_for(length)`` (contiguous uint8 arrays), in order, calling ``filled`` on each piece
    as it lands; the reply's length (the arrays hold its first bytes, up to their size), or -1 for nil.

    NOTE: redis-py's parsers return a reply as a new ``bytes`` built from the pieces they received, which a load
    then copied again: ~0.5 GB/s for 2 MiB values on loopback here, where ``recv_into`` a buffer reaches
    ~2.5 GB/s. The command goes out on a connection of the client's pool (connected, authenticated, TLS as the
    client is), with the client's retry for a connection the server closed (``arrays_for`` is called again
    then: the read starts over); the reply is read off its socket here, whole, so the connection goes back
    to the pool clean. A read that fails partway disconnects it (the rest of the reply is lost with the
    socket). ``filled`` must not raise: it runs while the reply is half read.

    Raises:
        redis.ConnectionError, redis.TimeoutError: the connection failed or the reply is not a bulk string.
        redis.ResponseError: the server answered with an error (a key holding another type).
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    try:

        def attempt() -> int:
            conn.send_command(*command)
            return _receive_bulk(conn._sock, arrays_for, filled)  # NOTE: redis-py keeps its socket private

        return conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


_LINE = 64  # a bulk reply's header, ``$<length>\r\n``, is read in pieces of this size (the rest is payload)


def _receive_bulk(
    sock: socket.socket | None,
    arrays_for: Callable[[int], Sequence[np.ndarray]],
    filled: Callable[[memoryview], None],
) -> int:
    """Read one bulk-string reply off ``sock`` into ``arrays_for(length)``: its length, or -1 for nil."""
    if sock is None:
        raise redis.ConnectionError("the connection closed before the reply")
    try:
        head = bytearray()
        while b"\r\n" not in head:
            piece = sock.recv(_LINE)
            if not piece:
                raise redis.ConnectionError("the server closed the connection mid-reply")
            head += piece
        line, _, extra = bytes(head).partition(b"\r\n")
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode("utf-8", "replace"))
        if line == b"$-1" or line == b"_":  # nil: RESP2, RESP3
            return -1
        if line[:1] != b"$":
            raise redis.ConnectionError(f"expected a bulk string reply, got {line[:16]!r}")
        n = int(line[1:])
        pending = memoryview(extra)
        placed = 0
        for arr in arrays_for(n):
            if placed == n:
                break
            view = arr.data.cast("B")[: n - placed]
            taken = min(len(pending), len(view))
            view[:taken] = pending[:taken]
            pending = pending[taken:]
            _recv_exactly(sock, view[taken:])
            filled(view)
            placed += len(view)
        rest = n - placed + 2 - len(pending)  # NOTE: what the arrays could not hold, and the reply's \r\n
        if rest < 0:
            raise redis.ConnectionError("the reply ran past its stated length")
        _recv_exactly(sock, memoryview(bytearray(rest)))
        return n
    except TimeoutError as exc:
        raise redis.TimeoutError(f"timeout reading a reply: {exc}") from exc
    except OSError as exc:
        raise redis.ConnectionError(f"error reading a reply: {exc}") from exc


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view)
        if not got:
            raise redis.ConnectionError("the server closed the connection mid-reply")
        view = view[got:]
