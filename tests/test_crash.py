"""Crash safety: a storing process killed with SIGKILL at random moments, again and again.

After every kill the directory is opened again and checked: no temporary file
survives the open, every blob file is whole, and every store (or delete) that
returned before the kill is there. The op sequence of each round is known from
its seed, so the one op that may have been in flight at the kill is known too.
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
from tests.workers import CRASH_KEYS, check_value, crash_ops

WORKERS = str(Path(__file__).with_name("workers.py"))
ROUNDS = 24


class Zygote:
    """``workers.py crash-zygote``: forks a fresh storing child for each round."""

    def __init__(self, path: Path, stderr: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
        self._err = stderr.open("w")
        self.proc = subprocess.Popen([sys.executable, WORKERS, "crash-zygote", str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, bufsize=1, env=env)

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the zygote died (exit {self.proc.poll()})"
        return line.split("\n")[0]

    def run_and_kill(self, seed: int, round_no: int, after_ops: int, delay: float) -> int:
        """Start a child; once it reports ``after_ops`` ops done, wait ``delay`` s and SIGKILL it.

        Returns:
            How many ops the child reported done before it died.
        """
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {seed} {round_no}\n")
        self.proc.stdin.flush()
        tag, pid = self._line().split()
        assert tag == "ready"
        done = 0
        while done < after_ops:
            assert self._line() == f"done {done}"
            done += 1
        time.sleep(delay)
        os.kill(int(pid), signal.SIGKILL)
        while True:
            line = self._line()
            if line.startswith("reaped"):
                _, reaped, status = line.split()
                assert int(reaped) == int(pid)
                assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL, \
                    f"the child ended on its own (status {status}) before the kill: see its stderr"
                return done
            assert line == f"done {done}", line
            done += 1

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


def _apply(state: dict[str, int | None], op: tuple[str, str, int]) -> None:
    kind, key, ver = op
    state[key] = ver if kind == "store" else None


def _check_files(path: Path) -> int:
    """Every blob file under ``path`` is whole and named after the key it holds; how many there are."""
    blobs = path / "disk" / "blobs"
    files = list(blobs.rglob("*"))
    strays = [f for f in files if f.name.endswith(".tmp")]
    assert strays == [], f"temporary files left after open: {strays}"
    entries = [f for f in files if f.is_file()]
    for f in entries:
        buf = torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8)
        blobfmt.verify(buf)  # raises on a torn file
        header, _ = blobfmt.parse(buf)
        check_owner(header, f.name.removesuffix(".kvb"))
    return len(entries)


def test_sigkill_at_random_moments_never_tears_or_loses_a_returned_store(tmp_path: Path, zygote: Zygote) -> None:
    path = tmp_path / "kvmem"
    rng = random.Random(20240611)
    state: dict[str, int | None] = {key: None for key in CRASH_KEYS}
    total_done = strays_seen = 0
    for round_no in range(1, ROUNDS + 1):
        seed = rng.randrange(2**31)
        # mostly mid-loop; now and then during start-up, while the store opens the directory
        if round_no % 6 == 0:
            done = zygote.run_and_kill(seed, round_no, 0, rng.uniform(0.0, 0.08))
        else:
            done = zygote.run_and_kill(seed, round_no, rng.randrange(1, 4), rng.uniform(0.0, 0.25))
        total_done += done
        ops = crash_ops(seed, round_no, done + 1)
        for op in ops[:done]:
            _apply(state, op)
        in_flight = ops[done]  # may or may not have taken effect

        strays_seen += len(list((path / "disk" / "blobs").rglob("*.tmp")))
        with kvmem.Memory(path, cpu_bytes="64KiB", disk_bytes="64MiB", fsync="always") as mem:
            _check_files(path)
            for key in CRASH_KEYS:
                value = mem.load(key)
                got = None if value is None else check_value(key, value)
                allowed = {state[key]}
                if in_flight[1] == key:
                    allowed.add(in_flight[2] if in_flight[0] == "store" else None)
                assert got in allowed, (f"round {round_no}: {key} holds version {got}, "
                                        f"expected one of {allowed} after {done} ops")
                state[key] = got
            # (a catalog row may outlive a delete killed half way: the data path never reads it)
            assert mem.verify(progress=False).corrupt == []
    assert total_done >= ROUNDS * 5 // 6
    assert sum(v is not None for v in state.values()) > 0
    print(f"{ROUNDS} kills, {total_done} ops returned before them, {strays_seen} interrupted writes cleaned")
