"""``read_bulk`` and ``getrange_into``: a bulk reply read off a redis-py connection straight into the caller's
arrays, on a real redis-server: the bytes and their CRC, a value shorter than the arrays, nil in RESP2 and RESP3,
and a connection that goes back to the pool clean after a reply, an error reply, and a reply cut off by the
server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import crc32c
import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmem.stores.resp import getrange_into, read_bulk
from tests.servers import RedisServer

VALUE = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A client whose pool holds one connection: every call below reuses it."""
    made = redis.Redis.from_url(redis_url, max_connections=1)
    made.set("resp-test", VALUE)
    yield made
    made.delete("resp-test")
    made.close()


def _arrays(*sizes: int) -> list[np.ndarray]:
    return [np.full(n, 0xAB, dtype=np.uint8) for n in sizes]


def test_the_range_lands_in_the_arrays_in_order_with_its_crc(client: redis.Redis) -> None:
    arrays = _arrays(1000, 200_000, 7, 50_000)
    got, crc = getrange_into(client, "resp-test", 17, arrays)
    want = VALUE[17 : 17 + 251_007]
    assert got == len(want) and b"".join(a.tobytes() for a in arrays) == want
    assert crc == crc32c.crc32c(want)


def test_a_value_shorter_than_the_arrays_fills_what_it_has_and_leaves_the_rest(client: redis.Redis) -> None:
    arrays = _arrays(100, 1000, 1000)
    got, crc = getrange_into(client, "resp-test", len(VALUE) - 600, arrays)
    assert got == 600 and crc == crc32c.crc32c(VALUE[-600:])
    assert arrays[0].tobytes() == VALUE[-600:-500] and arrays[1][:500].tobytes() == VALUE[-500:]
    assert (arrays[1][500:] == 0xAB).all() and (arrays[2] == 0xAB).all()
    assert getrange_into(client, "absent", 0, _arrays(10)) == (0, 0)


def test_the_connection_goes_back_clean_after_replies_and_errors(client: redis.Redis) -> None:
    client.rpush("resp-list", b"x")
    try:
        for i in range(20):
            arrays = _arrays(64 + i)
            assert getrange_into(client, "resp-test", i, arrays)[0] == 64 + i
            assert arrays[0].tobytes() == VALUE[i : i + 64 + i]
            assert client.set("resp-other", b"v%d" % i) and client.get("resp-other") == b"v%d" % i
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                getrange_into(client, "resp-list", 0, _arrays(8))
            assert client.ping()
    finally:
        client.delete("resp-list", "resp-other")


@pytest.mark.parametrize("retries", [0, 1])
def test_a_reply_cut_off_by_the_server_is_read_again_or_raises(redis_server: RedisServer, retries: int) -> None:
    """The server drops the connection while the reply is half sent (its output buffer not empty): with the
    client's retry the command is sent again on a new connection and the value comes whole; without, the read
    raises, and the next one, on the pool's reconnected connection, gets the whole value."""
    big = np.random.default_rng(1).integers(0, 256, 96 << 20, dtype=np.uint8)
    client = redis.Redis.from_url(redis_server.url, max_connections=1, retry=Retry(NoBackoff(), retries))
    admin = redis.Redis.from_url(redis_server.url)
    client.set("big", big.data)
    killed: list[int] = []

    def kill_mid_reply() -> None:
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            for c in admin.client_list():
                if c["cmd"] == "getrange" and int(c["omem"]) > 0:  # NOTE: part of the reply not sent yet
                    killed.append(int(c["id"]))  # NOTE: before the kill: the reader may see it at once
                    admin.client_kill_filter(_id=c["id"])
                    break

    killer = threading.Thread(target=kill_mid_reply)
    killer.start()
    out = np.empty(big.size, dtype=np.uint8)
    try:
        if retries:
            assert getrange_into(client, "big", 0, [out])[0] == big.size and np.array_equal(out, big)
        else:
            with pytest.raises(redis.ConnectionError):
                getrange_into(client, "big", 0, [out])
    finally:
        killed.append(-1)  # stops the killer if the read ended first
        killer.join()
    assert killed[0] != -1, "the server never had the reply half sent"
    out[:] = 0
    got, crc = getrange_into(client, "big", 0, [out])
    assert got == big.size and np.array_equal(out, big) and crc == crc32c.crc32c(big.data)
    client.close()
    admin.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_whole_value_and_an_absent_one_in_either_protocol(redis_url: str, protocol: int) -> None:
    client = redis.Redis.from_url(redis_url, protocol=protocol)
    client.set("resp-whole", VALUE)
    pieces: list[bytes] = []
    buf = np.empty(len(VALUE), dtype=np.uint8)
    try:
        got = read_bulk(client, ("GET", "resp-whole"), lambda n: [buf[: n // 2], buf[n // 2 : n]], pieces.append)
        assert got == len(VALUE) and buf.tobytes() == VALUE and b"".join(pieces) == VALUE
        assert read_bulk(client, ("GET", "resp-absent"), lambda n: [buf[:n]], pieces.append) == -1
        assert client.ping()
    finally:
        client.delete("resp-whole")
        client.close()
