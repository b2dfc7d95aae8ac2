"""Render the benchmark tables from the results records: README.md's headline table and the docs pages.

    python benchmarks/render.py            # write README.md's table, docs/benchmarks/*.md and their index
    python benchmarks/render.py --check    # exit 1 (and say where) when any of them differs from the records

Each target keeps its own prose; only the text between its markers is rendered:

- ``README.md``: ``<!-- benchmarks:start -->`` ... ``<!-- benchmarks:end -->``, one row per headline figure
  of the newest record of each benchmark (what, kvmem, the reference, the ratio, the command);
- ``docs/benchmarks/<benchmark>.md``: ``<!-- results:start -->`` ... ``<!-- results:end -->``, the newest
  record's every figure with its commit and machine, then a history table built from all its records;
- ``docs/benchmarks/index.md``: the same markers, a line per benchmark;
- ``README.md``'s section of a benchmark in ``README_SECTIONS``: ``<!-- <benchmark>:start -->`` ...
  ``<!-- <benchmark>:end -->``, its newest record's figures as a table per group, a row per series
  (figures named ``"<series>: <quantity>"``), a column per quantity.

Smoke runs (``quick``) are never rendered. A page that does not exist yet is created with a stub of prose.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import RESULTS, ROOT, load_records  # noqa: E402  (a sibling module, not a package)

__all__ = ["BENCHMARKS", "check", "render_all"]

# NOTE: the order of the README's table and of the index; each name is a script in benchmarks/ and a docs page
BENCHMARKS = (
    "bench_peer_lmcache",
    "bench_store",
    "bench_ttft",
    "bench_agent",
    "bench_blend",
    "bench_prefetch",
    "sim_eviction",
    "bench_serving",
    "bench_connector_chunks",
    "bench_remote",
    "bench_visual",
    "bench_semantic",
    "train_tiny_lm",
)
README = ROOT / "README.md"
DOCS = ROOT / "docs" / "benchmarks"
README_MARKERS = ("<!-- benchmarks:start -->", "<!-- benchmarks:end -->")
README_SECTIONS = ("bench_blend",)  # benchmarks whose newest figures the README's section of them shows
PAGE_MARKERS = ("<!-- results:start -->", "<!-- results:end -->")
HISTORY_COLUMNS = 4


# -- numbers --------------------------------------------------------------------------------------------------------
def number(value: Any, unit: str = "", decimals: int | None = None) -> str:
    """``value`` as a table shows it: a number in ``unit``, a ``low–high`` range, a text, or nothing."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return f"{_digits(value[0], decimals)}–{_digits(value[1], decimals)}{_unit(unit)}"
    return f"{_digits(value, decimals)}{_unit(unit)}"


def ratio(value: Any) -> str:
    """A ratio: two decimals below 10, fewer above (``1.26``, ``13.8``, ``632``)."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        return f"{ratio(value[0])}–{ratio(value[1])}"
    return _digits(value, 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0)


def ratio_note(reference: Mapping[str, Any]) -> str:
    """How a reference's ratio is taken, where it differs from the usual (`` (kvmem / oracle)``)."""
    return f" ({escape(reference['ratio_is'])})" if reference.get("ratio_is") else ""


def _digits(value: float, decimals: int | None) -> str:
    if decimals is None:
        size = abs(value)
        decimals = 0 if size >= 100 or value == int(value) else 1 if size >= 10 else 2 if size >= 1 else 3
    return f"{value:,.{decimals}f}"


def _unit(unit: str) -> str:
    return {"": "", "x": "×", "%": " %"}.get(unit, f" {unit}")


