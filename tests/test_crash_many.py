"""Crash safety of ``store_many``: a process storing batches is killed with SIGKILL at random moments.

Each child (forked by ``workers.py store-many-zygote``, so torch is imported once) stores
batch after batch of 8 values with ``store_many`` (fsync="always", a small CPU tier: the
disk holds the data) and prints ``ACK <batch>`` when each call has returned. After every
kill the directory is opened again and checked: every entry of every acknowledged batch is
there with its last acknowledged version (or the one of the batch in flight at the kill),
bit for bit; every blob file is whole; no temporary file survives the open.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvmem
from tests.workers import MANY_KEYS, check_value, many_batch
from tests.zygote import Zygote, check_files

ROUNDS = 20


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote(tmp_path / "kvmem", tmp_path / "zygote.stderr", "store-many-zygote", "ACK")
    yield z
    z.close()


def test_sigkill_during_store_many_never_tears_or_loses_an_acknowledged_batch(tmp_path: Path, zygote: Zygote) -> None:
    path = tmp_path / "kvmem"
    rng = random.Random(20250317)
    state: dict[str, int | None] = {key: None for key in MANY_KEYS}
    total_acked = interrupted = 0
    for round_no in range(1, ROUNDS + 1):
        seed = rng.randrange(2**31)
        if round_no % 5 == 0:  # now and then while the child opens the directory, before any batch
            acked = zygote.run_and_kill(seed, round_no, 0, rng.uniform(0.0, 0.05))
        else:
            acked = zygote.run_and_kill(seed, round_no, rng.randrange(1, 4), rng.uniform(0.0, 0.06))
        total_acked += acked
        for batch in range(acked):
            state.update(many_batch(seed, round_no, batch))
        in_flight = many_batch(seed, round_no, acked)  # may have landed in part, in full, or not at all
        interrupted += len(list((path / "disk" / "blobs").rglob("*.tmp"))) > 0

        with kvmem.Memory(str(path), cpu_bytes="64KiB", disk_bytes="64MiB", fsync="always") as mem:
            n_files = check_files(path)
            for key in MANY_KEYS:
                value = mem.load(key)
                got = None if value is None else check_value(key, value)
                allowed = {state[key]} | ({in_flight[key]} if key in in_flight else set())
                assert got in allowed, (
                    f"round {round_no}: {key} holds version {got}, expected one of "
                    f"{allowed} after {acked} acknowledged batches"
                )
                state[key] = got
            assert n_files == sum(v is not None for v in state.values())
            assert mem.verify(progress=False).corrupt == []
        assert list(path.rglob("*.tmp")) == []
    assert total_acked >= ROUNDS
    assert all(v is not None for v in state.values())
    print(f"{ROUNDS} kills, {total_acked} batches acknowledged before them, {interrupted} with a write cut short")
