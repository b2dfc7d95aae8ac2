"""bench_agent's LangGraph part: the agent of ``examples/langgraph_agent.py`` timed and its thread weighed.

- TTFT per model call, through LangGraph (``create_agent``): from the chat model's start callback to its
  first streamed token. ``kvmem``: ``ChatTransformersKV`` (each call loads the chunks earlier calls stored);
  ``plain``: the same agent, policy and decoding, whose chat model computes every prompt whole and stores
  nothing (:class:`PlainReAct`). Both ``compression="none"``; their final messages must be identical.
- Checkpoint bytes of one thread: the agent runs ``--thread-steps`` model calls once, every checkpoint and
  write going to a ``KVMemSaver`` and to ``langgraph-checkpoint-sqlite``'s ``SqliteSaver`` (:class:`TeeSaver`),
  then each saver's newest checkpoint is read, side by side.
"""

from __future__ import annotations

import sqlite3
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import records
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)
from langgraph.checkpoint.sqlite import SqliteSaver
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedTokenizerFast

import kvmem
from kvmem.kv import PrefillResult
from langchain_kvmem import KVMemSaver, KVMemStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import langgraph_agent as example  # noqa: E402  (the example's agent, not a package)

KV_TABLES = (
    "kvmem_langgraph_checkpoints",
    "kvmem_langgraph_channels",
    "kvmem_langgraph_blobs",
    "kvmem_langgraph_elements",
    "kvmem_langgraph_writes",
)
SQLITE_TABLES = ("checkpoints", "writes")
THREAD = "bench"


class PlainReAct(example.ScriptedReAct):
    """The example's chat model without kvmem: every prompt computed whole, nothing stored."""

    def _prefill(self, ids: list[int]) -> PrefillResult:
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        return PrefillResult(cache, out.logits, 0, len(ids))

    def _store_reply(self, prompt: list[int], reply: list[int], result: PrefillResult) -> None:
        return None


class FirstToken(BaseCallbackHandler):
    """Seconds from each chat model call's start to its first streamed token, in call order."""

    run_inline = True

    def __init__(self) -> None:
        self.started: dict[UUID, float] = {}
        self.ttft: list[float] = []

    def on_chat_model_start(self, serialized: dict[str, Any], messages: Any, *, run_id: UUID, **kw: Any) -> None:
        self.started[run_id] = time.perf_counter()

    def on_llm_new_token(self, token: str, *, run_id: UUID, **kw: Any) -> None:
        if (start := self.started.pop(run_id, None)) is not None:
            self.ttft.append(time.perf_counter() - start)


@dataclass
class AgentRun:
    """One thread of ``calls`` model calls."""

    ttft: list[float]  # seconds, per call
    computed: list[int]  # prompt tokens computed, per call
    messages: list[list[Any]]  # the example's summary() of the final messages


def run_agent(
    cls: type[example.ScriptedReAct],
    llama: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    memory: kvmem.Memory,
    calls: int,
    block: int,
    checkpointer: BaseCheckpointSaver[Any] | None = None,
) -> AgentRun:
    """The example's agent, ``cls`` its chat model, on ``memory``: one thread of ``calls`` model calls."""
    timer = FirstToken()
    chat = cls(model=llama, tokenizer=tokenizer, memory=memory, block_size=block, compression="none", callbacks=[timer])
    chat.lookups = calls - 1
    example.put_orders(KVMemStore(memory), calls - 1)
    graph = example.build_agent(chat, memory, checkpointer)
    out = graph.invoke({"messages": [HumanMessage(example.QUESTION)]}, example.config_of(THREAD))
    chat.close()
    replies = [m for m in out["messages"] if m.type == "ai"]
    computed = [m.usage_metadata["input_token_details"]["computed"] for m in replies]
    return AgentRun(timer.ttft, computed, example.summary(out["messages"]))


