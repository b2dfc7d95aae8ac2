"""Metrics that tell the truth: usage read when scraped, and ``/metrics`` served by the working process itself.

The cross-process tests scrape a real HTTP endpoint of another process
(``tests/metrics_worker.py``) while it stores, loads and prefills.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvmem

REPO = Path(__file__).resolve().parents[1]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[Samples, str]:
    """The samples of ``url``'s ``/metrics`` (parsed by prometheus_client), and the body as text."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    return samples, body


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class Worker:
    """``python -m tests.metrics_worker PATH``: a working process with its own ``/metrics``."""

    def __init__(self, path: Path, stderr: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
        self._err = stderr.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.metrics_worker", str(path)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        self.url = self._expect("URL")

    def step(self, name: str) -> None:
        """Run one step (``values`` or ``kv``) and wait until it is done."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        self._expect("DONE")

    def _expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(word + " "):
            self.proc.kill()
            raise AssertionError(f"worker said {line!r}, expected {word}; stderr:\n{Path(self._err.name).read_text()}")
        return line.split(" ", 1)[1].strip()

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=60)
        self._err.close()
        return rc


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    w = Worker(tmp_path / "kvmem", tmp_path / "worker.stderr")
    yield w
    if w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait(timeout=30)


# -- usage gauges -----------------------------------------------------------------------------------------
def test_usage_gauges_follow_stores_and_deletes_without_stats(memory: kvmem.Memory) -> None:
    cpu, disk = memory.tiers.tiers

    def usage(tier: str) -> float:
        return memory.metrics.value("kvmem_memory_usage_bytes", tier=tier)

    memory.store("big", bytes(300_000))
    assert usage("cpu") == cpu.usage() >= 300_000
    assert usage("disk") == disk.usage() >= 300_000
    memory.delete("big")
    assert usage("cpu") == cpu.usage() == 0
    assert usage("disk") == disk.usage() == 0
