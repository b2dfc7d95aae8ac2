"""A ReAct agent whose steps live in a kvmem ``AgentSession``: each model call computes only the new step.

The agent answers a customer question with two real tools:

- ``calculator(expr)``: arithmetic on numbers with ``+ - * / **`` and parentheses,
  parsed with :mod:`ast` and evaluated node by node (never ``eval``);
- ``lookup(id)``: a row of a small local table of orders and carriers (built in,
  or ``--table FILE``: a CSV whose first column is the id);
- ``finish(answer)`` ends the run.

Every step is stored in an :class:`~kvmem.agent.AgentSession` (a hash chain in the
catalog database, lz4-compressed) and the model attached to it prefills each prompt
through a :class:`~kvmem.kv.PrefixCache`: the prompt is the system prompt, every step
so far and ``Thought:``; it is tokenized piece by piece, so each step's prompt is a
prefix of the next one's and every full chunk of it is loaded instead of computed.
Each step is timed both ways, side by side: a plain ``model(ids)`` forward over the
whole prompt, and ``session.prefill()``; their last-position logits must agree.

By default the model is a tiny Llama built from a config with random weights, words
become ids by a hash (it has no vocabulary), and a scripted policy decides each
thought and action from the tools' real observations, so a run is deterministic
(the model still runs every step: that is what is timed). With ``--model DIR`` (a
local causal LM with its tokenizer) the model writes each thought and action
greedily and the script parses ``Action: tool(arg)``.

Finally the session is resumed in a second process (this script with ``--resume``),
which checks that its ``context()`` is the first process's (by digest) and prefills
the next prompt from the chunks the first process left on disk.

Usage (from the repository root)::

    python examples/react_agent.py                           # tiny random Llama, scripted policy
    python examples/react_agent.py --path /tmp/agent --threads 1
    python examples/react_agent.py --model ~/models/Qwen2.5-0.5B-Instruct --max-steps 8
"""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import io
import json
import operator
import re
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

import kvmem
from kvmem.agent import AgentSession, Step
from kvmem.kv.layout import cache_argument

QUESTION = (
    "Customer 1234 asks: what do orders A17 and B42 cost together, including 8% VAT, and when will order A17 arrive?"
)
SYSTEM = (
    "You are a customer support agent for an online shop. Answer the customer's question by thinking step "
    "by step. Each step is written as three lines: 'Thought:' says what you need next, 'Action:' calls one "
    "tool, 'Observation:' is the tool's answer. Tools: calculator(expression) evaluates arithmetic with "
    "+ - * / ** and parentheses; lookup(id) returns the row of an order or a carrier from the shop's "
    "table; finish(answer) gives the final answer to the customer. Use only facts from observations, "
    "never guess a price or a date, and keep every answer short and polite.\n\n" + QUESTION
)
TABLE = """id,kind,item,qty,unit_price,status,carrier,days
A17,order,USB-C cable,3,12.50,shipped 2 May,DHL,
B42,order,mechanical keyboard,1,89.00,processing,,
C08,order,monitor arm,2,34.90,delivered 28 April,UPS,
DHL,carrier,,,,,,2-4
UPS,carrier,,,,,,1-3
"""
SUFFIX = "Thought:"
TINY_VOCAB = 4096
SESSION = "support-1234"


# -- tools ---------------------------------------------------------------------------------------------------------
class ToolError(ValueError):
    """A tool call the tool refuses; its message becomes the observation."""