# -- TTFT -----------------------------------------------------------------------------------------------------
@dataclass
class CallRow:
    call: int
    computed: dict[str, int]  # prompt tokens computed, per series
    ttft: dict[str, list[float]] = field(default_factory=dict)  # seconds per repetition, per series

    def median_ms(self, name: str) -> float:
        return statistics.median(self.ttft[name]) * 1e3

    def speedup(self) -> float:
        """Median over repetitions of plain's TTFT / kvmem's."""
        return statistics.median(p / k for p, k in zip(self.ttft["plain"], self.ttft["kvmem"]))


def measure_ttft(
    llama: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    root: Path,
    calls: int,
    repeat: int,
    block: int,
    progress: Callable[[str], None],
) -> tuple[list[CallRow], bool]:
    """Per-call rows over ``repeat`` threads of each series (order alternating, a fresh Memory each), and
    whether every thread ended with the same messages."""
    series: dict[str, type[example.ScriptedReAct]] = {"kvmem": example.ScriptedReAct, "plain": PlainReAct}
    runs: dict[str, list[AgentRun]] = {"kvmem": [], "plain": []}
    for rep in range(repeat):
        progress(f"  LangGraph agent, repetition {rep + 1}/{repeat} ...")
        for name in ("kvmem", "plain") if rep % 2 == 0 else ("plain", "kvmem"):
            with kvmem.Memory(str(root / f"lg-{name}-{rep}"), cpu_bytes=4 << 30) as memory:
                runs[name].append(run_agent(series[name], llama, tokenizer, memory, calls, block))
    rows = [
        CallRow(i + 1, {s: runs[s][0].computed[i] for s in runs}, {s: [r.ttft[i] for r in runs[s]] for s in runs})
        for i in range(calls)
    ]
    first = runs["plain"][0].messages
    return rows, all(r.messages == first for s in runs for r in runs[s])


def print_ttft(rows: Sequence[CallRow], repeat: int, identical: bool) -> None:
    print(f"\nLangGraph agent (create_agent): per-call TTFT, median of {repeat} (speed-up: plain / kvmem)")
    head = f"{'call':>4} {'computed kvmem':>14} {'plain':>6} {'plain ms':>9} {'kvmem ms':>9} {'speed-up':>8}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r.call:>4} {r.computed['kvmem']:>14} {r.computed['plain']:>6} {r.median_ms('plain'):>9.1f} "
            f"{r.median_ms('kvmem'):>9.1f} {r.speedup():>7.2f}x"
        )
    print(f"final messages of every kvmem and plain thread identical: {'yes' if identical else 'NO'}")


# -- checkpoint bytes -----------------------------------------------------------------------------------------
class TeeSaver(BaseCheckpointSaver[str]):
    """``primary`` (whose reads and versions LangGraph uses), every write also given to ``mirror``."""

    def __init__(self, primary: BaseCheckpointSaver[str], mirror: BaseCheckpointSaver[Any]) -> None:
        super().__init__(serde=primary.serde)
        self.primary, self.mirror = primary, mirror

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self.primary.get_tuple(config)

    def list(self, config: RunnableConfig | None, **kwargs: Any) -> Iterator[CheckpointTuple]:
        return self.primary.list(config, **kwargs)

    def put(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata, new: ChannelVersions
    ) -> RunnableConfig:
        self.mirror.put(config, checkpoint, metadata, new)
        return self.primary.put(config, checkpoint, metadata, new)

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        self.mirror.put_writes(config, writes, task_id, task_path)
        self.primary.put_writes(config, writes, task_id, task_path)

    def get_next_version(self, current: str | None, channel: None) -> str:
        return self.primary.get_next_version(current, channel)


def row_bytes(db: Path, tables: Sequence[str]) -> int:
    """Bytes of every value of every row of ``tables`` (text and blobs their length, numbers 8)."""
    total = 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        for table in tables:
            for row in conn.execute(f"SELECT * FROM {table}"):  # noqa: S608  (our own table names)
                total += sum(8 if isinstance(v, (int, float)) else 0 if v is None else len(v) for v in row)
    return total


