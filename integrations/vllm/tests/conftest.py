"""Fixtures of the kvmem-vllm tests: a random-weight tiny Llama on disk, engine runs in processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import RedisServer

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 600
# NOTE: before vLLM is imported here: when its platform detection fails it takes the machine for a GPU one
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer hidden-256 Llama with random weights, saved in fp32 with ``save_pretrained``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    _word_tokenizer(config.vocab_size).save_pretrained(path)  # NOTE: for `vllm serve`; engine runs pass token ids
    return path


def _word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer, ``w0`` ... ``w{n-1}``, built here (nothing can be downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway Redis server's URL (or ``KVMEM_TEST_REDIS_URL``)."""
    if os.environ.get("KVMEM_TEST_REDIS_URL"):
        yield os.environ["KVMEM_TEST_REDIS_URL"]
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"))  # NOTE: fails under CI when redis-server is missing
    yield server.url
    server.stop()


def engine_run(workdir: Path, name: str, **job: Any) -> dict[str, Any]:
    """Run one engine (``engine_run.py``) in a process of its own; its result.

    Raises:
        AssertionError: the run failed, with the end of its output.
    """
    job = {"max_model_len": 2048, "max_tokens": 8, **job}
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(job))
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
    }
    ranks = job.get("tensor_parallel_size", 1)
    if ranks > 1:
        # NOTE: vLLM-CPU binds each rank's threads to its own cores only when told which (else it refuses:
        # "Not enough allowed NUMA nodes"): one core a rank here
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(ranks))
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    (workdir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"engine run {name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(Path(f"{path}.out").read_text())