_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION = 200  # characters
_MAX_EXPONENT = 64  # NOTE: 9 ** 9 ** 9 would run for hours: exponents and integer results are bounded
_MAX_BITS = 4096


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / **``, unary signs, parentheses.

    Raises:
        ToolError: anything else (names, calls, attributes, ...), a syntax error, a division by
            zero, an exponent beyond 64, an integer beyond 4096 bits, or over 200 characters.
    """
    if len(expression) > _MAX_EXPRESSION:
        raise ToolError(f"expression of {len(expression)} characters: at most {_MAX_EXPRESSION}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # NOTE: not bool, str, complex
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolError(f"exponent {right}: at most {_MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise ToolError(f"{ast.unparse(node)}: {exc}") from None
        if isinstance(value, int) and value.bit_length() > _MAX_BITS:
            raise ToolError(f"{ast.unparse(node)}: the result has over {_MAX_BITS} bits")
        return value
    raise ToolError(f"{ast.unparse(node)!r} is not allowed: only numbers, + - * / ** and parentheses")


def format_number(value: float) -> str:
    """A result as people write it: ``126.5``, ``136.62`` (not ``136.62000000000001``)."""
    return f"{value:.10g}"


def read_table(text: str) -> dict[str, dict[str, str]]:
    """CSV rows keyed by their first column (upper-cased); empty fields dropped."""
    rows = csv.DictReader(io.StringIO(text))
    key = (rows.fieldnames or ["id"])[0]
    return {row[key].strip().upper(): {k: v.strip() for k, v in row.items() if v and v.strip()} for row in rows}


class Tools:
    """The agent's tools over one table."""

    def __init__(self, table: dict[str, dict[str, str]]) -> None:
        self.table = table

    def lookup(self, key: str) -> str:
        row = self.table.get(key.strip().upper())
        if row is None:
            raise ToolError(f"no row with id {key!r}; known ids: {', '.join(sorted(self.table))}")
        return "; ".join(f"{k}={v}" for k, v in row.items())

    def call(self, action: str) -> tuple[str, bool]:
        """Run ``action`` (``tool(arg)``). Returns ``(observation, finished)``; refusals are observations."""
        match = re.fullmatch(r"\s*(\w+)\((.*)\)\s*", action, re.DOTALL)
        if match is None:
            return f"error: {action!r} is not a tool call; write tool(argument)", False
        name, arg = match[1], match[2].strip()
        if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "\"'":
            arg = arg[1:-1]
        try:
            if name == "calculator":
                return format_number(calculate(arg)), False
            if name == "lookup":
                return self.lookup(arg), False
        except ToolError as exc:
            return f"error: {exc}", False
        if name == "finish":
            return arg, True
        return f"error: no tool {name!r}; tools: calculator, lookup, finish", False


# -- policies: who writes the thought and the action -----------------------------------------------------------
def _row(observation: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in observation.split("; ") if "=" in part)


def scripted_policy(steps: Sequence[Step]) -> tuple[str, str]:
    """The next thought and action for :data:`QUESTION`, from the observations so far (a fixed plan)."""
    obs = [s.observation for s in steps]
    if len(steps) == 0:
        return "The customer asks about two orders. I should look up order A17 first.", 'lookup("A17")'
    a17 = _row(obs[0])
    if len(steps) == 1:
        thought = f"A17 is {a17['qty']} x {a17['item']} at {a17['unit_price']} each, {a17['status']}."
        return thought + " Now I need order B42.", 'lookup("B42")'
    b42 = _row(obs[1])
    if len(steps) == 2:
        expr = f"{a17['qty']} * {a17['unit_price']} + {b42['qty']} * {b42['unit_price']}"
        thought = f"B42 is {b42['qty']} x {b42['item']} at {b42['unit_price']}."
        return thought + " The subtotal is each quantity times its unit price, added up.", f'calculator("{expr}")'
    if len(steps) == 3:
        return (
            f"The subtotal is {obs[2]}. VAT is 8 percent, so I multiply the subtotal by 1.08.",
            f'calculator("{obs[2]} * 1.08")',
        )
    if len(steps) == 4:
        thought = f"The total is {obs[3]}. A17 went with {a17['carrier']};"
        return thought + " I should look up how long that carrier takes.", f'lookup("{a17["carrier"]}")'
    days = _row(obs[4]).get("days", "?")
    answer = (
        f"Orders A17 and B42 cost {obs[3]} together, including 8% VAT. Order A17 {a17['status']} with "
        f"{a17['carrier']}, which delivers in {days} days."
    )
    return "I have everything the customer asked for.", f'finish("{answer}")'


