"""Metrics that tell the truth: usage read when scraped, and ``/metrics`` served by the working process itself.

The cross-process tests scrape a real HTTP endpoint of another process
(``tests/metrics_worker.py``) while it stores, loads and prefills.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import kvmem
from kvmem.config import load_config
from kvmem.errors import ConfigError
from tests.metrics_worker import KV_CHUNKS, VALUES

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
    cpu, disk = memory._tiers.tiers

    def usage(tier: str) -> float:
        return memory.metrics.value("kvmem_memory_usage_bytes", tier=tier)

    memory.store("big", bytes(300_000))
    assert usage("cpu") == cpu.usage() >= 300_000
    assert usage("disk") == disk.usage() >= 300_000
    memory.delete("big")
    assert usage("cpu") == cpu.usage() == 0
    assert usage("disk") == disk.usage() == 0


# -- the working process serves its own /metrics -----------------------------------------------------------
@pytest.mark.timeout(300)
def test_working_process_serves_what_it_does_while_it_works(worker: Worker) -> None:
    before, _ = scrape(worker.url)
    assert value(before, "kvmem_misses_total", kind="tree") == 0
    assert value(before, "kvmem_memory_usage_bytes", tier="cpu") == 0

    worker.step("kv")  # a cold and a warm prefill, then a prefetch
    kv, _ = scrape(worker.url)
    assert value(kv, "kvmem_misses_total", kind="tree") == KV_CHUNKS
    assert value(kv, "kvmem_hits_total", tier="cpu", kind="tree") == KV_CHUNKS
    assert value(kv, "kvmem_hit_rate") == pytest.approx(0.5)
    assert value(kv, "kvmem_prefetch_latency_seconds_count") == 1
    assert value(kv, "kvmem_ttft_seconds_count") == 2

    worker.step("values")
    worker.step("values")
    after, body = scrape(worker.url)
    assert value(after, "kvmem_hits_total", tier="cpu", kind="tensor") == 2 * VALUES
    assert value(after, "kvmem_misses_total", kind="unknown") == 2
    assert value(after, "kvmem_hit_rate") == pytest.approx((KV_CHUNKS + 2 * VALUES) / (2 * KV_CHUNKS + 2 * VALUES + 2))
    assert value(after, "kvmem_store_seconds_count") == KV_CHUNKS + 2 * VALUES
    assert value(after, "kvmem_load_seconds_count") == 2 * (VALUES + 1)
    for tier in ("cpu", "disk"):
        assert value(after, "kvmem_memory_usage_bytes", tier=tier) >= 2 * VALUES * 100_000
    assert "# HELP kvmem_compression_ratio Raw bytes / stored bytes" in body
    assert worker.close() == 0


# -- metrics_port ---------------------------------------------------------------------------------------------
def test_close_releases_the_metrics_port(tmp_path: Path) -> None:
    first = kvmem.Memory(tmp_path / "a", cpu_bytes="16MiB", metrics_port=0)
    assert first.metrics_url is not None
    port = int(first.metrics_url.rsplit(":", 1)[1].split("/")[0])
    first.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(first.metrics_url, timeout=10)
    with kvmem.Memory(tmp_path / "b", cpu_bytes="16MiB", metrics_port=port) as second:
        assert second.metrics_url == f"http://127.0.0.1:{port}/metrics"
        assert value(scrape(second.metrics_url)[0], "kvmem_capacity_bytes", tier="cpu") == 16 * 1024**2


def test_configure_again_keeps_the_metrics_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvmem.api, "_default", None)
    first = kvmem.configure(path=str(tmp_path / "a"), cpu_bytes="16MiB", metrics_port=0)
    assert first.metrics_url is not None
    port = int(first.metrics_url.rsplit(":", 1)[1].split("/")[0])
    second = kvmem.configure(path=str(tmp_path / "b"), cpu_bytes="16MiB", metrics_port=port)
    try:
        assert second.metrics_url == first.metrics_url and kvmem.default_memory() is second
        kvmem.store("k", b"v")
        assert value(scrape(second.metrics_url)[0], "kvmem_store_seconds_count") == 1
    finally:
        second.close()


def test_metrics_port_taken_is_a_config_error_and_leaves_the_directory_usable(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot listen on 127\.0\.0\.1:{port} for /metrics"):
            kvmem.Memory(tmp_path / "kvmem", cpu_bytes="16MiB", metrics_port=port)
    with kvmem.Memory(tmp_path / "kvmem", cpu_bytes="16MiB") as memory:  # closed cleanly: opens again
        memory.store("k", torch.ones(4))
        assert memory.metrics_url is None


@pytest.mark.parametrize(
    ("setting", "bad", "accepted"),
    [
        ("metrics_port", 70000, "a TCP port from 0"),
        ("metrics_port", -1, "a TCP port from 0"),
        ("metrics_port", True, "a TCP port from 0"),
        ("metrics_host", "", "an address to listen on"),
    ],
)
def test_bad_metrics_settings_are_config_errors(tmp_path: Path, setting: str, bad: object, accepted: str) -> None:
    with pytest.raises(ConfigError, match=rf"{setting}={bad!r}: accepted {accepted}"):
        kvmem.Memory(tmp_path / "kvmem", **{setting: bad})


def test_metrics_port_from_the_environment() -> None:
    assert load_config(environ={}).metrics_port is None
    assert load_config(environ={"KVMEM_METRICS_PORT": "9400"}).metrics_port == 9400
    with pytest.raises(ConfigError, match="metrics_port='http': expected an int"):
        load_config(environ={"KVMEM_METRICS_PORT": "http"})
