"""The ``kvmem`` command line, run for real against data directories under ``tmp_path``.

Most commands run in-process through ``main(argv)``; ``serve-metrics`` and the
error exit status run as real subprocesses (``python -m kvmem``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import kvmem
from kvmem.cli.demo import LLAMA_3_2_1B, cpu_bytes_for, run_demo
from kvmem.cli.main import main
from kvmem.metrics import Metrics
from tests.servers import scratch_database

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "examples" / "grafana" / "kvmem-dashboard.json"
# The metric families of the core (issue #2, part 10) the dashboard must chart.
CORE_METRICS = {
    "kvmem_memory_usage_bytes",
    "kvmem_capacity_bytes",
    "kvmem_hits",
    "kvmem_misses",
    "kvmem_hit_rate",
    "kvmem_load_seconds",
    "kvmem_store_seconds",
    "kvmem_compression_ratio",
    "kvmem_crc_failures",
    "kvmem_evictions",
    "kvmem_demotions",
    "kvmem_promotions",
    "kvmem_tier_errors",
}


@dataclass
class DataDir:
    """A data directory filled through a real ``Memory``, and what was put in it."""

    path: Path
    keys: dict[str, str]  # name -> storage key
    size: int
    stored_size: int

    def argv(self, *args: str) -> list[str]:
        return [*args, "--path", str(self.path)]

    def blob_file(self, name: str) -> Path:
        key = self.keys[name]
        return self.path / "disk" / "blobs" / key[:2] / f"{key}.kvb"


def _fill(path: Path) -> DataDir:
    values: dict[str, tuple[str | bytes, str, object]] = {
        "a": ("prompt/a", "llama", torch.arange(1000, dtype=torch.float32)),
        "b": (
            "prompt/b",
            "llama",
            {"k": torch.ones(2, 64, 8, dtype=torch.bfloat16), "v": torch.zeros(2, 64, 8, dtype=torch.bfloat16)},
        ),
        "c": (b"\x00raw", "agent", b"x" * 5000),
        "d": ("line\nbreak\x00key", "agent", "some text"),
    }
    with kvmem.Memory(str(path), cpu_bytes="16MiB", disk_bytes="256MiB", fsync="never") as mem:
        keys = {name: mem.store(key, value, namespace=ns) for name, (key, ns, value) in values.items()}
        infos = [mem.info(key, namespace=ns) for key, ns, _ in values.values()]
        mem.load("prompt/a", namespace="llama")
        mem.load("prompt/a", namespace="llama")
    assert all(i is not None for i in infos)
    return DataDir(path, keys, sum(i.size for i in infos if i), sum(i.stored_size for i in infos if i))


@pytest.fixture
def data(tmp_path: Path) -> DataDir:
    return _fill(tmp_path / "data")


def _run_json(capsys: pytest.CaptureFixture[str], argv: list[str], expect: int = 0) -> Any:
    assert main(argv) == expect
    return json.loads(capsys.readouterr().out)


# -- demo --tiers -----------------------------------------------------------------------------------
def test_demo_tiers_in_a_temporary_directory_prints_the_table_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--tiers", "--chunks", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"data directory: .*kvmem-demo-", out)
    for phase in ("store", "load pass 1", "load pass 2"):
        assert re.search(rf"^{phase}\s+3\s+24\.0 MiB", out, re.M), out
    assert "cpu hits" in out and "disk hits" in out and "demoted" in out and "promoted" in out
    assert "OK: all 6 loads came back bit-exact" in out
    assert not list(tmp_path.glob("kvmem-demo-*")), "temporary data directory left behind"


def test_demo_keep_leaves_data_the_other_commands_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--tiers", "--chunks", "2", "--keep"]) == 0
    capsys.readouterr()
    (kept,) = tmp_path.glob("kvmem-demo-*")
    stats = _run_json(capsys, ["stats", "--json", "--path", str(kept)])
    assert stats["entries"] == 2 and stats["size"] == 2 * LLAMA_3_2_1B.chunk_bytes(256)
    assert stats["recorded_hits"] == 4  # two passes over two chunks


def test_demo_overflows_the_cpu_tier_and_hits_both_tiers(tmp_path: Path) -> None:
    cpu = cpu_bytes_for(LLAMA_3_2_1B, 256, 3, 0.7)
    with kvmem.Memory(str(tmp_path), cpu_bytes=cpu, fsync="never") as mem:
        report = run_demo(mem, 3, progress=False)
    store, pass1, pass2 = report.phases
    assert report.failures == 0 and report.loads == 6
    assert store.counters["demotions"] == 2  # the CPU tier keeps one chunk of three
    # NOTE: pass 1 reads newest first, pass 2 oldest first: each finds one chunk on CPU.
    assert pass1.hits == {"cpu": 1, "disk": 2} and pass2.hits == {"cpu": 1, "disk": 2}
    assert pass1.counters["promotions"] == 2 and pass2.counters["promotions"] == 2
    assert {t.name: t.entries for t in report.tiers} == {"cpu": 1, "disk": 3}


def test_demo_fails_when_values_do_not_come_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = tmp_path / "small-disk.yaml"
    settings.write_text("disk_bytes: 12MiB\n")  # holds one 8 MiB chunk: older ones are evicted
    assert main(["demo", "--tiers", "--chunks", "3", "--path", str(tmp_path / "d"), "--config", str(settings)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAILED: 0 of 6 loads came back wrong, [1-6] missing", out), out


# -- stats / ls ------------------------------------------------------------------------------
def test_stats_counts_what_was_stored(data: DataDir, capsys: pytest.CaptureFixture[str]) -> None:
    stats = _run_json(capsys, data.argv("stats", "--json"))
    assert (stats["entries"], stats["size"], stats["stored_size"]) == (4, data.size, data.stored_size)
    assert stats["recorded_hits"] == 2
    disk = next(t for t in stats["tiers"] if t["name"] == "disk")
    assert (disk["entries"], disk["usage"], disk["capacity"]) == (4, data.stored_size, 20 * 1024**3)
    assert main(data.argv("stats")) == 0
    out = capsys.readouterr().out
    assert re.search(r"^entries\s+4$", out, re.M)
    assert f"({data.size} B)" in out and f"({data.stored_size} B)" in out
    assert re.search(r"^disk\s+.*\s4\s+yes$", out, re.M), out


def test_ls_lists_entries_most_recent_first(data: DataDir, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _run_json(capsys, data.argv("ls", "--json"))
    assert {r["key"] for r in rows} == set(data.keys.values())
    assert rows[0]["key"] == data.keys["a"]  # loaded after every store
    by_key = {r["key"]: r for r in rows}
    a, c = by_key[data.keys["a"]], by_key[data.keys["c"]]
    assert (a["user_key"], a["namespace"], a["kind"], a["hits"], a["size"]) == ("prompt/a", "llama", "tensor", 2, 4000)
    assert (c["user_key"], c["namespace"], c["kind"]) == (b"\x00raw".hex(), "agent", "bytes")

    assert main(data.argv("ls")) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 2 + 4  # header, rule, one line per entry: the key with a newline is escaped
    assert all(data.keys[n][:12] in out for n in data.keys)
    assert "prompt/a" in out and "line\\nbreak\\x00key" in out and "\x00" not in out


def test_ls_filters_and_limits(data: DataDir, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _run_json(capsys, data.argv("ls", "--json", "--namespace", "agent"))
    assert {r["key"] for r in rows} == {data.keys["c"], data.keys["d"]}
    assert _run_json(capsys, data.argv("ls", "--json", "--namespace", "nobody")) == []
    assert main(data.argv("ls", "--limit", "1")) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 2 + 1 + 1 and "first 1 shown" in out
    assert data.keys["a"][:12] in out


# -- verify / gc --------------------------------------------------------------------------------
def test_verify_clean(data: DataDir, capsys: pytest.CaptureFixture[str]) -> None:
    report = _run_json(capsys, data.argv("verify", "--json"))
    assert report == {"checked": 4, "ok": True, "fixed": False, "corrupt": [], "orphans": [], "missing": []}
    assert main(data.argv("verify")) == 0
    assert "OK: everything checks out" in capsys.readouterr().out


def test_verify_finds_a_corrupt_file_and_fix_repairs(data: DataDir, capsys: pytest.CaptureFixture[str]) -> None:
    blob = data.blob_file("b")
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    blob.write_bytes(bytes(raw))

    report = _run_json(capsys, data.argv("verify", "--json"), expect=1)
    assert [(c["tier"], c["key"]) for c in report["corrupt"]] == [("disk", data.keys["b"])]
    assert main(data.argv("verify")) == 1
    out = capsys.readouterr().out
    assert re.search(rf"^corrupt\s+disk\s+{data.keys['b']}", out, re.M) and "kvmem verify --fix" in out

    assert main(data.argv("verify", "--fix")) == 0
    assert "fixed" in capsys.readouterr().out
    assert not blob.exists() and len(list((data.path / "disk" / "quarantine").iterdir())) == 1
    assert _run_json(capsys, data.argv("verify", "--json"))["ok"] is True
    assert _run_json(capsys, data.argv("stats", "--json"))["entries"] == 3
    gc = _run_json(capsys, data.argv("gc", "--json"))
    assert gc == {"rows_removed": 0, "quarantine_bytes_freed": len(raw), "versions_reclaimed": 0}
    assert not list((data.path / "disk" / "quarantine").iterdir())


def test_verify_reports_missing_data_and_gc_drops_the_row(data: DataDir, capsys: pytest.CaptureFixture[str]) -> None:
    data.blob_file("c").unlink()
    report = _run_json(capsys, data.argv("verify", "--json"), expect=1)
    assert report["missing"] == [data.keys["c"]] and report["checked"] == 3
    assert main(data.argv("gc")) == 0
    assert "removed 1 catalog rows without data" in capsys.readouterr().out
    assert _run_json(capsys, data.argv("verify", "--json"))["ok"] is True
    assert {r["key"] for r in _run_json(capsys, data.argv("ls", "--json"))} == {data.keys[n] for n in ("a", "b", "d")}


# -- config -----------------------------------------------------------------------------------------
def test_config_shows_each_value_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = tmp_path / "kvmem.yaml"
    settings.write_text("cpu_bytes: 1GiB\nfsync: always\n")
    monkeypatch.setenv("KVMEM_BLOCK_SIZE", "128")
    argv = ["config", "--path", str(tmp_path / "x"), "--config", str(settings)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^block_size\s+128\s+env KVMEM_BLOCK_SIZE$", out, re.M), out
    assert re.search(rf"^cpu_bytes\s+1073741824 \(1\.0 GiB\)\s+{re.escape(str(settings))}$", out, re.M)
    assert re.search(r"^prefetch_depth\s+3\s+default$", out, re.M)
    assert re.search(rf"^path\s+{re.escape(str(tmp_path / 'x'))}\s+argument$", out, re.M)
    rows = _run_json(capsys, [*argv, "--json"])
    assert rows["block_size"] == {"value": 128, "source": "env KVMEM_BLOCK_SIZE"}
    assert rows["fsync"] == {"value": "always", "source": str(settings)}
    assert not (tmp_path / "x").exists()  # printing the config creates nothing


def test_config_never_prints_a_password(tmp_path: Path) -> None:
    """The issue's own reproduction, run for real: passwords in the URLs and in ``remote_password``."""
    env = {
        **os.environ,
        "KVMEM_REMOTE_URL": "redis://kvmem:PW-url@127.0.0.1:6399/0?password=PW-query",
        "KVMEM_CATALOG_URL": "postgresql+psycopg://kvmem:PW-pg@127.0.0.1:5432/kvmem",
        "KVMEM_REMOTE_PASSWORD": "PW-field",
    }
    argv = [sys.executable, "-m", "kvmem", "config", "--path", str(tmp_path)]
    text, as_json = (
        subprocess.run(argv + extra, env=env, capture_output=True, text=True, timeout=120) for extra in ([], ["--json"])
    )
    for proc in (text, as_json):
        assert proc.returncode == 0, proc.stderr
        assert "PW-" not in proc.stdout + proc.stderr, proc.stdout
    assert re.search(
        r"^remote_url\s+redis://kvmem:\*\*\*@127\.0\.0\.1:6399/0\?password=\*\*\*\s+env KVMEM_REMOTE_URL$",
        text.stdout,
        re.M,
    ), text.stdout
    rows = json.loads(as_json.stdout)
    assert rows["catalog_url"]["value"] == "postgresql+psycopg://kvmem:***@127.0.0.1:5432/kvmem"
    assert rows["remote_password"] == {"value": "***", "source": "env KVMEM_REMOTE_PASSWORD"}


