"""On a GPU: ``GroupedMask`` under CUDA's SDPA kernels, and ``BlendCache`` with the model on the device.

On CUDA, SDPA with a mask runs the memory-efficient (or cuDNN) kernel, which may pad or copy
the strided views that ``GroupedMask`` hands it: the runs must still give the one-call result
(``BlendCache`` itself attends in runs on the CPU only; the mask works on any device).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kvmem
from kvmem.kv import BlendCache, Segment
from kvmem.kv.blend_mask import GroupedMask, attention_mask
from tests.kv.workers import build_model, prompt

pytestmark = pytest.mark.cuda

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 300])
def test_grouped_mask_under_cuda_sdpa_equals_one_call(dtype: torch.dtype, window: int | None) -> None:
    """600 of 2,000 positions (sorted, uneven gaps) attend over the prompt: the grouped runs give what one
    SDPA call over the plain mask gives, and both what fp32 math gives."""
    gen = torch.Generator().manual_seed(0)
    total, heads, dim = 2000, 8, 128
    queries = torch.randperm(total, generator=gen)[:600].sort().values.cuda()
    q = torch.randn(1, heads, 600, dim, generator=gen).cuda().to(dtype)
    k = torch.randn(1, heads, total, dim, generator=gen).cuda().to(dtype)
    v = torch.randn(1, heads, total, dim, generator=gen).cuda().to(dtype)
    grouped = attention_mask(queries, total, window, dtype)
    assert isinstance(grouped, GroupedMask) and len(grouped.runs) > 1
    plain = attention_mask(queries, total, window, dtype, grouped=False)
    assert type(plain) is torch.Tensor
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=grouped)
    one = F.scaled_dot_product_attention(q, k, v, attn_mask=plain)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=plain.float())
    assert got.dtype == dtype and got.is_cuda and got.shape == one.shape
    assert (got.float() - one.float()).abs().max().item() < TOLERANCE[dtype]
    assert (got.float() - exact).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blend_cache_on_the_device(tmp_path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama on the GPU: full recompute is the full prefill; the documents come back from the CPU tier
    onto the device; a 30 % recompute attends in one masked SDPA call (runs of queries are for the CPU)."""
    model = build_model("llama", num_hidden_layers=3, max_position_embeddings=4096).to("cuda", dtype)
    docs = [prompt(301 + i, 400) for i in range(3)]
    segments = [Segment(prompt(300, 20)[0], reusable=False), *(Segment(d[0]) for d in docs)]
    segments.append(Segment(prompt(310, 12)[0], reusable=False))
    ids = torch.cat([s.tokens for s in segments])[None].cuda()
    with torch.no_grad():
        full = model(ids).logits[:, -1:].float()
    runs: list[int] = []
    attend = GroupedMask._attend
    monkeypatch.setattr(GroupedMask, "_attend", lambda mask, *a, **k: runs.append(1) or attend(mask, *a, **k))
    with kvmem.Memory(tmp_path, cpu_bytes="256MiB", disk_bytes="256MiB") as memory:
        bc = BlendCache(model, memory, compression="none")
        first = bc.prefill(segments, recompute_ratio=1.0)
        bc.flush()
        again = bc.prefill(segments, recompute_ratio=1.0)
        assert (first.stored_segments, again.loaded_segments) == (3, 3)
        assert again.logits.is_cuda and again.logits.dtype == dtype
        tol = 1e-3 if dtype == torch.float32 else 0.1 * full.abs().max().item()
        assert (again.logits.float() - full).abs().max().item() < tol
        partial = bc.prefill(segments, recompute_ratio=0.3)
        assert partial.recomputed_tokens > 300 and partial.logits.is_cuda and not runs
        bc.close()
