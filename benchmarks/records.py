"""Results records: what every benchmark writes when it finishes, and what ``render.py`` reads.

A record is one JSON file, ``benchmarks/results/<benchmark>/<UTC timestamp>-<short commit>.json``
(``...-quick.json`` for a smoke run, which the renderer never shows and git ignores)::

    {
      "schema": 1,
      "benchmark": "bench_store",
      "source": "run",                       # or "converted from the README"
      "quick": false,
      "date": "2026-12-05T10:11:12Z",        # UTC; a converted record may give the day only
      "commit": {"id": "<40 hex>", "short": "64a52af", "dirty": false, "changed": [], "note": ""},
      "machine": {"description": "...", "cpu": "...", "cores": 2, "memory_bytes": ..., "torch": "2.14.1",
                  "thp": "madvise", "load_start": [..], "load_end": [..], "extra": {...}},
      "command": "python benchmarks/bench_store.py",
      "figures": [FIGURE, ...],
      "headline": ["<figure id>", ...],      # the figures the README's table shows
      "notes": "...",                        # optional, as "data": raw data beside the figures
    }

A figure is one measured quantity, kvmem beside what it is compared with::

    {"id": "cpu-load", "what": "CPU tier load", "unit": "GB/s", "kvmem": 2.6,
     "references": [{"name": "np.copyto into a warm buffer", "value": 3.0, "ratio": 0.87}],
     "ratio": "kvmem speed / reference speed", "group": "32 MiB KV chunks"}

A value is a number, a ``[low, high]`` range (a converted record that only gave the spread of several
runs), a string (a row that did not run, and why), or ``null``. A ratio is > 1 where kvmem does better.
A script builds its figures with :func:`figure` and :func:`ref`, and writes them with :func:`write`;
:func:`validate` names what is wrong with a record.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "Run", "figure", "load_records", "record_paths", "ref", "slug", "start", "validate", "write"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = 1
SOURCES = ("run", "converted from the README")
REQUIRED = ("schema", "benchmark", "source", "quick", "date", "commit", "machine", "command", "figures", "headline")

Value = float | int | str | list[float] | None


def slug(text: str) -> str:
    """``text`` as a figure id: its lower-case words joined by ``-`` (``"vLLM + kvmem (CPU tier)"``:
    ``vllm-kvmem-cpu-tier``)."""
    return "-".join(re.findall(r"[a-z0-9_]+", text.lower()))


def ref(name: str, value: Value, ratio: Value = None, unit: str | None = None, ratio_is: str = "") -> dict[str, Any]:
    """A reference a figure is compared with: its ``name``, its ``value`` and kvmem's ``ratio`` to it.

    ``ratio_is`` says how this ratio is taken where it differs from the figure's ``ratio``.
    """
    out: dict[str, Any] = {"name": name, "value": _plain(value), "ratio": _plain(ratio)}
    if unit is not None:
        out["unit"] = unit
    if ratio_is:
        out["ratio_is"] = ratio_is
    return out


def figure(
    fid: str,
    what: str,
    unit: str,
    kvmem: Value,
    *references: dict[str, Any],
    ratio: str = "",
    group: str = "",
    decimals: int | None = None,
) -> dict[str, Any]:
    """One measured quantity: ``kvmem``'s value in ``unit`` beside its ``references``.

    Args:
        fid: a short id, unique in the record (the history table's columns and the headline name it).
        what: what was measured, as the table's first column says it.
        unit: the unit of ``kvmem`` and of every reference without its own.
        ratio: how the ratios are taken (``"reference time / kvmem time"``): > 1 where kvmem does better.
        group: the table the figure belongs to in the docs page (``"64 KiB items"``).
        decimals: digits after the point when rendered (default: by magnitude).
    """
    out: dict[str, Any] = {
        "id": fid,
        "what": what,
        "unit": unit,
        "kvmem": _plain(kvmem),
        "references": list(references),
    }
    if ratio:
        out["ratio"] = ratio
    if group:
        out["group"] = group
    if decimals is not None:
        out["decimals"] = decimals
    return out


def _plain(value: Value) -> Value:
    """Numbers as JSON keeps them: floats rounded to 6 significant digits (the rest is noise), NaN as null."""
    if isinstance(value, float):
        return None if value != value else float(f"{value:.6g}")
    if isinstance(value, list):
        return [float(f"{v:.6g}") for v in value]
    return value


class Run:
    """What a benchmark knows about its run from its start: the time, the load, the command line."""

    def __init__(self, benchmark: str, argv: Sequence[str] | None = None, python: str = "python") -> None:
        self.benchmark = benchmark
        self.started = time.time()
        self.load_start = [round(x, 2) for x in os.getloadavg()]
        args = list(sys.argv[1:] if argv is None else argv)
        self.command = " ".join([python, shlex.join([f"benchmarks/{benchmark}.py", *args])])


def start(benchmark: str, argv: Sequence[str] | None = None, python: str = "python") -> Run:
    """Call first thing in ``main``: notes the load average and the command line of ``benchmark``'s run
    (``python``: the interpreter as the command line names it, e.g. ``"$VENV/bin/python"`` for the vLLM venv's)."""
    return Run(benchmark, argv, python)


def write(
    run: Run,
    figures: Sequence[Mapping[str, Any]],
    *,
    headline: Sequence[str] = (),
    machine: Mapping[str, Any] | None = None,
    quick: bool = False,
    notes: str = "",
    data: Mapping[str, Any] | None = None,
    results: Path = RESULTS,
) -> Path:
    """Write ``run``'s record under ``results/<benchmark>/`` and say where; returns the file.

    Args:
        figures: every figure the run measured (:func:`figure`).
        headline: ids of the figures the README's table shows (a smoke run's are never shown).
        machine: what the script knows about the machine's state beyond :func:`machine_info`'s (the
            filesystem, page cache, threads, memcpy speed...), kept under ``machine.extra``.
        quick: a smoke run (``--quick``): written as ``...-quick.json``, which the renderer skips.
        data: raw data the script keeps beside its figures (each repetition's rows...), as ``data``.
    """
    commit = commit_info()
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "benchmark": run.benchmark,
        "source": "run",
        "quick": quick,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(run.started)),
        "commit": commit,
        "machine": machine_info(run.load_start, dict(machine or {})),
        "command": run.command,
        "figures": [dict(f) for f in figures],
        "headline": list(headline),
    }
    if notes:
        record["notes"] = notes
    if data:
        record["data"] = dict(data)
    problems = validate(record)
    if problems:
        raise ValueError(f"{run.benchmark}: the record is not valid: {'; '.join(problems)}")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(run.started))
    path = results / run.benchmark / f"{stamp}-{commit['short'] or 'nocommit'}{'-quick' if quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"results record: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path


