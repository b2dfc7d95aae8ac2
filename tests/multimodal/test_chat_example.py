"""``examples/multimodal_chat.py`` on its tiny LLaVA: turn 2 reuses the visual tokens and the prefix KV.

Each run is a few seconds on one thread; the default run (torch's threads) is what a user sees.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from tests.examples_loader import load_example
from tests.multimodal.conftest import picture, png

BLOCK = 32

# turn, prompt, reused, visual, TTFT plain, TTFT kvmem, speed-up, max |dlogit|
_ROW = re.compile(
    r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(hit|miss)\s+([\d.]+) ms\s+([\d.]+) ms\s+([\d.]+)x\s+(\S+)$", re.MULTILINE
)


@pytest.fixture(scope="module")
def chat() -> ModuleType:
    """The example script, imported by path (``examples/`` is not a package)."""
    return load_example("multimodal_chat.py")


pytestmark = pytest.mark.usefixtures("one_thread")  # NOTE: the runs pass --threads 1, which main() applies


def _run(chat: ModuleType, *argv: str) -> object:
    return chat.main(["--threads", "1", "--block-size", str(BLOCK), "--answer-tokens", "2", *argv])


def test_second_turn_reuses_visual_tokens_and_prefix_kv(
    chat: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _run(chat, "--turns", "3", "--path", str(tmp_path))
    out = capsys.readouterr().out
    assert report.ok, out
    first, second, third = report.turns
    image_span = 1 + report.image_tokens  # BOS + placeholders

    assert not first.visual_hit and first.reused_tokens == 0
    assert first.metrics == {"kv_reused_tokens": 0, "kv_chunk_hits": 0, "tensor_hits": 0}
    for turn, previous in ((second, first), (third, second)):
        stored = previous.prompt_tokens // BLOCK * BLOCK  # the previous prompt's full chunks
        assert turn.visual_hit and turn.reused_tokens == stored >= image_span
        assert turn.metrics == {"kv_reused_tokens": stored, "kv_chunk_hits": stored // BLOCK, "tensor_hits": 1}
    assert (report.visual_hits, report.visual_misses) == (2, 1)
    assert all(t.max_abs_diff <= 1e-4 and t.same_first_token for t in report.turns)

    rows = _ROW.findall(out)
    assert [(int(r[0]), int(r[2]), r[3]) for r in rows] == [
        (t.turn, t.reused_tokens, "hit" if t.visual_hit else "miss") for t in report.turns
    ], out
    assert "agree on every turn" in out


def test_another_image_with_the_same_ids_shares_nothing_and_a_reopened_store_serves_the_first(
    chat: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "kvmem")
    assert _run(chat, "--turns", "1", "--path", path).ok

    other = tmp_path / "other.png"
    other.write_bytes(png(picture(5, size=(300, 200))))
    report = _run(chat, "--turns", "1", "--path", path, "--image", str(other))
    assert report.ok  # the same prompt ids as the first run's turn 1; a different image
    assert not report.turns[0].visual_hit and report.turns[0].reused_tokens == 0

    again = _run(chat, "--turns", "1", "--path", path)  # the first image again, from the disk tier
    turn = again.turns[0]
    assert again.ok and turn.visual_hit and turn.reused_tokens == (turn.prompt_tokens - 1) // BLOCK * BLOCK
    capsys.readouterr()


def test_a_local_checkpoint_directory(chat: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--model DIR``: a saved LLaVA without tokenizer files falls back to hashed words."""
    checkpoint = tmp_path / "llava"
    chat.tiny_llava(seed=3).save_pretrained(checkpoint)
    report = _run(chat, "--model", str(checkpoint), "--turns", "2", "--path", str(tmp_path / "kvmem"))
    assert report.ok and report.model == str(checkpoint)
    assert report.turns[1].visual_hit and report.turns[1].reused_tokens > report.image_tokens
    assert str(checkpoint) in capsys.readouterr().out
