"""``LlavaImageEncoder``: exactly the features a transformers LLaVA model feeds its projector."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration

import kvmem
from kvmem.errors import UnsupportedModelError
from kvmem.multimodal import VisualTokenCache
from kvmem.multimodal.llava import LlavaImageEncoder, clip_image_processor
from tests.multimodal.conftest import picture

IMAGE_TOKEN = 499


def _llava(strategy: str = "default", layer: int | list[int] = -2, seed: int = 0) -> LlavaForConditionalGeneration:
    """A tiny LLaVA: a 3-layer CLIP tower on 32 px images (16 patches), a 1-layer Llama."""
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=16,
    )
    text = LlamaConfig(
        vocab_size=500,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=layer,
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config).eval()


@pytest.mark.parametrize(
    ("strategy", "layer", "tokens", "width"),
    [
        ("default", -2, 16, 32),
        ("full", -1, 17, 32),
        ("default", [0, -2], 16, 64),
    ],
)
def test_tokens_are_what_llava_projects(strategy: str, layer: int | list[int], tokens: int, width: int) -> None:
    model = _llava(strategy, layer)
    encoder = LlavaImageEncoder(model)
    pixels = torch.stack([encoder.preprocess(picture(i)) for i in range(2)])
    assert pixels.shape == (2, 3, 32, 32)

    out = encoder.tokens(pixels)
    assert out.shape == (2, tokens, width) and encoder.num_tokens == tokens
    with torch.no_grad():
        theirs = model.model.get_image_features(pixels).pooler_output  # NOTE: projected, one tensor per image
        ours = model.model.multi_modal_projector(out)
    assert torch.equal(torch.stack(list(theirs)), ours)

    pooled = encoder.pooled(pixels)
    assert pooled.shape == (2, 32)
    with torch.no_grad():
        assert torch.equal(pooled, model.model.vision_tower(pixels).pooler_output)


def test_preprocess_is_the_clip_processor_of_the_vision_config() -> None:
    encoder = LlavaImageEncoder(_llava())
    expected = clip_image_processor(32)(images=picture(1), return_tensors="pt")["pixel_values"][0]
    assert torch.equal(encoder.preprocess(picture(1)), expected)
    assert torch.equal(
        encoder.preprocess(picture(1).convert("L")), encoder.preprocess(picture(1).convert("L").convert("RGB"))
    )


def test_identity_names_weights_layer_strategy_and_preprocessing() -> None:
    base = LlavaImageEncoder(_llava()).identity
    json.dumps(base)  # JSON-able as it is
    assert base["backend"] == "transformers-llava"
    assert LlavaImageEncoder(_llava()).identity == base  # same weights, same identity
    others = [
        LlavaImageEncoder(_llava(seed=1)).identity,
        LlavaImageEncoder(_llava("full")).identity,
        LlavaImageEncoder(_llava(layer=-1)).identity,
        LlavaImageEncoder(_llava(), clip_image_processor(48)).identity,
    ]
    assert all(other != base for other in others)


def test_visual_token_cache_over_a_llava_tower(tmp_path: Path) -> None:
    encoder = LlavaImageEncoder(_llava())
    with kvmem.Memory(str(tmp_path / "kvmem"), cpu_bytes="16MiB", disk_bytes="64MiB", fsync="never") as memory:
        cache = VisualTokenCache.from_encoder(encoder, memory=memory)
        first = cache.encode([picture(1), picture(2)])
        again = cache.encode([picture(2), picture(1)])
        assert (cache.misses, cache.hits) == (2, 2)
        assert torch.equal(again, first.flip(0))
        assert torch.equal(first, encoder.tokens(torch.stack([encoder.preprocess(picture(i)) for i in (1, 2)])))


def test_a_model_without_a_vision_tower_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="not a LLaVA model"):
        LlavaImageEncoder(
            LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
                )
            )
        )