def commit_info() -> dict[str, Any]:
    """HEAD's id, and whether the tree differs from it (which tracked paths, results records aside)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
        return done.stdout if done.returncode == 0 else ""

    head = git("rev-parse", "HEAD").strip()
    changed = [
        line[3:]
        for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
        if not line[3:].startswith("benchmarks/results/")
    ]
    return {"id": head or None, "short": head[:7] or None, "dirty": bool(changed), "changed": changed[:50]}


def machine_info(load_start: Sequence[float], extra: dict[str, Any]) -> dict[str, Any]:
    """CPU model, cores, memory, torch, transparent huge pages and the load at start and now."""
    return {
        "description": "",
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_bytes": _meminfo("MemTotal"),
        "torch": _version("torch"),
        "kvmem": _version("kvmem"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "thp": _bracketed(Path("/sys/kernel/mm/transparent_hugepage/enabled")),
        "load_start": list(load_start),
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "extra": extra,
    }


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return found.group(1).strip() if found else platform.processor() or "unknown"


def _meminfo(field: str) -> int | None:
    try:
        found = re.search(rf"^{field}:\s+(\d+) kB$", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def _bracketed(path: Path) -> str | None:
    """The chosen one of a sysfs setting's choices (``always [madvise] never`` -> ``madvise``)."""
    try:
        found = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- reading and checking -------------------------------------------------------------------------------------------
def record_paths(results: Path = RESULTS) -> list[Path]:
    """The record files under ``results`` (``<benchmark>/<stamp>-<commit>[-quick].json``), sorted: not the
    other JSON files a script may leave there (a trained model's ``config.json``)."""
    return sorted(p for p in results.glob("*/*.json") if _RECORD_NAME.match(p.name))


_RECORD_NAME = re.compile(r"^\d{8}(T\d{6}Z)?-[\w.-]+\.json$")


def load_records(results: Path = RESULTS) -> dict[str, list[dict[str, Any]]]:
    """Every record under ``results``, per benchmark, oldest first (by date, then file name)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for path in record_paths(results):
        record = json.loads(path.read_text())
        record["_file"] = path.relative_to(results).as_posix()
        found.setdefault(path.parent.name, []).append(record)
    for records in found.values():
        records.sort(key=lambda r: (str(r.get("date", "")), r["_file"]))
    return found


def validate(record: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``record`` (empty: nothing): required fields, their types, figure ids."""
    problems = [f"no {key!r}" for key in REQUIRED if key not in record]
    if problems:
        return problems
    if record["schema"] != SCHEMA:
        problems.append(f"schema {record['schema']!r}, expected {SCHEMA}")
    if record["source"] not in SOURCES:
        problems.append(f"source {record['source']!r}, expected one of {SOURCES}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}Z)?", str(record["date"])):
        problems.append(f"date {record['date']!r} is not YYYY-MM-DD[THH:MM:SSZ]")
    commit = record["commit"]
    if not isinstance(commit, dict) or not {"id", "dirty"} <= commit.keys():
        problems.append("commit needs 'id' and 'dirty'")
    machine = record["machine"]
    if not isinstance(machine, dict) or not (machine.get("cpu") or machine.get("description")):
        problems.append("machine needs 'cpu' or 'description'")
    if record["source"] == "run":
        for key in ("cores", "memory_bytes", "torch", "thp", "load_start", "load_end"):
            if isinstance(machine, dict) and key not in machine:
                problems.append(f"machine has no {key!r}")
    ids: set[str] = set()
    for i, fig in enumerate(record["figures"]):
        missing = [k for k in ("id", "what", "unit", "kvmem", "references") if k not in fig]
        if missing:
            problems.append(f"figure {i} has no {', '.join(missing)}")
            continue
        if fig["id"] in ids:
            problems.append(f"figure id {fig['id']!r} twice")
        ids.add(fig["id"])
        for value in [fig["kvmem"], *(r.get("value") for r in fig["references"]), *_ratios(fig)]:
            if not _is_value(value):
                problems.append(f"figure {fig['id']!r}: {value!r} is not a number, [low, high], text or null")
        for r in fig["references"]:
            if "name" not in r:
                problems.append(f"figure {fig['id']!r}: a reference has no name")
    for fid in record["headline"]:
        if fid not in ids:
            problems.append(f"headline names {fid!r}, which no figure has")
    return problems


def _ratios(fig: Mapping[str, Any]) -> list[Any]:
    return [r.get("ratio") for r in fig["references"]]


def _is_value(value: object) -> bool:
    if value is None or isinstance(value, str) or (isinstance(value, int | float) and not isinstance(value, bool)):
        return True
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, int | float) for v in value)