# -- what a record says ---------------------------------------------------------------------------------------------
def shown(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records the tables show: every one but smoke runs, oldest first."""
    return [r for r in records if not r.get("quick")]


def headline_record(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The newest record whose headline figures all have kvmem's value (a converted record may keep only
    ratios), else the newest."""
    for record in reversed(records):
        figs = figures_by_id(record)
        if record["headline"] and all(figs[fid]["kvmem"] is not None for fid in record["headline"]):
            return record
    return records[-1]


def short_commit(record: Mapping[str, Any]) -> str:
    short = record["commit"].get("short")
    return f"`{short}`" if short else "converted" if record["source"] != "run" else "unknown"


def commit_text(record: Mapping[str, Any]) -> str:
    commit = record["commit"]
    short = commit.get("short") or (commit.get("id") or "")[:7]
    text = f"`{short}`" if short else "unknown"
    if commit.get("note"):
        text += f" ({commit['note']})"
    if commit.get("dirty"):
        text += " (with uncommitted changes)"
    return text


def machine_text(record: Mapping[str, Any]) -> str:
    """The machine in one line: its description or CPU and cores, memory, torch, THP, load."""
    m = record["machine"]
    parts = [m.get("description") or f"{m.get('cores', '?')} × {m.get('cpu', '?')}"]
    if m.get("memory_bytes"):
        parts.append(f"{m['memory_bytes'] / 2**30:.0f} GiB")
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    if m.get("thp"):
        parts.append(f"THP {m['thp']}")
    if m.get("load_start") is not None and m.get("load_end") is not None:
        parts.append(f"load {m['load_start'][0]:.1f} → {m['load_end'][0]:.1f}")
    extra = m.get("extra") or {}
    parts += [f"{k} {v}" for k, v in extra.items() if isinstance(v, str | int | float)]
    return ", ".join(parts)


def figures_by_id(record: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {f["id"]: f for f in record["figures"]}


def escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- README ---------------------------------------------------------------------------------------------------------
def readme_table(all_records: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The headline table: a row per headline figure of each benchmark's newest record."""
    lines = [
        "| what | kvmem | reference | ratio | command | measured |",
        "| --- | ---: | --- | ---: | --- | --- |",
    ]
    for name in BENCHMARKS:
        records = shown(all_records.get(name, []))
        if not records:
            continue
        newest = headline_record(records)
        figs = figures_by_id(newest)
        link = f"[{newest['date'][:10]}, {short_commit(newest)}](docs/benchmarks/{name}.md)"
        whats = [figs[fid]["what"] for fid in newest["headline"]]
        for fid in newest["headline"]:
            f = figs[fid]
            what = f["what"]
            if whats.count(what) > 1 and f.get("group"):  # NOTE: the same quantity in two tables: say which
                what = f"{what} ({f['group']})"
            r = f["references"][0] if f["references"] else {}
            reference = number(r.get("value"), r.get("unit", f["unit"]), r.get("decimals", f.get("decimals")))
            if r:
                reference = f"{reference} ({escape(r['name'])})" if reference else escape(r["name"])
            lines.append(
                f"| {escape(what)} | {number(f['kvmem'], f['unit'], f.get('decimals'))} | {reference} | "
                f"{ratio(r.get('ratio'))}{ratio_note(r)} | "
                f"`{escape(newest['command'])}` | {link} |"
            )
    lines.append("")
    lines.append(
        "Ratios are taken so that > 1 means kvmem does better (a reference's time over kvmem's), unless the "
        "benchmark's page says otherwise. Each row is from the newest results record of its benchmark; its page "
        "has every figure, the commit, the machine and the history."
    )
    return "\n".join(lines)


def readme_section(name: str, records: Sequence[Mapping[str, Any]]) -> str:
    """A benchmark's README section: its newest record's figures, a :func:`series_table` per group."""
    records = shown(records)
    if not records:
        return f"No results record yet: run `python benchmarks/{name}.py`, then `python benchmarks/render.py`."
    newest = records[-1]
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for f in newest["figures"]:
        groups.setdefault(f.get("group", ""), []).append(f)
    out = []
    for group, figs in groups.items():
        out += ([f"**{escape(group)}**", ""] if group else []) + series_table(figs) + [""]
    out.append(
        f"Measured {newest['date'][:10]}, commit {commit_text(newest)}, `{escape(newest['command'])}`: "
        f"[every figure and the machine](docs/benchmarks/{name}.md)."
    )
    return "\n".join(out)


def series_table(figs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Figures named ``"<series>: <quantity>"`` as one table: a row per series, a column per quantity, each
    cell the value (its ratio to the first reference)."""
    rows: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for f in figs:
        series, _, quantity = f["what"].partition(": ")
        if quantity not in columns:
            columns.append(quantity)
        rows.setdefault(series, {})[quantity] = history_cell(f)
    lines = [
        "| | " + " | ".join(escape(c) for c in columns) + " |",
        "| --- | " + " | ".join(["---:"] * len(columns)) + " |",
    ]
    for series, cells in rows.items():
        lines.append(f"| {escape(series)} | " + " | ".join(cells.get(c, "") for c in columns) + " |")
    meanings = sorted({f"{f['what'].partition(': ')[2]}: {f['ratio']}" for f in figs if f.get("ratio")})
    if meanings:
        lines += ["", "In parentheses: " + "; ".join(escape(m) for m in meanings) + "."]
    return lines


# -- a benchmark's page ---------------------------------------------------------------------------------------------
def page_results(name: str, records: Sequence[Mapping[str, Any]]) -> str:
    """A benchmark page's rendered part: the newest record in full, then the history of all records."""
    records = shown(records)
    if not records:
        return f"No results record yet: run `python benchmarks/{name}.py`, then `python benchmarks/render.py`."
    newest = records[-1]
    out = ["## Latest results", "", *record_header(newest), ""]
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for f in newest["figures"]:
        groups.setdefault(f.get("group", ""), []).append(f)
    for group, figs in groups.items():
        if group:
            out += [f"**{escape(group)}**", ""]
        out += figure_table(figs) + [""]
    out += ["## History", "", *history_table(records)]
    return "\n".join(out)


def record_header(record: Mapping[str, Any]) -> list[str]:
    lines = [
        f"- **measured**: {record['date'][:10]}, commit {commit_text(record)}"
        + ("" if record["source"] == "run" else f" ({record['source']})"),
        f"- **machine**: {escape(machine_text(record))}",
        f"- **command**: `{record['command']}`",
    ]
    if record.get("notes"):
        lines.append(f"- **notes**: {escape(record['notes'])}")
    return lines


def figure_table(figs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| what | kvmem | compared with | its value | ratio |", "| --- | ---: | --- | ---: | ---: |"]
    for f in figs:
        dec = f.get("decimals")
        kv = number(f["kvmem"], f["unit"], dec)
        refs = f["references"] or [{}]
        for i, r in enumerate(refs):
            what = escape(f["what"]) if i == 0 else ""
            value = number(r.get("value"), r.get("unit", f["unit"]), r.get("decimals", dec))
            lines.append(
                f"| {what} | {kv if i == 0 else ''} | {escape(r.get('name', ''))} | {value} | {ratio(r.get('ratio'))} |"
            )
    meanings = sorted(
        {f["ratio"] for f in figs if f.get("ratio")}
        | {f"{r['name']}: {r['ratio_is']}" for f in figs for r in f["references"] if r.get("ratio_is")}
    )
    if meanings:
        lines += ["", "Ratios: " + "; ".join(escape(m) for m in meanings) + "."]
    return lines


def history_columns(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The history's figure columns: the headline figures, newest record's first, then older records'."""
    seen: dict[str, str] = {}
    for record in reversed(records):
        figs = figures_by_id(record)
        for fid in record["headline"]:
            seen.setdefault(fid, figs[fid]["what"])
    return list(seen.items())[:HISTORY_COLUMNS]


def history_table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """A row per record, newest first: date, commit, machine, and each headline figure (kvmem, ratio)."""
    columns = history_columns(records)
    head = ["date", "commit", "machine", *(escape(what) for _, what in columns), "command"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for record in reversed(records):
        figs = figures_by_id(record)
        cells = [
            record["date"][:10],
            commit_text(record).split(" ")[0],
            escape(record["machine"].get("description") or record["machine"].get("cpu", "")),
        ]
        for fid, _ in columns:
            f = figs.get(fid)
            cells.append(history_cell(f) if f is not None else "")
        cells.append(f"`{escape(record['command'])}`")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each cell: kvmem's value (its ratio to the first reference)."]
    return lines


def history_cell(f: Mapping[str, Any]) -> str:
    kv = number(f["kvmem"], f["unit"], f.get("decimals"))
    r = ratio(f["references"][0].get("ratio")) if f["references"] else ""
    if kv and r:
        return f"{kv} ({r})"
    return kv or (f"({r})" if r else "")


# -- the index ------------------------------------------------------------------------------------------------------
def index_list(all_records: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    lines = ["| benchmark | what it measures | latest results |", "| --- | --- | --- |"]
    for name in BENCHMARKS:
        records = shown(all_records.get(name, []))
        latest = f"{records[-1]['date'][:10]}, {short_commit(records[-1])}" if records else "none yet"
        lines.append(f"| [`{name}`]({name}.md) | {escape(page_title(name))} | {latest} |")
    return "\n".join(lines)


def page_title(name: str) -> str:
    """What the page's first heading says after the script's name (``# bench_ttft: time to first token``)."""
    path = DOCS / f"{name}.md"
    first = path.read_text().splitlines()[0] if path.exists() else ""
    return first.split(":", 1)[1].strip() if ":" in first else ""


# -- writing and checking -------------------------------------------------------------------------------------------
def between(text: str, markers: tuple[str, str], body: str, where: Path) -> str:
    """``text`` with what lies between ``markers`` replaced by ``body``."""
    start, end = markers
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise SystemExit(f"{where}: needs exactly one {start} before one {end}")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


def stub(name: str) -> str:
    return (
        f"# {name}\n\nWhat it measures: see `benchmarks/{name}.py`'s docstring.\n\n"
        f"```bash\npython benchmarks/{name}.py\n```\n\n{PAGE_MARKERS[0]}\n{PAGE_MARKERS[1]}\n"
    )


def render_all(results: Path = RESULTS) -> dict[Path, str]:
    """Every target file as it should read: path -> text."""
    all_records = load_records(results)
    readme = between(README.read_text(), README_MARKERS, readme_table(all_records), README)
    for name in README_SECTIONS:
        markers = (f"<!-- {name}:start -->", f"<!-- {name}:end -->")
        readme = between(readme, markers, readme_section(name, all_records.get(name, [])), README)
    out: dict[Path, str] = {README: readme}
    for name in BENCHMARKS:
        path = DOCS / f"{name}.md"
        text = path.read_text() if path.exists() else stub(name)
        out[path] = between(text, PAGE_MARKERS, page_results(name, all_records.get(name, [])), path)
    index = DOCS / "index.md"
    out[index] = between(index.read_text(), PAGE_MARKERS, index_list(all_records), index)
    return out


def check(results: Path = RESULTS) -> list[str]:
    """The target files that differ from what the records render (empty: all in step)."""
    return [
        str(path.relative_to(ROOT))
        for path, text in render_all(results).items()
        if not path.exists() or path.read_text() != text
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a target differs")
    args = p.parse_args(argv)
    if args.check:
        stale = check()
        for stale_path in stale:
            print(f"{stale_path}: differs from the results records (run python benchmarks/render.py)")
        return 1 if stale else 0
    for path, text in render_all().items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