def parse_step(text: str) -> tuple[str, str]:
    """``(thought, action)`` from what a model wrote after ``Thought:``; no action when it wrote none."""
    text = text.split("Observation:", 1)[0]
    thought, _, rest = text.partition("Action:")
    return " ".join(thought.split()), rest.strip().split("\n", 1)[0].strip()


# -- model and tokenizer ------------------------------------------------------------------------------------------
class WordTokenizer:
    """Words and punctuation to ids by a hash, for a model with random weights (it has no vocabulary to match).

    Ids 0-2 (pad, BOS, EOS) are never produced; ``decode`` knows the words it has encoded.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in re.findall(r"\w+|[^\w\s]", text):
            i = 3 + zlib.crc32(word.encode()) % (self.vocab_size - 3)
            self._words.setdefault(i, word)
            ids.append(i)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self._words.get(i, f"<{i}>") for i in ids)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """A 4-layer Llama with random weights (seeded), hidden 256, GQA 4/2 heads."""
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def load(args: argparse.Namespace) -> tuple[PreTrainedModel, object, bool]:
    """``(model, tokenizer, has_vocabulary)``: ``--model DIR`` with its tokenizer, or the tiny random Llama."""
    if args.model is None:
        return tiny_llama(args.seed).to(args.device), WordTokenizer(TINY_VOCAB), False
    model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval()
    if any((Path(args.model) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return model, AutoTokenizer.from_pretrained(args.model), True
    return model, WordTokenizer(model.config.vocab_size), False


# -- one step, both ways -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    """One model call and the step it produced.

    ``prompt_tokens`` is the prompt the call saw (system prompt, the steps before this one,
    ``Thought:``); ``reused_tokens`` of it were loaded from kvmem instead of computed.
    """

    step: int
    prompt_tokens: int
    reused_tokens: int
    ttft_plain_ms: float
    ttft_kvmem_ms: float
    max_abs_diff: float  # of the last position's logits, kvmem vs plain
    logit_scale: float  # max |logit| of the plain way
    thought: str
    action: str
    observation: str

    @property
    def speedup(self) -> float:
        return self.ttft_plain_ms / self.ttft_kvmem_ms


@dataclass(frozen=True)
class ResumeResult:
    """What the second process found: the chain, whether its context is the first's, the next prefill."""

    steps: int
    digest: str
    matches: bool
    prompt_tokens: int
    reused_tokens: int

    @property
    def ok(self) -> bool:
        return self.matches


@dataclass
class AgentReport:
    """What :func:`main` did (``ok``: logits agree on every step and the resumed context is the same)."""

    model: str
    session: str
    block_size: int
    rtol: float
    steps: list[StepResult] = field(default_factory=list)
    answer: str | None = None
    digest: str = ""
    resumed: ResumeResult | None = None

    @property
    def ok(self) -> bool:
        agree = all(s.max_abs_diff <= self.rtol * max(1.0, s.logit_scale) for s in self.steps)
        return agree and (self.resumed is None or self.resumed.matches)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def plain_forward(model: PreTrainedModel, session: AgentSession) -> tuple[torch.Tensor, float]:
    """Without kvmem: the prompt's ids, then one forward pass over all of them. Returns (last logits, seconds).

    NOTE: the ids are part of the time, as they are of kvmem's (``session.prefill`` builds them too).
    """
    device = next(model.parameters()).device
    start = time.perf_counter()
    ids = session.prompt_ids(suffix=SUFFIX)
    logits = model(ids.unsqueeze(0).to(device), use_cache=True, logits_to_keep=1).logits[0, -1]
    _sync(device)
    return logits, time.perf_counter() - start


@torch.no_grad()
def greedy(model: PreTrainedModel, tokenizer: object, logits: torch.Tensor, cache: object, max_tokens: int) -> str:
    """Greedy text from the first-token logits on, decoded on ``cache``, up to the next ``Observation:``."""
    device = next(model.parameters()).device
    eos = model.config.eos_token_id
    stops = set(eos) if isinstance(eos, list) else {eos}
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(logits.argmax(-1))
        if token in stops:
            break
        out.append(token)
        if "Observation:" in tokenizer.decode(out, skip_special_tokens=True):  # type: ignore[attr-defined]
            break
        step = torch.tensor([[token]], device=device)
        logits = model(input_ids=step, use_cache=True, logits_to_keep=1, **{cache_argument(model): cache}).logits[0, -1]
    return str(tokenizer.decode(out, skip_special_tokens=True))  # type: ignore[attr-defined]


