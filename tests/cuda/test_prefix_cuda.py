"""On a GPU: a prefix in the CPU tier is staged onto the device (:mod:`kvmem.kv.staging`): what it installs
is what the layer-by-layer path installs, and a prefill on it gives the full prefill's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvmem
from kvmem.kv import PrefixCache
from kvmem.kv.layout import new_cache
from kvmem.kv.staging import DeviceStaging
from kvmem.kv.stream import LayerwiseLoader, StreamingCache
from tests.kv.workers import BLOCK, PROMPT_B, SHARED, build_model, stored_sources

pytestmark = pytest.mark.cuda


def _spy_on_place(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers :meth:`DeviceStaging.place` is called for, in order (the real method still runs)."""
    placed: list[int] = []
    place = DeviceStaging.place

    def spy(self: DeviceStaging, layer_idx: int, *args: object) -> None:
        placed.append(layer_idx)
        place(self, layer_idx, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DeviceStaging, "place", spy)
    return placed


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("compression", ["none", "fp16", "int8", "int4"])
def test_staged_prefix_is_what_the_layer_path_installs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, compression: str
) -> None:
    """llama: a run of three whole chunks (one copy kernel) and a cut last chunk; mistral: its window starts
    inside a chunk, so every chunk is placed on its own."""
    model = build_model(arch)
    with kvmem.Memory(tmp_path, cpu_bytes="64MiB", disk_bytes="64MiB") as memory:
        pc = PrefixCache(model, memory, block_size=BLOCK, compression=compression)
        sources = stored_sources(memory, pc)[:4]
        pc.close()
        assert {s.tier for s in sources} == {"cpu"}
        tokens = 4 * BLOCK - 3
        placed = _spy_on_place(monkeypatch)

        def load(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
            cache = new_cache(model, StreamingCache)
            loader = LayerwiseLoader(memory.chunk_store(), sources, cache, BLOCK, tokens, torch.device(device), room=5)
            loader.wait_all()
            return [(layer.keys, layer.values) for layer in cache.layers]

        on_gpu = load("cuda")
        assert placed == list(range(len(on_gpu)))
        on_cpu = load("cpu")
        exact = compression in ("none", "fp16")
        for (gk, gv), (ck, cv) in zip(on_gpu, on_cpu):
            assert gk.is_cuda and gk.shape == ck.shape and gv.shape == cv.shape
            if exact:
                assert torch.equal(gk.cpu(), ck) and torch.equal(gv.cpu(), cv)
            else:  # the device's dequantize may round differently in the last bit; a misplaced token would not
                torch.testing.assert_close(gk.cpu(), ck, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(gv.cpu(), cv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_prefill_on_the_device_gives_the_full_prefills_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tier: str
) -> None:
    """Chunks in the CPU tier are staged; chunks on disk are read layer by layer (staging declined)."""
    model = build_model("llama").to("cuda", dtype)
    ids = PROMPT_B.cuda()
    with torch.no_grad():
        full = model(ids).logits.float()
    cpu_bytes = "64MiB" if tier == "cpu" else 0
    with kvmem.Memory(tmp_path, cpu_bytes=cpu_bytes, disk_bytes="64MiB") as memory:
        pc = PrefixCache(model, memory, block_size=BLOCK, compression="none")
        pc.prefill(ids)
        pc.flush()
        placed = _spy_on_place(monkeypatch)
        again = pc.prefill(ids, logits_to_keep=1)
        assert again.reused_tokens == SHARED and again.logits.is_cuda
        assert bool(placed) == (tier == "cpu")
        tol = 1e-4 if dtype == torch.float32 else 0.05 * full[:, -1].abs().max().item()
        assert (again.logits[:, -1].float() - full[:, -1]).abs().max().item() < tol
        pc.close()
