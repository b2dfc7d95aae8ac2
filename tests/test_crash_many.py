"""Crash safety of ``store_many``: a process storing batches is killed with SIGKILL at random moments.

Each child (forked by ``workers.py store-many-zygote``, so torch is imported once) stores
batch after batch of 8 values with ``store_many`` (fsync="always", a small CPU tier: the
disk holds the data) and prints ``ACK <batch>`` when each call has returned. After every
kill the directory is opened again and checked: every entry of every acknowledged batch is
there with its last acknowledged version (or the one of the batch in flight at the kill),
bit for bit; every blob file is whole; no temporary file survives the open.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvmem
from kvmem import blob as blobfmt
from kvmem.codecs.pipeline import check_owner
from tests.workers import MANY_KEYS, check_value, many_batch

WORKERS = str(Path(__file__).with_name("workers.py"))
ROUNDS = 20


class Zygote:
    """``workers.py store-many-zygote``: forks a fresh storing child for each round."""

    def __init__(self, path: Path, stderr: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
        self._err = stderr.open("w")
        self.proc = subprocess.Popen([sys.executable, WORKERS, "store-many-zygote", str(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     bufsize=1, env=env)

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the zygote died (exit {self.proc.poll()})"
        return line.split("\n")[0]

    def run_and_kill(self, seed: int, round_no: int, after_acks: int, delay: float) -> int:
        """Start a child; once it acknowledged ``after_acks`` batches, wait ``delay`` s and SIGKILL it.

        Returns:
            How many batches the child acknowledged before it died (ACK lines written before the kill count).
        """
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {seed} {round_no}\n")
        self.proc.stdin.flush()
        tag, pid = self._line().split()
        assert tag == "ready"
        acked = 0
        while acked < after_acks:
            assert self._line() == f"ACK {acked}"
            acked += 1
        time.sleep(delay)
        os.kill(int(pid), signal.SIGKILL)
        while True:
            line = self._line()
            if line.startswith("reaped"):
                _, reaped, status = line.split()
                assert int(reaped) == int(pid)
                assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL, \
                    f"the child ended on its own (status {status}) before the kill: see its stderr"
                return acked
            assert line == f"ACK {acked}", line
            acked += 1

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self._err.close()


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote(tmp_path / "kvmem", tmp_path / "zygote.stderr")
    yield z
    z.close()


def check_files(path: Path) -> int:
    """Every blob file under ``path``'s disk tier is whole and holds the key it is named after; how many."""
    files = list((path / "disk" / "blobs").rglob("*"))
    strays = [f for f in files if f.name.endswith(".tmp")]
    assert strays == [], f"temporary files left after open: {strays}"
    entries = [f for f in files if f.is_file()]
    for f in entries:
        buf = torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8)
        blobfmt.verify(buf)  # raises on a torn file
        header, _ = blobfmt.parse(buf)
        check_owner(header, f.name.removesuffix(".kvb"))
    return len(entries)


def test_sigkill_during_store_many_never_tears_or_loses_an_acknowledged_batch(tmp_path: Path,
                                                                               zygote: Zygote) -> None:
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
                assert got in allowed, (f"round {round_no}: {key} holds version {got}, expected one of "
                                        f"{allowed} after {acked} acknowledged batches")
                state[key] = got
            assert n_files == sum(v is not None for v in state.values())
            assert mem.verify(progress=False).corrupt == []
        assert list(path.rglob("*.tmp")) == []
    assert total_acked >= ROUNDS
    assert all(v is not None for v in state.values())
    print(f"{ROUNDS} kills, {total_acked} batches acknowledged before them, {interrupted} with a write cut short")
