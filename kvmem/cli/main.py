"""The ``kvmem`` command line: demo, stats, ls, verify, gc, migrate, doctor, config, serve-metrics.

Every subcommand takes ``--path`` (the data directory; default: the configured
one) and ``--config FILE`` (a YAML settings file; default: ``$KVMEM_CONFIG``).
A :class:`~kvmem.errors.KVMemError` prints one line on stderr and exits with 2;
``verify`` exits with 1 when it finds problems it did not fix, ``doctor`` when it
warns, ``demo`` when reused KV does not reproduce the model's logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from types import FrameType

from kvmem import blob as blobfmt
from kvmem.api import EntryInfo, Memory
from kvmem.cli.demo import LLAMA_3_2_1B, cpu_bytes_for, render_report, run_demo
from kvmem.cli.doctor import check, render_findings
from kvmem.cli.doctor_snapshot import take_snapshot
from kvmem.cli.table import format_percent, render_table
from kvmem.config import Config, describe, format_size, load_config
from kvmem.errors import ConfigError, KVMemError
from kvmem.metrics import Exporter

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2
_SIZE_FIELDS = {"gpu_bytes", "cpu_bytes", "disk_bytes"}
_SHARED_METRICS = ("kvmem_memory_usage_bytes", "kvmem_capacity_bytes")  # what serve-metrics can see
Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvmem`` command line.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success, 1 problems found (``verify``, ``demo``, ``doctor``), 2 error.
    """
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KVMemError as exc:
        message = " ".join(str(exc).split())
        print(f"kvmem: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--path", help="data directory (default: the configured one)")
    common.add_argument("--config", metavar="FILE", help="YAML settings file (default: $KVMEM_CONFIG)")
    parser = argparse.ArgumentParser(prog="kvmem", description="Content-addressed memory for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Handler, help_text: str, json_flag: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    demo = add(
        "demo",
        cmd_demo,
        "time to first token with and without kvmem: one long document, several "
        "questions, the document's KV reused (in a fresh temporary directory unless "
        "--path is given)",
    )
    demo.add_argument("--doc-tokens", type=_positive_int, default=4096, help="document length (default: 4096)")
    demo.add_argument("--questions", type=_positive_int, default=4, help="questions asked (default: 4)")
    demo.add_argument("--model", metavar="PATH", help="local checkpoint directory (default: a small random Llama)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    demo.add_argument(
        "--tiers",
        action="store_true",
        help="instead, store and reload a KV-sized workload through the tiers and report hits, demotions, GB/s",
    )
    demo.add_argument("--chunks", type=_positive_int, default=24, help="with --tiers: KV chunks to store (default: 24)")
    add("stats", cmd_stats, "entries, bytes and per-tier usage", json_flag=True)
    ls = add("ls", cmd_ls, "list entries, most recently used first", json_flag=True)
    ls.add_argument("--namespace", help="only entries of this namespace")
    ls.add_argument("--limit", type=_non_negative_int, default=100, help="most rows to show (0: all; default 100)")
    verify = add("verify", cmd_verify, "check every stored copy's CRC against the catalog", json_flag=True)
    verify.add_argument("--fix", action="store_true", help="quarantine corrupt copies and repair the catalog")
    add("gc", cmd_gc, "drop catalog rows without data, empty the quarantine, enforce capacities", json_flag=True)
    migrate = add(
        "migrate",
        cmd_migrate,
        "rewrite the disk tier's entries in another blob format while they "
        "are served: hottest first, resumable, then switched atomically",
        json_flag=True,
    )
    migrate.add_argument(
        "--to-format",
        type=int,
        required=True,
        choices=blobfmt.FORMATS,
        help=f"blob format to write ({', '.join(map(str, blobfmt.FORMATS))})",
    )
    add(
        "doctor",
        cmd_doctor,
        "check a data directory's config, catalog, tiers and quarantine against the "
        "tuning table; print findings, their numbers and the setting to change",
        json_flag=True,
    )
    add(
        "config",
        cmd_config,
        "the effective configuration and where each value came from (passwords as ***)",
        json_flag=True,
    )
    serve = add(
        "serve-metrics",
        cmd_serve_metrics,
        "serve Prometheus /metrics of the data directory: usage "
        "and capacity of its disk and remote tiers, which every "
        "process shares; hits, misses, latencies and the CPU tier "
        "are per process: each serves them on its own metrics_port",
    )
    serve.add_argument("--port", type=_non_negative_int, required=True, help="TCP port (0: any free port)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument(
        "--interval", type=_positive_float, default=5.0, help="seconds between usage refreshes (default 5)"
    )
    return parser


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return value


