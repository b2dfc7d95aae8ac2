"""The harness of the kill -9 tests: a zygote process that forks a storing child per round, and the file check.

``workers.py <command> PATH`` imports kvmem once, then for each ``run SEED ROUND``
line forks a child that prints ``ready <pid>``, then ``<tag> <n>`` after each
operation it completed (``done`` for single stores, ``ACK`` for batches), and
reports ``reaped <pid> <status>`` once the child is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvmem import blob as blobfmt
from kvmem.codecs.serialization import check_owner

WORKERS = str(Path(__file__).with_name("workers.py"))


class Zygote:
    """``workers.py <command> PATH``: forks a fresh storing child for each round.

    Args:
        path: the data directory the children store into.
        stderr: where the zygote's (and children's) stderr goes.
        command: the workers.py command (``crash-zygote``, ``store-many-zygote``).
        tag: the word a child prints after each completed operation.
    """

    def __init__(self, path: Path, stderr: Path, command: str, tag: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
        self.tag = tag
        self._err = stderr.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, WORKERS, command, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            bufsize=1,
            env=env,
        )

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the zygote died (exit {self.proc.poll()})"
        return line.split("\n")[0]

    def run_and_kill(self, seed: int, round_no: int, after_ops: int, delay: float) -> int:
        """Start a child; once it reports ``after_ops`` operations done, wait ``delay`` s and SIGKILL it.

        Returns:
            How many operations the child reported done before it died (lines written before the kill count).
        """
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {seed} {round_no}\n")
        self.proc.stdin.flush()
        tag, pid = self._line().split()
        assert tag == "ready"
        done = 0
        while done < after_ops:
            assert self._line() == f"{self.tag} {done}"
            done += 1
        time.sleep(delay)
        os.kill(int(pid), signal.SIGKILL)
        while True:
            line = self._line()
            if line.startswith("reaped"):
                _, reaped, status = line.split()
                assert int(reaped) == int(pid)
                assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL, (
                    f"the child ended on its own (status {status}) before the kill: see its stderr"
                )
                return done
            assert line == f"{self.tag} {done}", line
            done += 1

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self._err.close()


def check_files(path: Path) -> int:
    """Every blob file under ``path``'s disk tier is whole and holds the key it is named after (and no
    temporary file is left); how many there are."""
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
