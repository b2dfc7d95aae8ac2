"""``examples/react_agent.py`` on its tiny Llama: real tool outputs, growing KV reuse, resume in a second process.

The full run (with the second process) takes ~10 s here, most of it the second interpreter's imports.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from kvmem import Memory
from kvmem.agent import AgentSession, SessionNotFound
from tests.examples_loader import load_example

BLOCK = 32

# The scripted policy's run: every action, and what the real tools answered.
EXPECTED = [
    (
        'lookup("A17")',
        ("id=A17; kind=order; item=USB-C cable; qty=3; unit_price=12.50; status=shipped 2 May; carrier=DHL"),
    ),
    ('lookup("B42")', "id=B42; kind=order; item=mechanical keyboard; qty=1; unit_price=89.00; status=processing"),
    ('calculator("3 * 12.50 + 1 * 89.00")', "126.5"),
    ('calculator("126.5 * 1.08")', "136.62"),
    ('lookup("DHL")', "id=DHL; kind=carrier; days=2-4"),
]
ANSWER = (
    "Orders A17 and B42 cost 136.62 together, including 8% VAT. Order A17 shipped 2 May with DHL, which "
    "delivers in 2-4 days."
)
# step, prompt, reused, TTFT plain, TTFT kvmem, speed-up, tool call -> observation
_ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+) ms\s+([\d.]+) ms\s+([\d.]+)x\s+(.*)$", re.MULTILINE)


@pytest.fixture(scope="module")
def agent() -> ModuleType:
    """The example script, imported by path (``examples/`` is not a package)."""
    return load_example("react_agent.py")


pytestmark = pytest.mark.usefixtures("one_thread")  # NOTE: the runs pass --threads 1, which main() applies


def _run(agent: ModuleType, *argv: str) -> object:
    return agent.main(["--threads", "1", "--block-size", str(BLOCK), *argv])


def test_scripted_run_uses_real_tools_reuses_kv_and_resumes_in_a_second_process(
    agent: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kvmem"
    report = _run(agent, "--path", str(path))
    out = capsys.readouterr().out
    assert report.ok, out
    steps = report.steps
    assert [(s.action, s.observation) for s in steps[:-1]] == EXPECTED
    assert steps[-1].action == f'finish("{ANSWER}")' and report.answer == steps[-1].observation == ANSWER
    assert all(s.max_abs_diff <= 1e-4 for s in steps)

    # every prompt is the previous one plus a step: its full chunks are loaded, never the last token
    assert steps[0].reused_tokens == 0
    for step, previous in zip(steps[1:], steps):
        assert step.prompt_tokens > previous.prompt_tokens
        assert step.reused_tokens == previous.prompt_tokens // BLOCK * BLOCK > previous.reused_tokens

    rows = _ROW.findall(out)
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [
        (s.step, s.prompt_tokens, s.reused_tokens) for s in steps
    ], out

    resumed = report.resumed
    assert resumed is not None and resumed.matches and resumed.steps == len(steps)
    assert resumed.digest == report.digest
    # the second process's next prompt loads the chunks of the first process's last prompt from disk
    assert resumed.reused_tokens == steps[-1].prompt_tokens // BLOCK * BLOCK
    assert f"{len(steps)} steps" in out and "matches process 1's" in out

    with Memory(path) as memory:  # the chain on disk is what the run reported
        stored = AgentSession.resume("support-1234", memory=memory)
        assert [(s.thought, s.action, s.observation) for s in stored.steps] == [
            (s.thought, s.action, s.observation) for s in steps
        ]
        assert agent.digest(stored.context()) == report.digest
    wrong = _run(agent, "--resume", "support-1234", "--path", str(path), "--expect-digest", "0" * 64)
    assert not wrong.ok and wrong.steps == len(steps) and "DIFFERS FROM" in capsys.readouterr().out
    with pytest.raises(SessionNotFound):
        _run(agent, "--resume", "support-9999", "--path", str(path))


def test_runs_are_deterministic_and_a_checkpoint_directory_works(
    agent: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _run(agent, "--no-resume", "--max-steps", "3")
    checkpoint = tmp_path / "llama"
    agent.tiny_llama(seed=0).save_pretrained(checkpoint)  # no tokenizer files: hashed words, scripted policy
    second = _run(agent, "--no-resume", "--max-steps", "3", "--model", str(checkpoint))
    capsys.readouterr()
    assert first.ok and second.ok and second.model == str(checkpoint)
    assert first.digest == second.digest

    def fields(s: object) -> tuple[object, ...]:
        return (s.step, s.prompt_tokens, s.reused_tokens, s.thought, s.action, s.observation)  # type: ignore[attr-defined]

    assert [fields(s) for s in first.steps] == [fields(s) for s in second.steps]
    assert [s.action for s in first.steps] == [a for a, _ in EXPECTED[:3]]


def test_model_policy_parses_what_the_model_writes(agent: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The random model writes noise: no action, an error observation, and the loop goes on."""
    report = _run(agent, "--no-resume", "--policy", "model", "--max-steps", "2", "--max-new-tokens", "4")
    capsys.readouterr()
    assert report.ok and len(report.steps) == 2 and report.answer is None
    assert all(s.observation.startswith("error:") for s in report.steps)
    assert report.steps[1].reused_tokens > 0

    thought, action = agent.parse_step(' I need A17.\nAction: lookup("A17")\nObservation: x')
    assert (thought, action) == ("I need A17.", 'lookup("A17")')
    assert agent.parse_step(" just musing") == ("just musing", "")


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3 * 12.50 + 1 * 89.00", 126.5), ("(1 + 2) ** 3 / 9", 3.0), ("-2 ** 2", -4), ("+7 - -3", 10), ("2 ** -1", 0.5)],
)
def test_calculator(agent: ModuleType, expression: str, value: float) -> None:
    assert agent.calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "x + 1",
        "abs(-1)",
        "(1).real",
        "'a' * 3",
        "True + 1",
        "[1, 2]",
        "1 if 1 else 2",
        "2 ** 1000",
        "((10 ** 64) ** 64) ** 64",
        "9 ** 9 ** 9",
        "1 / 0",
        "1 +",
        "1" * 201,
        "3 // 2",
        "3 % 2",
        "1 < 2",
    ],
)
def test_calculator_refuses_everything_but_arithmetic(agent: ModuleType, expression: str) -> None:
    with pytest.raises(agent.ToolError):
        agent.calculate(expression)


def test_tool_calls(agent: ModuleType) -> None:
    tools = agent.Tools(agent.read_table(agent.TABLE))
    row = "id=C08; kind=order; item=monitor arm; qty=2; unit_price=34.90; status=delivered 28 April; carrier=UPS"
    assert tools.call("lookup('c08')") == (row, False)
    assert tools.call('lookup("Z99")')[0].startswith("error: no row with id 'Z99'; known ids: A17, B42")
    assert tools.call('calculator("2 * (3 + 4)")') == ("14", False)
    assert tools.call('calculator("open(1)")')[0].startswith("error: 'open(1)' is not allowed")
    assert tools.call("search(cats)") == ("error: no tool 'search'; tools: calculator, lookup, finish", False)
    assert tools.call("just text")[0].startswith("error:")
    assert tools.call('finish("done")') == ("done", True)