# -- opening the data directory -----------------------------------------------------
def _config(args: argparse.Namespace) -> Config:
    """The config of ``--config`` (or ``$KVMEM_CONFIG``), the environment and ``--path``."""
    if args.path is None:
        return load_config(args.config)
    return load_config(args.config, path=args.path)


def _open_existing(args: argparse.Namespace, **settings: object) -> Memory:
    """A ``Memory`` on an existing data directory (a typo in ``--path`` must not create one), with ``settings``.

    NOTE: never with a ``metrics_port``: these commands look at the directory, they are not the
    working processes whose metrics a configured port is for (and would take it from them).

    Raises:
        ConfigError: the directory does not exist.
    """
    config = _config(args)
    if config.catalog_url is None and not Path(config.path).is_dir():
        raise ConfigError(
            f"path={config.path!r}: no kvmem data directory there; pass --path DIR of an "
            "existing one, or store something there first (e.g. kvmem demo --path DIR)"
        )
    return Memory(config=config.replace(metrics_port=None, **settings))


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


# -- demo -------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    """``kvmem demo``: exit 0 when warm logits match cold ones (``--tiers``: loads are bit-exact), else 1."""
    base = _config(args)
    temporary = args.path is None
    path = tempfile.mkdtemp(prefix="kvmem-demo-") if temporary else args.path
    where = "temporary; removed at the end, --keep keeps it" if temporary and not args.keep else "kept"
    try:
        if args.tiers:
            print(f"data directory: {path} ({where})", flush=True)
            return _demo_tiers(base.replace(path=path), args.chunks)
        return _demo_qa(args, base.replace(path=path), f"{path} ({where})")
    finally:
        if temporary and not args.keep:
            shutil.rmtree(path, ignore_errors=True)


def _demo_tiers(config: Config, chunks: int) -> int:
    cpu = cpu_bytes_for(LLAMA_3_2_1B, config.block_size, chunks, config.offload_threshold)
    with Memory(config=config.replace(cpu_bytes=cpu)) as memory:
        report = run_demo(memory, chunks, layout=LLAMA_3_2_1B, tokens=config.block_size)
    print(render_report(report))
    return EXIT_PROBLEMS if report.failures else EXIT_OK


def _demo_qa(args: argparse.Namespace, config: Config, where: str) -> int:
    try:
        from kvmem.cli import demo_qa as qa  # late: transformers is an optional extra, slow to import
    except ImportError as exc:
        raise ConfigError(
            f"kvmem demo needs transformers ({exc}); install kvmem[kv], or run kvmem demo --tiers"
        ) from None
    print(
        "kvmem demo: time to first token of long-document questions, cold vs with the document's KV reused", flush=True
    )
    if args.model:
        model, tokenizer = qa.load_local_model(args.model)
        origin = args.model
    else:
        model, tokenizer, origin = qa.build_demo_model(), None, "random weights from a config, seed 0"
    work = qa.make_workload(model, args.doc_tokens, args.questions, tokenizer=tokenizer)
    print(
        f"model           {qa.describe_model(model, origin)}\n"
        f"workload        1 document of {len(work.document)} tokens + {qa.question_summary(work.questions)}; "
        f"{work.source}\ndata directory  {where}\n",
        flush=True,
    )
    report = qa.run_qa_demo(model, config, work, say=lambda line: print(line, flush=True))
    print()
    print(qa.render_qa_report(report))
    return EXIT_OK if report.ok else EXIT_PROBLEMS