def test_stats_shows_a_postgresql_catalog_without_its_password(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server trusts loopback, so it takes the passwords and ignores them: the URL is real, not a stand-in."""
    with scratch_database(postgres_url) as url:
        url = url.replace("://postgres@", "://postgres:PW-user@") + "?password=PW-query"
        monkeypatch.setenv("KVMEM_CATALOG_URL", url)
        assert main(["stats", "--path", str(tmp_path / "data")]) == 0
        out = capsys.readouterr().out
        assert main(["doctor", "--path", str(tmp_path / "data")]) in (0, 1)
        out += capsys.readouterr().out
    assert re.search(
        r"^catalog\s+postgresql\+psycopg://postgres:\*\*\*@127\.0\.0\.1:\d+/\w+\?password=\*\*\*$", out, re.M
    ), out
    assert "PW-" not in out


# -- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, env, needle",
    [
        (["stats"], {"KVMEM_BLOCK_SIZE": "0"}, "block_size=0"),
        (["ls", "--config", "/nonexistent/kvmem.yaml"], {}, "cannot be read"),
        (["verify"], {"KVMEM_CPU_BYTES": "lots"}, "cpu_bytes='lots'"),
    ],
)
def test_errors_print_one_line_and_exit_2(
    data: DataDir,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    needle: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(data.argv(*argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("kvmem: error: ") and needle in captured.err


def test_commands_do_not_create_a_data_directory_on_a_typo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--path", str(tmp_path / "typo")]) == 2
    assert "no kvmem data directory" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


def test_python_dash_m_kvmem_config_error_exits_2_without_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "KVMEM_FSYNC": "sometimes"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvmem", "config", "--path", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["kvmem: error: fsync='sometimes': accepted always | batch | never"]


# -- serve-metrics ---------------------------------------------------------------------------------
def _usage_gauge(url: str, tier: str) -> float | None:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    m = re.search(rf'^kvmem_memory_usage_bytes{{tier="{tier}"}} (\S+)$', body, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.timeout(180)
def test_serve_metrics_serves_usage_and_follows_other_writers(data: DataDir) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmem", "serve-metrics", "--port", "0", "--interval", "0.2", "--path", str(data.path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = re.search(r"serving (http://127\.0\.0\.1:\d+/metrics)", first)
        assert match, f"{first!r} {proc.stderr.read() if proc.stderr and proc.poll() is not None else ''}"
        url = match.group(1)
        assert _usage_gauge(url, "disk") == data.stored_size
        with kvmem.Memory(str(data.path), fsync="never") as mem:
            mem.store("written later", b"y" * 100_000)
            grown = data.stored_size + mem.info("written later").stored_size  # type: ignore[union-attr]
        deadline = time.monotonic() + 30
        while _usage_gauge(url, "disk") != grown and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _usage_gauge(url, "disk") == grown
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'kvmem_capacity_bytes{tier="disk"}' in body
        # only what the processes share: their counters and CPU tiers are theirs to serve (metrics_port)
        assert "kvmem_hits_total" not in body and "kvmem_load_seconds" not in body and 'tier="cpu"' not in body
    finally:
        proc.terminate()
        rc = proc.wait(timeout=30)
    assert rc == 0  # SIGTERM is a clean shutdown


def test_serve_metrics_port_in_use_is_an_error(data: DataDir, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(data.argv("serve-metrics", "--port", str(port))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvmem: error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "soon"])
def test_serve_metrics_refuses_an_interval_that_is_not_positive(
    data: DataDir, interval: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(data.argv("serve-metrics", "--port", "0", "--interval", interval))
    assert exited.value.code == 2 and "expected a number of seconds > 0" in capsys.readouterr().err


# -- Grafana dashboard ----------------------------------------------------------------------------
def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out += _panels(p.get("panels", []))
    return out


def _metric_names() -> dict[str, set[str]]:
    """Family name -> the sample names Prometheus stores for it."""
    names = {}
    for family in Metrics().registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        names[family.name] = {family.name + s for s in suffixes}
    return names


def test_dashboard_is_valid_and_references_only_real_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in _panels(dash["panels"]) if p["type"] != "row"]
    assert len({p["id"] for p in _panels(dash["panels"])}) == len(_panels(dash["panels"]))
    exprs = []
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        exprs += [t["expr"] for t in p["targets"]]
    known = _metric_names()
    samples = set().union(*known.values())
    referenced = {m for e in exprs for m in re.findall(r"\bkvmem_[a-z_]+", e)}
    assert referenced <= samples, referenced - samples
    covered = {f for f, s in known.items() if s & referenced}
    assert set(known) >= CORE_METRICS
    assert covered >= CORE_METRICS, f"metrics without a panel: {CORE_METRICS - covered}"
    for e in exprs:
        assert e.count("(") == e.count(")") and 'instance=~"$instance"' in e, e