def run_step(
    session: AgentSession, model: PreTrainedModel, tokenizer: object, tools: Tools, policy: str, max_new_tokens: int
) -> tuple[StepResult, bool]:
    """One ReAct step: time the prompt's prefill both ways, decide, call the tool, append the step."""
    number = len(session) + 1
    ids = session.prompt_ids(suffix=SUFFIX)
    device = next(model.parameters()).device
    timed: dict[str, float] = {}
    for way in ("plain", "kvmem") if number % 2 else ("kvmem", "plain"):  # NOTE: alternate who goes first
        if way == "plain":
            plain_logits, timed[way] = plain_forward(model, session)
        else:
            start = time.perf_counter()
            result = session.prefill(suffix=SUFFIX)
            _sync(device)
            timed[way] = time.perf_counter() - start
    session.flush()
    logits = result.logits[0, -1]
    if policy == "scripted":
        thought, action = scripted_policy(session.steps)
    else:
        thought, action = parse_step(greedy(model, tokenizer, logits.clone(), result.cache, max_new_tokens))
    observation, finished = tools.call(action)
    session.append_step(thought=thought, action=action, observation=observation)
    diff = (logits.float() - plain_logits.float()).abs().max().item()
    return StepResult(
        number,
        len(ids),
        result.reused_tokens,
        timed["plain"] * 1e3,
        timed["kvmem"] * 1e3,
        diff,
        plain_logits.float().abs().max().item(),
        thought,
        action,
        observation,
    ), finished


# -- the second process -------------------------------------------------------------------------------------------
def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def resume(args: argparse.Namespace) -> ResumeResult:
    """``--resume NAME --path DIR``: reopen the session, check its context, prefill the next prompt."""
    model, tokenizer, _ = load(args)
    with kvmem.Memory(args.path, cpu_bytes="256MiB", disk_bytes="1GiB") as memory:
        session = AgentSession.resume(args.resume, memory=memory)
        session.attach(model, tokenizer, block_size=args.block_size, compression="none")
        found = digest(session.context())
        r = session.prefill(suffix=SUFFIX)
        session.close()
        result = ResumeResult(
            len(session),
            found,
            found == args.expect_digest if args.expect_digest else True,
            int(r.reused_tokens + r.computed_tokens),
            int(r.reused_tokens),
        )
    print(
        f"resumed {args.resume!r} in process 2: {result.steps} steps, context sha256 {found[:16]}… "
        f"{'matches' if result.matches else 'DIFFERS FROM'} process 1's; next prompt {result.prompt_tokens} "
        f"tokens, {result.reused_tokens} reused from process 1's chunks"
    )
    print("RESUME " + json.dumps(asdict(result)))
    return result