# -- stats / ls -------------------------------------------------------------------------
def cmd_stats(args: argparse.Namespace) -> int:
    """``kvmem stats``: catalog totals and per-tier occupancy."""
    with _open_existing(args) as memory:
        st = memory.stats()
        path, catalog = memory.config.path, memory.database.shown_url
    if args.json:
        _print_json(
            {
                "path": path,
                "entries": st.entries,
                "size": st.size,
                "stored_size": st.stored_size,
                "recorded_hits": st.recorded_hits,
                "tiers": [dataclasses.asdict(t) for t in st.tiers],
            }
        )
        return EXIT_OK
    ratio = f" (compression ratio {st.size / st.stored_size:.2f})" if st.stored_size else ""
    print(
        f"data directory  {path}\ncatalog         {catalog}\nentries         {st.entries}\n"
        f"bytes raw       {format_size(st.size)} ({st.size} B)\n"
        f"bytes stored    {format_size(st.stored_size)} ({st.stored_size} B){ratio}\n"
        f"hits recorded   {st.recorded_hits}\n"
    )
    print(
        render_table(
            ["tier", "usage", "capacity", "used", "entries", "healthy"],
            [
                [
                    t.name,
                    format_size(t.usage),
                    format_size(t.capacity),
                    format_percent(t.usage, t.capacity),
                    t.entries,
                    "yes" if t.healthy else "no",
                ]
                for t in st.tiers
            ],
        )
    )
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    """``kvmem ls``: one row per entry, most recently used first."""
    with _open_existing(args) as memory:
        rows = list(memory.entries(args.namespace, args.limit + 1 if args.limit else None))
    more = bool(args.limit) and len(rows) > args.limit
    rows = rows[: args.limit] if args.limit else rows
    if args.json:
        _print_json([dataclasses.asdict(e) for e in rows])
        return EXIT_OK
    print(
        render_table(
            ["key", "namespace", "user key", "kind", "size", "stored", "codec", "version", "hits", "last access"],
            [_ls_row(e) for e in rows],
        )
    )
    if more:
        print(f"(first {args.limit} shown; --limit 0 lists all)")
    return EXIT_OK


def _ls_row(e: EntryInfo) -> list[object]:
    return [
        e.key[:12],
        _preview(e.namespace, 20),
        _preview(e.user_key, 28),
        e.kind,
        format_size(e.size),
        format_size(e.stored_size),
        e.codec,
        e.version,
        e.hits,
        datetime.fromtimestamp(e.last_access).strftime("%Y-%m-%d %H:%M:%S"),
    ]


def _preview(text: str, width: int) -> str:
    """``text`` with control characters escaped, cut to ``width`` characters."""
    shown = text if text.isprintable() else repr(text)[1:-1]
    return shown if len(shown) <= width else shown[: width - 3] + "..."


# -- verify / gc --------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    """``kvmem verify [--fix]``: exit 1 when problems were found and not fixed."""
    with _open_existing(args) as memory:
        report = memory.verify(fix=args.fix, progress=sys.stderr.isatty() and not args.json)
    status = EXIT_OK if report.ok or report.fixed else EXIT_PROBLEMS
    if args.json:
        _print_json(
            {
                "checked": report.checked,
                "ok": report.ok,
                "fixed": report.fixed,
                "corrupt": [{"tier": t, "key": k, "reason": r} for t, k, r in report.corrupt],
                "orphans": report.orphans,
                "missing": report.missing,
            }
        )
        return status
    print(
        f"checked {report.checked} stored copies: {len(report.corrupt)} corrupt, "
        f"{len(report.orphans)} not in the catalog, {len(report.missing)} catalog entries without data"
    )
    problems = (
        [("corrupt", t, k, r) for t, k, r in report.corrupt]
        + [("orphan", "", k, "held by a tier, missing from the catalog") for k in report.orphans]
        + [("missing", "", k, "in the catalog, held by no tier") for k in report.missing]
    )
    if problems:
        print(render_table(["problem", "tier", "key", "detail"], problems))
    if report.ok:
        print("OK: everything checks out")
    elif report.fixed:
        print("fixed: corrupt copies quarantined, orphans registered, rows without data dropped")
    else:
        print("problems found; run `kvmem verify --fix` to quarantine corrupt copies and repair the catalog")
    return status


def cmd_gc(args: argparse.Namespace) -> int:
    """``kvmem gc``: reclaim what no entry needs."""
    with _open_existing(args) as memory:
        report = memory.gc()
    return _print_report(
        args,
        report,
        f"removed {report.rows_removed} catalog rows without data; freed "
        f"{format_size(report.quarantine_bytes_freed)} of quarantined entries; "
        f"reclaimed {report.versions_reclaimed} pinned versions no pin holds",
    )


