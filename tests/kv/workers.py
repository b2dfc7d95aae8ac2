"""Tiny real models for the KV tests, the prompts they share, and the fresh-process worker.

Run as a script (``python tests/kv/workers.py COMMAND ...``); the tests import
the builders from here so both processes build bit-identical models.

Commands:
    disk-reuse PATH ARCH...   for each ARCH: build the model (seed 0), open a Memory on
                              PATH with no CPU tier, prefill ``PROMPT_B`` and generate from
                              it; print one JSON object {arch: report} (see :func:`disk_reuse`)
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

import kvmem
from kvmem.kv import PrefixCache
from kvmem.kv.stream import ChunkSource

ARCHS = ("llama", "qwen2", "gpt2", "mistral")
BLOCK = 16  # tokens per chunk in these tests
WINDOW = 24  # Mistral's sliding window: smaller than every prompt and than the reused prefix
VOCAB = 1000
NEW_TOKENS = 32

SHARED = 4 * BLOCK  # PROMPT_A and PROMPT_B share their first 4 chunks


def prompt(seed: int, n: int) -> torch.Tensor:
    """``[1, n]`` random token ids (no special ids), the same in every process."""
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


_PREFIX = prompt(100, SHARED)
PROMPT_A = torch.cat([_PREFIX, prompt(101, 10)], dim=1)  # stores the 4 shared chunks
PROMPT_B = torch.cat([_PREFIX, prompt(102, 13)], dim=1)  # reuses them, computes 13 tokens


def config(arch: str, **overrides: object) -> PretrainedConfig:
    """A tiny config of ``arch``: hidden 64, 2 layers, vocab 1000, no EOS (generation runs its full length).

    ``overrides`` replace decoder settings (e.g. ``num_hidden_layers``, ``rope_parameters``); not for GPT-2.
    """
    common = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": None, "pad_token_id": 0}
    decoder = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        **common,
        **overrides,
    }  # GQA: 2 KV heads, 4 query heads
    if arch == "llama":
        return LlamaConfig(**decoder)
    if arch == "qwen2":
        return Qwen2Config(**decoder)
    if arch == "mistral":
        return MistralConfig(sliding_window=WINDOW, **decoder)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
    raise ValueError(f"arch {arch!r}: expected one of {ARCHS}")


def build_model(arch: str, seed: int = 0, **overrides: object) -> PreTrainedModel:
    """``arch`` (with :func:`config` ``overrides``) with random weights drawn from ``seed`` (fp32, eval mode)."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(arch, **overrides)).eval()


def stored_sources(memory: kvmem.Memory, pc: PrefixCache) -> list[ChunkSource]:
    """Prefill PROMPT_B, then the sources of its stored chunks, as the prefix cache would locate them."""
    pc.prefill(PROMPT_B)
    pc.flush()
    sources = []
    for key in pc.chunk_keys(PROMPT_B):
        skey = memory.storage_key(key, pc.namespace)
        tier = memory.chunk_store().locate(skey)
        assert tier is not None
        sources.append(ChunkSource(skey, tier))
    return sources


def disk_reuse(path: str, arch: str) -> dict[str, object]:
    """Reuse ``PROMPT_B``'s prefix from the disk tier at ``path`` (no CPU tier: every chunk comes from disk).

    Returns:
        ``fingerprint``, ``reused`` (tokens), ``max_diff`` (reused-prefill logits vs a full
        forward pass), ``generate_reused`` (tokens), ``generated`` (token ids of
        ``pc.generate``), ``chunk_hits`` (by tier).
    """
    model = build_model(arch)
    with kvmem.Memory(path, cpu_bytes=0, disk_bytes="256MiB", fsync="never") as memory:
        pc = PrefixCache(model, memory, block_size=BLOCK, compression="none")
        with torch.no_grad():
            full = model(PROMPT_B).logits
        result = pc.prefill(PROMPT_B)
        diff = (result.logits - full[:, result.reused_tokens :]).abs().max().item()
        generated = pc.generate(PROMPT_B, max_new_tokens=NEW_TOKENS, do_sample=False)
        pc.close()
        m = memory.metrics
        return {
            "fingerprint": pc.fingerprint,
            "reused": result.reused_tokens,
            "max_diff": diff,
            "generate_reused": int(m.value("kvmem_kv_tokens_total", kind="reused")) - result.reused_tokens,
            "generated": generated[0].tolist(),
            "chunk_hits": {t: m.value("kvmem_kv_chunk_hits_total", tier=t) for t in ("cpu", "disk")},
        }


def main(argv: list[str]) -> None:
    cmd, path, *archs = argv
    if cmd != "disk-reuse":
        raise SystemExit(f"unknown command {cmd!r}")
    torch.set_num_threads(1)  # as the tests do (see tests/kv/conftest.py)
    print(json.dumps({arch: disk_reuse(path, arch) for arch in archs}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