def resume_in_subprocess(args: argparse.Namespace, path: str, expect: str) -> ResumeResult:
    """Run this script with ``--resume`` in a second process; its result."""
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--resume",
        args.session,
        "--path",
        path,
        "--expect-digest",
        expect,
        "--seed",
        str(args.seed),
        "--block-size",
        str(args.block_size),
        "--device",
        args.device,
    ]
    argv += ["--model", args.model] if args.model else []
    argv += ["--threads", str(args.threads)] if args.threads else []
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESUME ")]
    if not lines:
        raise RuntimeError(f"the resuming process failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("RESUME ")))
    return ResumeResult(**json.loads(lines[-1].removeprefix("RESUME ")))


# -- output and main -----------------------------------------------------------------------------------------------
def render(report: AgentReport) -> str:
    """The per-step table."""
    head = (
        f"{'step':>4}  {'prompt':>6}  {'reused':>6}  {'TTFT plain':>10}  {'TTFT kvmem':>10}  {'speed-up':>8}  "
        "tool call -> observation"
    )
    rows = [head, "-" * (len(head) + 30)]
    for s in report.steps:
        call = f"{s.action or '(no action)'} -> {s.observation}"
        rows.append(
            f"{s.step:>4}  {s.prompt_tokens:>6}  {s.reused_tokens:>6}  {s.ttft_plain_ms:>7.1f} ms  "
            f"{s.ttft_kvmem_ms:>7.1f} ms  {s.speedup:>7.2f}x  {call[:90] + ('…' if len(call) > 90 else '')}"
        )
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a local causal LM directory with its tokenizer (default: a tiny random Llama)")
    p.add_argument(
        "--policy",
        choices=("auto", "scripted", "model"),
        default="auto",
        help="who writes thoughts and actions: the script's plan, or the model greedily (default: the "
        "model when it has a tokenizer, else the script)",
    )
    p.add_argument("--table", help="a CSV for lookup(), first column the id (default: the built-in orders)")
    p.add_argument("--path", help="kvmem directory (default: a temporary one, removed after)")
    p.add_argument("--session", default=SESSION, help=f"session name (default {SESSION})")
    p.add_argument("--max-steps", type=int, default=8, help="steps before giving up without finish() (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens a model writes per step (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV chunk (default 32)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; 1 on a busy machine)")
    p.add_argument("--no-resume", action="store_true", help="skip the second process")
    p.add_argument(
        "--resume",
        metavar="NAME",
        help="reopen session NAME under --path, check its context against "
        "--expect-digest and prefill its next prompt (the second process)",
    )
    p.add_argument("--expect-digest", metavar="SHA256", help="with --resume: the context's expected sha256")
    args = p.parse_args(argv)
    if args.max_steps < 1 or args.block_size < 1 or args.max_new_tokens < 1:
        p.error("--max-steps, --block-size and --max-new-tokens must be at least 1")
    if args.resume and not args.path:
        p.error("--resume needs --path")
    return args


def main(argv: Sequence[str] | None = None) -> AgentReport | ResumeResult:
    """Run the agent, print the table, resume in a second process. Returns the report."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.resume:
        return resume(args)
    model, tokenizer, has_vocabulary = load(args)
    policy = args.policy if args.policy != "auto" else ("model" if has_vocabulary else "scripted")
    tools = Tools(read_table(Path(args.table).read_text() if args.table else TABLE))
    dtype = next(model.parameters()).dtype
    report = AgentReport(
        args.model or f"tiny random Llama (seed {args.seed})",
        args.session,
        args.block_size,
        1e-4 if dtype == torch.float32 else 2e-2,
    )
    with tempfile.TemporaryDirectory(prefix="kvmem-agent-") as tmp:
        path = args.path or tmp  # NOTE: the temporary directory, unused with --path, goes at the end
        with kvmem.Memory(path, cpu_bytes="256MiB", disk_bytes="1GiB") as memory:
            session = AgentSession(args.session, memory=memory, system_prompt=SYSTEM)
            if len(session):
                raise SystemExit(
                    f"session {args.session!r} in {path} has {len(session)} steps already: pass "
                    "another --session, or --resume it"
                )
            session.attach(model, tokenizer, block_size=args.block_size, compression="none")
            print(
                f"{report.model} on {args.device}, {dtype}, policy {policy}: session {args.session!r}, "
                f"{args.block_size}-token KV chunks, kvmem at {path}\n{QUESTION}"
            )
            plain_forward(model, session)  # NOTE: first calls are slow: warm up
            for _ in range(args.max_steps):
                result, finished = run_step(session, model, tokenizer, tools, policy, args.max_new_tokens)
                report.steps.append(result)
                if finished:
                    report.answer = result.observation
                    break
            report.digest = digest(session.context())
            session.close()
        print(render(report))
        print(f"answer: {report.answer}" if report.answer else f"no finish() in {args.max_steps} steps")
        print(
            f"last-position logits {'agree' if report.ok else 'DISAGREE'} on every step "
            f"(rtol {report.rtol:g} of max |logit|)"
        )
        if not args.no_resume:
            report.resumed = resume_in_subprocess(args, path, report.digest)
    return report


if __name__ == "__main__":
    raise SystemExit(0 if main().ok else 1)