def cmd_migrate(args: argparse.Namespace) -> int:
    """``kvmem migrate --to-format N``: rewrite the disk tier's blobs while the data directory is in use."""
    with _open_existing(args) as memory:
        report = memory.migrate(args.to_format, progress=sys.stderr.isatty() and not args.json)
    resumed = "; resumed an interrupted run" if report.resumed else ""
    return _print_report(
        args,
        report,
        f"disk tier in blob format {report.to_format} (area {report.area}): "
        f"{report.migrated} entries rewritten, {report.present} already there, "
        f"{report.vanished} deleted meanwhile, {report.corrupt} corrupt left "
        f"behind{resumed}",
    )


def _print_report(args: argparse.Namespace, report: object, text: str) -> int:
    """A report dataclass as JSON with ``--json``, else ``text``; exit status OK."""
    if args.json:
        _print_json(dataclasses.asdict(report))  # type: ignore[call-overload]
    else:
        print(text)
    return EXIT_OK


# -- doctor -----------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    """``kvmem doctor``: exit 1 when a finding is a warning."""
    with _open_existing(args) as memory:
        snapshot = take_snapshot(memory, live=False)  # this process has counted nothing yet
    findings = check(snapshot)
    status = EXIT_PROBLEMS if any(f.severity == "warn" for f in findings) else EXIT_OK
    if args.json:
        _print_json({"path": snapshot.config.path, "findings": [dataclasses.asdict(f) for f in findings]})
        return status
    kv_chunks = sum(g.chunks for g in snapshot.kv)
    print(
        f"kvmem doctor: {snapshot.config.path}: {snapshot.entries} entries ({kv_chunks} KV chunks), "
        f"{format_size(snapshot.stored_bytes)} stored\n"
    )
    print(render_findings(findings))
    return status


# -- config -----------------------------------------------------------------------------------
def cmd_config(args: argparse.Namespace) -> int:
    """``kvmem config``: every setting, its value and its source."""
    rows = describe(_config(args))
    if args.json:
        _print_json({name: {"value": value, "source": source} for name, value, source in rows})
        return EXIT_OK
    print(render_table(["setting", "value", "source"], [[n, _config_value(n, v), s] for n, v, s in rows]))
    return EXIT_OK


def _config_value(name: str, value: object) -> str:
    if name in _SIZE_FIELDS and isinstance(value, int):
        return f"{value} ({format_size(value)})"
    return "-" if value is None or value == "" else str(value)


# -- serve-metrics ------------------------------------------------------------------------------
def cmd_serve_metrics(args: argparse.Namespace) -> int:
    """``kvmem serve-metrics``: serve the shared tiers' usage and capacity until Ctrl-C or SIGTERM.

    Hits, misses and latencies happen in the processes doing the work, and so does their
    CPU tier: each serves those itself (``metrics_port``). This process sees what they share,
    the disk tier's files (rescanned every ``--interval``) and the remote tier.
    """
    config = _config(args)
    if not config.disk_bytes and not config.remote_url:
        raise ConfigError(
            f"serve-metrics: {config.path} has no disk tier (disk_bytes=0) and no remote_url: "
            "nothing there is shared between processes; each serves its own with metrics_port"
        )
    with _open_existing(args, cpu_bytes=0, gpu_bytes=0) as memory:
        exporter = Exporter(memory.metrics.registry.restricted_registry(_SHARED_METRICS), args.host, args.port)
        print(f"serving {exporter.url} for {memory.config.path} (Ctrl-C to stop)", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            while True:
                time.sleep(args.interval)
                _rescan(memory)
        except KeyboardInterrupt:
            pass
        exporter.close()
    return EXIT_OK


def _rescan(memory: Memory) -> None:
    """Re-read tiers that other processes write (``rescan``): the usage gauges read them when scraped."""
    for tier in memory._tiers.tiers:  # an operator's tool beside the core reads the tiers themselves
        rescan = getattr(tier, "rescan", None)
        if rescan is not None:
            rescan()


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
