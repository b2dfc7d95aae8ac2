"""``kvmem demo``: time to first token with and without the document's KV reused.

The workload is long-document question answering: one document (4096 tokens by
default) followed by several short questions. The document is prefilled once
through a :class:`~kvmem.kv.PrefixCache`, which stores its chunks; the
``Memory`` is then reopened, as a restarted server would be, so the first
question finds the chunks on disk and later ones in the CPU tier. For every
question the demo times

- **cold**: a plain forward pass of the model over document + question (no kvmem);
- **warm**: ``PrefixCache.prefill`` of the same prompt, which loads the
  document's chunks and runs the model on the question only;

and compares the logits of the last position, which must agree (fp32, lossless
chunks). The model is a small random-weight Llama built from a config (nothing
is downloaded), or a local checkpoint (``--model PATH``).
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvmem.api import Memory
from kvmem.cli.table import format_percent, render_table
from kvmem.config import Config
from kvmem.errors import ConfigError
from kvmem.kv import PrefixCache

__all__ = [
    "DEMO_LLAMA",
    "LOGIT_TOLERANCE",
    "QADemoReport",
    "RequestResult",
    "Workload",
    "build_demo_model",
    "describe_model",
    "load_local_model",
    "make_workload",
    "question_summary",
    "render_qa_report",
    "run_qa_demo",
]

# NOTE: sized so that a 4k-token prefill takes a few seconds on two slow shared cores
# (measured 3.9-4.7 s under load); wider models made the default run pass a minute.
DEMO_LLAMA = LlamaConfig(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=688,
    vocab_size=32000,
    max_position_embeddings=8192,
)
LOGIT_TOLERANCE = 1e-3  # max |cold - warm| of the last position's fp32 logits
_QUESTIONS = (
    "What does PrefixCache.prefill return?",
    "Which tiers can hold a chunk?",
    "How is a chunk key computed?",
    "What happens when a CRC check fails?",
    "Which settings tune the prefetcher?",
    "How are new chunks stored without delaying a request?",
    "What does kvmem verify --fix do?",
    "Why is the last prompt token never loaded from the cache?",
)


@dataclass(frozen=True)
class Workload:
    """Token ids of the document and of each question (all ``int64``, 1-D)."""

    document: torch.Tensor
    questions: list[torch.Tensor]
    source: str  # how the tokens were made, for the report


@dataclass
class RequestResult:
    """One question: cold and warm time to first token, reuse, and logit agreement."""

    name: str
    prompt_tokens: int
    cold_seconds: float
    warm_seconds: float
    reused_tokens: int
    computed_tokens: int
    chunk_hits: dict[str, int]
    max_abs_diff: float

    @property
    def speedup(self) -> float:
        return self.cold_seconds / self.warm_seconds if self.warm_seconds > 0 else float("inf")


@dataclass
class QADemoReport:
    """Everything ``kvmem demo`` prints after the header."""

    source: str
    block_size: int
    document_tokens: int
    ingest_seconds: float
    ingest_chunks: int
    ingest_reused: int = 0  # document tokens already stored (a --path used before)
    requests: list[RequestResult] = field(default_factory=list)
    tolerance: float = LOGIT_TOLERANCE

    @property
    def max_abs_diff(self) -> float:
        return max((r.max_abs_diff for r in self.requests), default=0.0)

    @property
    def ok(self) -> bool:
        """Whether every warm answer matched its cold one (NaN never does)."""
        return all(r.max_abs_diff <= self.tolerance for r in self.requests)

    @property
    def median_speedup(self) -> float:
        return statistics.median(r.speedup for r in self.requests) if self.requests else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Prompt tokens loaded instead of computed, over all prompt tokens of the questions."""
        total = sum(r.prompt_tokens for r in self.requests)
        return sum(r.reused_tokens for r in self.requests) / total if total else 0.0

    @property
    def chunk_hits(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.requests:
            for tier, n in r.chunk_hits.items():
                out[tier] = out.get(tier, 0) + n
        return out


# -- model and workload ------------------------------------------------------------------
def build_demo_model(seed: int = 0) -> PreTrainedModel:
    """The random-weight demo Llama (:data:`DEMO_LLAMA`), fp32, in eval mode; same weights for the same seed."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(DEMO_LLAMA).eval()


def load_local_model(path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A local checkpoint in fp32 (never downloaded), and its tokenizer when the directory has one.

    Raises:
        ConfigError: ``path`` is not a directory transformers can load a causal LM from.
    """
    if not Path(path).is_dir():
        raise ConfigError(
            f"--model {path!r}: not a directory; expected a local checkpoint saved with "
            "save_pretrained (config.json and weights)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {path!r}: cannot load a causal LM from it: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # no tokenizer files: the demo falls back to random token ids
    return model.eval(), tokenizer


def describe_model(model: PreTrainedModel, origin: str) -> str:
    """One line naming the model: class, size, shape, dtype and where it came from."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    heads = getattr(c, "num_attention_heads", "?")
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return (
        f"{type(model).__name__} ({origin}): {params / 1e6:.1f}M params, hidden {getattr(c, 'hidden_size', '?')},"
        f" {getattr(c, 'num_hidden_layers', '?')} layers, {heads} heads / {kv_heads} KV heads, {dtype}"
    )


def make_workload(
    model: PreTrainedModel,
    doc_tokens: int,
    questions: int,
    *,
    question_tokens: int = 32,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int = 0,
) -> Workload:
    """The document and questions: real text through ``tokenizer`` if given, else random ids (fixed seed).

    The text document is kvmem's own source code, repeated to length; the questions
    are about it. Random questions are ``question_tokens`` long.

    Raises:
        ConfigError: document + longest question do not fit the model's context.
    """
    if tokenizer is not None:
        work = _text_workload(tokenizer, doc_tokens, questions)
    else:
        g = torch.Generator().manual_seed(seed)
        vocab = int(model.config.vocab_size)
        work = Workload(
            torch.randint(0, vocab, (doc_tokens,), generator=g),
            [torch.randint(0, vocab, (question_tokens,), generator=g) for _ in range(questions)],
            f"random token ids (seed {seed})",
        )
    longest = doc_tokens + max(len(q) for q in work.questions)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise ConfigError(
            f"--doc-tokens {doc_tokens}: prompts of {longest} tokens exceed the model's "
            f"max_position_embeddings={limit}; accepted up to {limit - (longest - doc_tokens)}"
        )
    return work


def _text_workload(tokenizer: PreTrainedTokenizerBase, doc_tokens: int, questions: int) -> Workload:
    sources = sorted(Path(__file__).parent.rglob("*.py"))
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sources)
    ids: list[int] = list(tokenizer(text)["input_ids"])
    if not ids:
        raise ConfigError("the tokenizer of --model turned the document into no tokens")
    document = torch.tensor((ids * (doc_tokens // len(ids) + 1))[:doc_tokens], dtype=torch.long)
    asked = [_QUESTIONS[i % len(_QUESTIONS)] for i in range(questions)]
    qs = [
        torch.tensor(tokenizer(f"\n\nQuestion: {q}\nAnswer:", add_special_tokens=False)["input_ids"], dtype=torch.long)
        for q in asked
    ]
    return Workload(document, qs, "kvmem's source code and questions about it, through the model's tokenizer")


# -- the run ------------------------------------------------------------------------------------
def run_qa_demo(
    model: PreTrainedModel,
    config: Config,
    work: Workload,
    *,
    progress: bool | None = None,
    say: Callable[[str], None] = print,
) -> QADemoReport:
    """Ingest the document, reopen the Memory, then time every question cold and warm.

    Args:
        model: the causal LM (fp32 for an exact logit check).
        config: settings of the Memory (its ``path`` is the data directory).
        work: document and questions.
        progress: show a tqdm bar over the questions (``None``: only on a terminal).
        say: where status lines go while the demo runs.
    """
    with Memory(config=config) as memory:
        pc = PrefixCache(model, memory, compression="none")
        say(f"ingesting the document: one prefill of {len(work.document)} tokens, chunks stored as it runs ...")
        start = time.perf_counter()
        reused = pc.prefill(work.document, logits_to_keep=1).reused_tokens
        pc.flush()
        memory.flush()
        ingest = time.perf_counter() - start
        pc.close()
        chunks, block = len(pc.chunk_keys(work.document)), pc.block_size
    say(
        "reopening the data directory (CPU tier empty, as after a restart): the first question reads the "
        "document from disk, later ones from the CPU tier"
    )
    report = QADemoReport(
        source=work.source,
        block_size=block,
        document_tokens=len(work.document),
        ingest_seconds=ingest,
        ingest_chunks=chunks,
        ingest_reused=reused,
    )
    with Memory(config=config) as memory:
        pc = PrefixCache(model, memory, compression="none")
        try:
            names = [f"q{i + 1}" for i in range(len(work.questions))]
            bar = tqdm(
                list(zip(names, work.questions)),
                desc="questions",
                unit="req",
                disable=None if progress is None else not progress,
            )
            for name, question in bar:
                report.requests.append(_one_request(model, pc, name, torch.cat([work.document, question])))
                bar.set_postfix_str(f"speedup {report.requests[-1].speedup:.1f}x")
        finally:
            pc.close()
    return report


def _one_request(model: PreTrainedModel, pc: PrefixCache, name: str, prompt: torch.Tensor) -> RequestResult:
    """Time a plain forward pass, then the prefix-cached prefill, of ``prompt``; compare last logits."""
    ids = prompt.unsqueeze(0)
    device = next(model.parameters()).device
    start = time.perf_counter()
    cold = _plain_forward(model, ids.to(device))
    cold_seconds = _elapsed(start, device)
    before = _chunk_hits(pc.memory)
    start = time.perf_counter()
    warm = pc.prefill(ids, logits_to_keep=1)  # as the cold side: only the last position
    warm_seconds = _elapsed(start, device)
    hits = {t: n - before.get(t, 0) for t, n in _chunk_hits(pc.memory).items() if n - before.get(t, 0)}
    diff = (cold - warm.logits[0, -1].float()).abs().max().item()
    return RequestResult(
        name, ids.shape[1], cold_seconds, warm_seconds, warm.reused_tokens, warm.computed_tokens, hits, diff
    )


@torch.no_grad()
def _plain_forward(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """What serving without kvmem does for a first token: one forward pass, its cache kept for decoding.

    Returns:
        The fp32 logits of the last position. NOTE: only that position's logits are
        computed where the model supports ``logits_to_keep``, so the cold time is not
        inflated by a vocabulary projection of every prompt position.
    """
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(ids, use_cache=True, **extra)
    return out.logits[0, -1].float()


def _elapsed(start: float, device: torch.device) -> float:
    """Seconds since ``start``, once the device has finished the work queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _chunk_hits(memory: Memory) -> dict[str, int]:
    """``kvmem_kv_chunk_hits_total`` per tier."""
    out: dict[str, int] = {}
    for family in memory.metrics.registry.collect():
        for s in family.samples:
            if s.name == "kvmem_kv_chunk_hits_total":
                out[s.labels["tier"]] = int(s.value)
    return out


# -- report -----------------------------------------------------------------------------------------
def render_qa_report(report: QADemoReport) -> str:
    """Per-request table, summary and verdict."""
    rows = [
        [
            r.name,
            r.prompt_tokens,
            f"{r.cold_seconds:.3f} s",
            f"{r.warm_seconds:.3f} s",
            r.reused_tokens,
            r.computed_tokens,
            _tiers(r.chunk_hits),
            f"{r.speedup:.1f}x",
            f"{r.max_abs_diff:.1e}",
        ]
        for r in report.requests
    ]
    chunks = report.ingest_chunks
    stored = f"{chunks} chunk{'s' * (chunks != 1)} of {report.block_size} tokens"
    ingest = (
        f"ingest: {report.ingest_reused} of {report.document_tokens} document tokens were already stored (an "
        f"earlier run); the rest prefilled in {report.ingest_seconds:.2f} s; {stored} in store"
        if report.ingest_reused
        else f"ingest: {report.document_tokens} document tokens prefilled once in {report.ingest_seconds:.2f} s; "
        f"{stored} stored"
    )
    lines = [
        ingest,
        "",
        render_table(
            [
                "request",
                "prompt",
                "cold TTFT",
                "warm TTFT",
                "reused",
                "computed",
                "chunks from",
                "speedup",
                "max |dlogit|",
            ],
            rows,
        ),
        "",
    ]
    cold = statistics.median(r.cold_seconds for r in report.requests) if report.requests else 0.0
    warm = statistics.median(r.warm_seconds for r in report.requests) if report.requests else 0.0
    reused, total = (sum(r.reused_tokens for r in report.requests), sum(r.prompt_tokens for r in report.requests))
    lines += [
        f"median speedup  {report.median_speedup:.1f}x (cold {cold:.3f} s -> warm {warm:.3f} s)",
        f"hit rate        {format_percent(reused, total)} of prompt tokens loaded, not computed ({reused} of {total})",
        f"tier hits       {_tiers(report.chunk_hits)} (chunks)",
        "",
    ]
    verdict = "OK" if report.ok else "FAILED"
    relation = "<=" if report.ok else "exceeds"
    lines.append(
        f"{verdict}: warm vs cold logits of the last position: max abs diff {report.max_abs_diff:.1e} "
        f"({relation} {report.tolerance:.0e})"
    )
    return "\n".join(lines)


def _tiers(hits: dict[str, int]) -> str:
    return ", ".join(f"{tier} {n}" for tier, n in sorted(hits.items(), key=lambda kv: -kv[1])) or "-"


def question_summary(questions: Sequence[torch.Tensor]) -> str:
    """``"4 questions of 32 tokens"`` (or a range of lengths)."""
    sizes = sorted({len(q) for q in questions})
    size = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    return f"{len(questions)} question{'s' * (len(questions) != 1)} of {size} tokens"