def file_bytes(*paths: Path) -> int:
    """Bytes of the files at ``paths`` (a directory: every file under it)."""
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*") if p.is_dir() else [])]
    return sum(f.stat().st_size for f in files if f.is_file())


@dataclass
class ThreadBytes:
    steps: int
    checkpoints: int
    rows: dict[str, int]  # saver -> bytes of its rows' values
    files: dict[str, int]  # saver -> bytes of its files
    read_ms: dict[str, list[float]]  # saver -> get_tuple of the newest checkpoint, per repetition


def measure_thread(tokenizer: PreTrainedTokenizerFast, root: Path, steps: int, reads: int, block: int) -> ThreadBytes:
    """One thread of ``steps`` model calls (the example's tiny model) into both savers; their bytes and reads."""
    llama = example.tiny_llama(tokenizer)
    db = root / "sqlite-saver.db"
    conn = sqlite3.connect(str(db), check_same_thread=False)
    with kvmem.Memory(str(root / "model")) as model_memory, kvmem.Memory(str(root / "saver")) as saver_memory:
        primary, mirror = KVMemSaver(saver_memory), SqliteSaver(conn)
        run_agent(example.ScriptedReAct, llama, tokenizer, model_memory, steps, block, TeeSaver(primary, mirror))
        config = example.config_of(THREAD)
        checkpoints = len(list(primary.list(config)))
        read_ms: dict[str, list[float]] = {"kvmem": [], "sqlite": []}
        for _ in range(reads):
            for name, saver in (("kvmem", primary), ("sqlite", mirror)):
                start = time.perf_counter()
                got = saver.get_tuple(config)
                read_ms[name].append((time.perf_counter() - start) * 1e3)
                assert got is not None and len(got.checkpoint["channel_values"]["messages"]) == 2 * steps
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    catalog = root / "saver" / "catalog.sqlite3"
    return ThreadBytes(
        steps,
        checkpoints,
        {"kvmem": row_bytes(catalog, KV_TABLES), "sqlite": row_bytes(db, SQLITE_TABLES)},
        {
            "kvmem": file_bytes(catalog, Path(f"{catalog}-wal"), Path(f"{catalog}.records")),
            "sqlite": file_bytes(db, Path(f"{db}-wal")),
        },
        read_ms,
    )


def print_thread(t: ThreadBytes) -> None:
    print(f"\nLangGraph thread of {t.steps} model calls ({t.checkpoints} checkpoints), the same run into both savers")
    print(f"{'':34} {'KVMemSaver':>12} {'SqliteSaver':>12} {'sqlite/kvmem':>12}")
    for what, got in (("bytes of rows' values", t.rows), ("bytes of files", t.files)):
        print(f"{what:34} {got['kvmem']:>12,} {got['sqlite']:>12,} {got['sqlite'] / got['kvmem']:>11.2f}x")
        per = {k: v / t.steps for k, v in got.items()}
        print(f"{'  per model call':34} {per['kvmem']:>12,.0f} {per['sqlite']:>12,.0f}")
    kv, sq = (statistics.median(t.read_ms[s]) for s in ("kvmem", "sqlite"))
    print(f"{'newest checkpoint read, median ms':34} {kv:>12.2f} {sq:>12.2f} {sq / kv:>11.2f}x")
    print(
        "(rows: every column's bytes of the savers' tables; files: SqliteSaver's database, KVMemSaver's "
        "catalog database with its row records, kvmem.catalog.mirror)"
    )


# -- the whole part -------------------------------------------------------------------------------------------
@dataclass
class Results:
    rows: list[CallRow]
    repeat: int
    identical: bool
    thread: ThreadBytes


