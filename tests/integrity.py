"""The fault matrix's building blocks: where a value rests in each tier, and the faults made to it there.

A :class:`Rest` reads and rewrites the bytes of one stored blob where a tier keeps them:
the CPU tier's pool pages, the disk tier's file, the Redis value. The faults of
:data:`FAULTS` damage those bytes for real (a byte flipped in the payload or the header,
the value cut short, another valid blob of the same size put in its place); the
faults of a read in progress (:data:`READ_FAULTS`: the value deleted between the
header read and the part read, an ``EIO`` or a dropped connection mid-read) hook the
tier's read at the moment the fault strikes, then let the real thing happen (a real
unlink, a real ``DEL``, a Redis server really stopped); only the disk's ``EIO`` is
raised by the hook, since a real one cannot be made here.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import kvmem
from kvmem import blob as blobfmt
from kvmem.stores.base import StorageTier
from kvmem.stores.cpu import CpuTier
from kvmem.stores.disk import DiskTier
from kvmem.stores.redis import RedisTier
from tests.servers import RedisServer


def tier_of(memory: kvmem.Memory, name: str) -> StorageTier:
    return next(t for t in memory._tiers.tiers if t.name == name)


class Rest:
    """The bytes of ``skey``'s blob where ``tier`` keeps them, to read and to damage."""

    def __init__(self, memory: kvmem.Memory, tier: str, skey: str) -> None:
        self.tier = tier_of(memory, tier)
        self.skey = skey

    def read(self) -> bytes:
        tier = self.tier
        if isinstance(tier, CpuTier):
            entry = tier.lookup(self.skey)
            assert entry is not None
            return b"".join(a.tobytes() for a in entry.alloc.array(0, entry.blob.nbytes))
        if isinstance(tier, DiskTier):
            return tier.path(self.skey).read_bytes()
        assert isinstance(tier, RedisTier)
        data = tier.client.get(tier._key(self.skey))
        assert isinstance(data, bytes)
        return data

    def write(self, data: bytes) -> None:
        tier = self.tier
        if isinstance(tier, CpuTier):  # in place, same size: the pages the entry holds
            entry = tier.lookup(self.skey)
            assert entry is not None and len(data) == entry.blob.nbytes
            at = 0
            for page in entry.alloc.array(0, entry.blob.nbytes):
                page[:] = np.frombuffer(data[at : at + page.size], dtype=np.uint8)
                at += page.size
        elif isinstance(tier, DiskTier):
            tier.path(self.skey).write_bytes(data)
        else:
            assert isinstance(tier, RedisTier)
            tier.client.set(tier._key(self.skey), data)

    def delete(self) -> None:
        tier = self.tier
        if isinstance(tier, DiskTier):
            tier.path(self.skey).unlink()
        else:
            assert isinstance(tier, RedisTier)
            tier.client.delete(tier._key(self.skey))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def _payload_start(data: bytes) -> int:
    return blobfmt.header_extent(torch.frombuffer(bytearray(data[:24]), dtype=torch.uint8))


def flip_payload(rest: Rest, other: Rest) -> None:
    data = rest.read()
    start = _payload_start(data)
    rest.write(_flip(data, start + (len(data) - start) // 2))


def flip_header(rest: Rest, other: Rest) -> None:
    rest.write(_flip(rest.read(), 40))  # inside the JSON header


def cut_short(rest: Rest, other: Rest) -> None:
    data = rest.read()
    if isinstance(rest.tier, CpuTier):  # pages keep their size: the tail is zeroed instead
        rest.write(data[: len(data) - 1000] + bytes(1000))
    else:
        rest.write(data[: len(data) - 1000])


def swapped(rest: Rest, other: Rest) -> None:
    data, theirs = rest.read(), other.read()
    assert len(data) == len(theirs) and data != theirs
    rest.write(theirs)


FAULTS: dict[str, Callable[[Rest, Rest], None]] = {
    "payload byte flipped": flip_payload,
    "header byte flipped": flip_header,
    "cut short": cut_short,
    "another key's blob": swapped,
}
"""Damage made to a value where it rests: ``fault(rest, other)``, ``other`` an intact blob of the same size."""


def deleted_mid_read(rest: Rest, monkeypatch: pytest.MonkeyPatch, server: RedisServer | None) -> None:
    """The value goes (a real unlink or ``DEL``) right after its tier's first read of it."""
    _after_first_read(rest, monkeypatch, rest.delete)


def dropped_mid_read(rest: Rest, monkeypatch: pytest.MonkeyPatch, server: RedisServer | None) -> None:
    """Disk: ``EIO`` from every read past the file's first half. Redis: the server stops after the first read."""
    if isinstance(rest.tier, DiskTier):
        name, real = str(rest.tier.path(rest.skey)), os.preadv

        def preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            size = os.fstat(fd).st_size
            if os.readlink(f"/proc/self/fd/{fd}") == name and offset + sum(len(b) for b in buffers) > size // 2:
                raise OSError(errno.EIO, os.strerror(errno.EIO), name)
            return real(fd, buffers, offset, *flags)

        monkeypatch.setattr(os, "preadv", preadv)
        return
    assert server is not None
    _after_first_read(rest, monkeypatch, server.stop)


def _after_first_read(rest: Rest, monkeypatch: pytest.MonkeyPatch, strike: Callable[[], None]) -> None:
    """Run ``strike`` once, after the first read of ``rest``'s blob (a whole-value read strikes before it)."""
    reads = [0]
    tier = rest.tier
    if isinstance(tier, DiskTier):
        name, real = str(tier.path(rest.skey)), os.preadv

        def preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            got = real(fd, buffers, offset, *flags)
            if os.readlink(f"/proc/self/fd/{fd}").startswith(name) and not reads[0]:
                reads[0] += 1
                strike()
            return got

        monkeypatch.setattr(os, "preadv", preadv)
        return
    assert isinstance(tier, RedisTier)
    real_range, real_fetch = tier.read_range_into, tier._fetch

    def read_range_into(key: str, start: int, arrays: Any) -> Any:  # NOTE: read_range reads through it too
        if key == rest.skey and reads[0] == 1:
            strike()
        reads[0] += key == rest.skey
        return real_range(key, start, arrays)

    def fetch(key: str, *args: Any, **kwargs: Any) -> Any:
        if key == rest.skey and not reads[0]:
            reads[0] += 1
            strike()
        return real_fetch(key, *args, **kwargs)

    monkeypatch.setattr(tier, "read_range_into", read_range_into)
    monkeypatch.setattr(tier, "_fetch", fetch)


READ_FAULTS: dict[str, Callable[[Rest, pytest.MonkeyPatch, RedisServer | None], None]] = {
    "deleted mid-read": deleted_mid_read,
    "EIO or dropped connection mid-read": dropped_mid_read,
}
"""Faults of a read in progress, for the tiers that read from outside the process (disk, Redis)."""
