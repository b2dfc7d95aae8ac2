"""``kvmem demo``: the TTFT showcase, run for real on the demo Llama and on a saved local checkpoint.

Small documents (a few hundred tokens) keep these fast; the default 4k-token run
is what a user sees, and is not a test.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvmem.cli.demo_qa import QADemoReport, RequestResult, render_qa_report
from kvmem.cli.main import main

REPO = Path(__file__).resolve().parents[2]

# request, prompt, cold s, warm s, reused, computed, tier, chunks, speedup, max |dlogit|
_REQUEST_ROW = re.compile(
    r"^(q\d+)\s+(\d+)\s+([\d.]+) s\s+([\d.]+) s\s+(\d+)\s+(\d+)\s+(\w+) (\d+)\s+"
    r"([\d.]+)x\s+(\S+)$",
    re.M,
)


def test_demo_reuses_the_document_and_reports_ttft(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--doc-tokens", "512", "--questions", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^model\s+LlamaForCausalLM \(random weights from a config, seed 0\): 20\.7M params", out, re.M)
    assert "1 document of 512 tokens + 2 questions of 32 tokens" in out
    assert "ingest: 512 document tokens prefilled once" in out and "2 chunks of 256 tokens stored" in out
    rows = _REQUEST_ROW.findall(out)
    assert [r[0] for r in rows] == ["q1", "q2"], out
    for _name, prompt, cold, warm, reused, computed, _tier, chunks, speedup, diff in rows:
        assert (int(prompt), int(reused), int(computed), int(chunks)) == (544, 512, 32, 2)
        assert float(cold) > 0 and float(warm) > 0 and float(speedup) > 0 and float(diff) <= 1e-3
    assert [r[6] for r in rows] == ["disk", "cpu"]  # reopened: disk first, then promoted to the CPU tier
    assert re.search(r"^median speedup\s+[\d.]+x \(cold [\d.]+ s -> warm [\d.]+ s\)$", out, re.M)
    assert re.search(r"^hit rate\s+94\.1% of prompt tokens loaded, not computed \(1024 of 1088\)$", out, re.M)
    assert re.search(r"^tier hits\s+(cpu 2, disk 2|disk 2, cpu 2) \(chunks\)$", out, re.M)
    assert re.search(r"^OK: warm vs cold logits of the last position: max abs diff \S+ \(<= 1e-03\)$", out, re.M)
    assert not list(tmp_path.glob("kvmem-demo-*")), "temporary data directory left behind"


def test_demo_with_a_local_checkpoint_and_its_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(3)
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=300,
            max_position_embeddings=1024,
        )
    ).save_pretrained(tmp_path / "ckpt")
    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(
        [(REPO / "kvmem" / "api.py").read_text()], trainers.WordLevelTrainer(vocab_size=300, special_tokens=["[UNK]"])
    )
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "ckpt")

    argv = [
        "demo",
        "--model",
        str(tmp_path / "ckpt"),
        "--doc-tokens",
        "300",
        "--questions",
        "3",
        "--path",
        str(tmp_path / "data"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"LlamaForCausalLM ({tmp_path / 'ckpt'}): 0.1M params" in out
    assert "kvmem's source code and questions about it, through the model's tokenizer" in out
    assert [(r[0], r[4]) for r in _REQUEST_ROW.findall(out)] == [("q1", "256"), ("q2", "256"), ("q3", "256")]
    assert "OK: warm vs cold" in out
    assert (tmp_path / "data" / "catalog.sqlite3").exists()  # --path: a real directory, kept

    assert main([*argv[:-2], "--doc-tokens", "1020"]) == 2  # + an 11-token question > max_position_embeddings
    assert "max_position_embeddings=1024" in capsys.readouterr().err
    assert main(["demo", "--model", str(tmp_path / "nothing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_demo_report_fails_when_warm_logits_differ() -> None:
    report = QADemoReport(
        source="random",
        block_size=256,
        document_tokens=512,
        ingest_seconds=1.0,
        ingest_chunks=2,
        requests=[
            RequestResult("q1", 544, 2.0, 0.5, 512, 32, {"disk": 2}, 1e-6),
            RequestResult("q2", 544, 2.0, 0.25, 512, 32, {"cpu": 2}, 0.01),
        ],
    )
    assert not report.ok and report.median_speedup == 6.0 and report.chunk_hits == {"disk": 2, "cpu": 2}
    text = render_qa_report(report)
    assert "FAILED: warm vs cold logits of the last position: max abs diff 1.0e-02 (exceeds 1e-03)" in text
    assert report.token_hit_rate == pytest.approx(1024 / 1088)
    assert replace(report, requests=report.requests[:1]).ok