def measure(
    llama: LlamaForCausalLM,
    root: Path,
    calls: int,
    repeat: int,
    block: int,
    thread_steps: int,
    reads: int,
    progress: Callable[[str], None],
) -> Results:
    """TTFT on ``llama`` (after an untimed two-call thread of each series), then the weighed thread."""
    tokenizer = example.word_tokenizer()
    measure_ttft(llama, tokenizer, root / "warm-up", 2, 1, block, lambda _: None)
    rows, identical = measure_ttft(llama, tokenizer, root, calls, repeat, block, progress)
    progress(f"  LangGraph thread of {thread_steps} model calls into both savers ...")
    (root / "thread").mkdir()
    return Results(rows, repeat, identical, measure_thread(tokenizer, root / "thread", thread_steps, reads, block))


def report(results: Results) -> dict[str, float | bool]:
    """Print the tables and the goals; the summary's numbers."""
    print_ttft(results.rows, results.repeat, results.identical)
    print_thread(results.thread)
    last, t = results.rows[-1], results.thread
    speedup = last.speedup()
    ratio = t.rows["sqlite"] / t.rows["kvmem"]
    kv_read, sq_read = (statistics.median(t.read_ms[s]) for s in ("kvmem", "sqlite"))
    print(
        f"goal: at call {last.call} through LangGraph, >= 5x: {speedup:.2f}x  {'PASS' if speedup >= 5 else 'MISS'}; "
        f"messages identical: {'PASS' if results.identical else 'MISS'}"
    )
    print(
        f"goal: {t.steps}-call thread, KVMemSaver <= 1/5 of SqliteSaver's bytes: 1/{ratio:.2f}  "
        f"{'PASS' if ratio >= 5 else 'MISS'}; newest checkpoint read no slower: {kv_read:.2f} vs {sq_read:.2f} ms  "
        f"{'PASS' if kv_read <= sq_read else 'MISS'}"
    )
    return {
        "langgraph_speedup_last": speedup,
        "langgraph_identical": results.identical,
        "checkpoint_bytes_ratio": ratio,
    }


def figures(results: Results) -> list[dict[str, object]]:
    """The results record's figures: per-call TTFT beside the plain agent, the thread's bytes and reads."""
    out = [
        records.figure(
            f"langgraph-call-{r.call}",
            f"LangGraph call {r.call}: {r.computed['plain']}-token prompt, {r.computed['kvmem']} computed",
            "ms",
            r.median_ms("kvmem"),
            records.ref("same agent, plain chat model", r.median_ms("plain"), r.speedup()),
            ratio="plain TTFT / kvmem TTFT, median of per-thread ratios",
            group="LangGraph agent (TTFT per call)",
        )
        for r in results.rows
    ]
    t = results.thread
    kv_read, sq_read = (statistics.median(t.read_ms[s]) for s in ("kvmem", "sqlite"))
    thread = f"LangGraph thread, {t.steps} model calls"
    out += [
        records.figure(
            f"langgraph-row-bytes-{t.steps}",
            f"{thread}: checkpoint bytes stored (rows' values)",
            "B",
            t.rows["kvmem"],
            records.ref("langgraph-checkpoint-sqlite", t.rows["sqlite"], t.rows["sqlite"] / t.rows["kvmem"]),
            ratio="SqliteSaver bytes / KVMemSaver bytes",
            group="LangGraph checkpoints",
        ),
        records.figure(
            f"langgraph-file-bytes-{t.steps}",
            f"{thread}: files (KVMemSaver: catalog and its row records)",
            "B",
            t.files["kvmem"],
            records.ref("langgraph-checkpoint-sqlite", t.files["sqlite"], t.files["sqlite"] / t.files["kvmem"]),
            ratio="SqliteSaver bytes / KVMemSaver bytes",
            group="LangGraph checkpoints",
        ),
        records.figure(
            "langgraph-read-latest",
            f"{thread}: read the newest checkpoint",
            "ms",
            kv_read,
            records.ref("langgraph-checkpoint-sqlite", sq_read, sq_read / kv_read),
            ratio="SqliteSaver time / KVMemSaver time",
            group="LangGraph checkpoints",
        ),
    ]
    return out
