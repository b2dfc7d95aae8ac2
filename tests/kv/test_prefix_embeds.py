"""``PrefixCache.prefill(inputs_embeds=, scope=)``: prompts whose KV depends on more than their token ids.

A multimodal prompt's image placeholder ids are the same for every image; the
embeddings at those positions (and so the prefix's KV) are the image's. Reuse
must stay exact against a full forward pass over the same embeddings, and two
images with equal ids must never share a chunk: the scope keeps them apart.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, PreTrainedModel

import kvmem
from kvmem.errors import InvalidKeyError
from kvmem.kv import PrefillResult, PrefixCache
from kvmem.kv.layout import cache_argument
from tests.kv.conftest import MemoryFactory, ModelFactory
from tests.kv.workers import BLOCK, VOCAB, prompt

PrefixCacheFactory = Callable[..., PrefixCache]
EXACT = 1e-5
IMAGE_TOKEN = VOCAB - 1
IMAGE_TOKENS = 2 * BLOCK + 4  # the placeholders span two chunks and part of a third


def _text(seed: int, n: int) -> torch.Tensor:
    """``[1, n]`` random text ids: :func:`prompt`'s, never the image placeholder."""
    ids = prompt(seed, n)
    return ids.masked_fill(ids == IMAGE_TOKEN, 2)


def _image_prompt(seed: int, text: int) -> torch.Tensor:
    """``[1, n]``: a BOS, ``IMAGE_TOKENS`` placeholders, then ``text`` random text ids."""
    return torch.cat([torch.tensor([[1]]), torch.full((1, IMAGE_TOKENS), IMAGE_TOKEN), _text(seed, text)], dim=1)


def _embeds(model: PreTrainedModel, ids: torch.Tensor, image: int) -> torch.Tensor:
    """The model's embeddings of ``ids`` with the placeholder rows replaced by "image" ``image``'s features."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    features = torch.randn(IMAGE_TOKENS, embeds.shape[-1], generator=torch.Generator().manual_seed(image))
    return embeds.masked_scatter((ids == IMAGE_TOKEN).unsqueeze(-1), features)


def _full_logits(model: PreTrainedModel, embeds: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs_embeds=embeds).logits


def _max_diff(result: PrefillResult, full_logits: torch.Tensor) -> float:
    assert result.logits.shape[1] == result.computed_tokens
    return (result.logits - full_logits[:, result.reused_tokens :]).abs().max().item()


def test_embeds_prefill_reuses_a_scoped_prefix_exactly(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    pc = prefix_cache(model, make_memory())
    turn1 = _image_prompt(20, 2 * BLOCK + 3)
    turn2 = torch.cat([turn1, _text(21, BLOCK + 5)], dim=1)  # the same image and conversation, one more question

    first = pc.prefill(turn1, inputs_embeds=_embeds(model, turn1, image=1), scope="image-1")
    assert first.reused_tokens == 0
    assert _max_diff(first, _full_logits(model, _embeds(model, turn1, image=1))) <= EXACT
    pc.flush()

    embeds2 = _embeds(model, turn2, image=1)
    assert pc.lookup(turn2, scope="image-1") == turn1.shape[1] // BLOCK * BLOCK
    result = pc.prefill(turn2, inputs_embeds=embeds2[0], scope="image-1")  # [n, hidden] is accepted too
    assert result.reused_tokens == turn1.shape[1] // BLOCK * BLOCK
    assert _max_diff(result, _full_logits(model, embeds2)) <= EXACT


def test_two_images_with_the_same_ids_never_share_chunks(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    memory = make_memory()
    pc = prefix_cache(model, memory)
    ids = _image_prompt(22, BLOCK + 2)
    keys = {scope: pc.chunk_keys(ids, scope=scope) for scope in ("", "image-1", "image-2")}
    assert all(len(k) == ids.shape[1] // BLOCK for k in keys.values())
    assert not set(keys["image-1"]) & set(keys["image-2"]) and not set(keys[""]) & set(keys["image-1"])

    pc.prefill(ids, inputs_embeds=_embeds(model, ids, image=1), scope="image-1")
    pc.flush()
    assert pc.lookup(ids, scope="image-1") == ids.shape[1] // BLOCK * BLOCK
    assert pc.lookup(ids, scope="image-2") == 0 and pc.lookup(ids) == 0

    embeds2 = _embeds(model, ids, image=2)
    result = pc.prefill(ids, inputs_embeds=embeds2, scope="image-2")
    assert result.reused_tokens == 0
    assert _max_diff(result, _full_logits(model, embeds2)) <= EXACT
    assert memory.metrics.value("kvmem_kv_tokens_total", kind="reused") == 0


def test_store_and_generate_key_their_chunks_by_scope(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model = tiny_model("llama")
    pc = prefix_cache(model, make_memory())
    ids = _text(30, 2 * BLOCK + 3)
    with torch.no_grad():
        cache = model(ids, use_cache=True)[cache_argument(model)]
    assert pc.store(ids, cache, scope="s") == 2
    assert (pc.lookup(ids, scope="s"), pc.lookup(ids)) == (2 * BLOCK, 0)

    out = pc.generate(ids, scope="t", max_new_tokens=BLOCK, do_sample=False)
    pc.flush()  # the prompt's and the generated text's chunks, under "t" only
    assert pc.lookup(out, scope="t") == out.shape[1] // BLOCK * BLOCK == 3 * BLOCK
    assert pc.lookup(out, scope="s") == 2 * BLOCK and pc.lookup(out) == 0
    assert torch.equal(pc.generate(ids, scope="s", max_new_tokens=BLOCK, do_sample=False), out)


def test_scope_is_not_spelled_by_another_namespace(
    tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    model, memory = tiny_model("llama"), make_memory()
    ids = prompt(23, 2 * BLOCK)
    scoped = prefix_cache(model, memory, namespace="a").chunk_keys(ids, scope="b")
    for namespace, scope in (("a/b", ""), ("a", "b/"), ("ab", ""), ("", "ab"), ("a\x00b", "")):
        assert prefix_cache(model, memory, namespace=namespace).chunk_keys(ids, scope=scope) != scoped


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(torch.zeros(1, 7, 64), id="too-short"),
        pytest.param(torch.zeros(2, 8, 64), id="batch-2"),
        pytest.param(torch.zeros(8, 64, dtype=torch.long), id="integer"),
        pytest.param(torch.zeros(64), id="1-d"),
    ],
)
def test_bad_inputs_embeds_raise(
    bad: torch.Tensor, tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    pc = prefix_cache(tiny_model("llama"), make_memory())
    with pytest.raises(InvalidKeyError, match="inputs_embeds"):
        pc.prefill(prompt(24, 8), inputs_embeds=bad)


@pytest.mark.parametrize("method", ["prefill", "lookup", "chunk_keys", "prefetch"])
def test_a_scope_that_is_not_a_str_raises(
    method: str, tiny_model: ModelFactory, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    pc = prefix_cache(tiny_model("llama"), make_memory())
    with pytest.raises(InvalidKeyError, match="scope"):
        getattr(pc, method)(prompt(25, 2 * BLOCK), scope=b"image")


# -- a LLaVA model: its KV lives in its language model ------------------------------------------------------------


@pytest.fixture(scope="module")
def llava() -> LlavaForConditionalGeneration:
    """A tiny LLaVA (random weights): a 2-layer CLIP vision tower on 32x32 images (16 patches), a 2-layer Llama."""
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, image_seq_length=16)
    return LlavaForConditionalGeneration(config).eval()


def _llava_embeds(model: LlavaForConditionalGeneration, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """What ``LlavaModel.forward`` feeds its language model: text embeddings, projected image features merged."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        features = torch.cat(model.model.get_image_features(pixels).pooler_output)
    return embeds.masked_scatter((ids == IMAGE_TOKEN).unsqueeze(-1), features)


def test_llava_prefill_from_merged_embeddings_matches_its_own_forward(
    llava: LlavaForConditionalGeneration, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    pc = prefix_cache(llava, make_memory())
    assert cache_argument(llava) in ("cache", "past_key_values")  # NOTE: 5.19: past_key_values
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    head = torch.cat([torch.tensor([[1]]), torch.full((1, 16), IMAGE_TOKEN), _text(26, BLOCK + 3)], dim=1)
    turn1 = torch.cat([head, _text(27, 5)], dim=1)
    turn2 = torch.cat([turn1, _text(28, BLOCK + 2)], dim=1)
    for turn, reused in ((turn1, 0), (turn2, turn1.shape[1] // BLOCK * BLOCK)):
        with torch.no_grad():
            full = llava(input_ids=turn, pixel_values=pixels).logits
        result = pc.prefill(turn, inputs_embeds=_llava_embeds(llava, turn, pixels), scope="pixels-5", logits_to_keep=1)
        pc.flush()
        assert result.reused_tokens == reused
        assert result.logits.shape == (1, 1, VOCAB)
        assert (result.logits[:, -1] - full[:, -1]).abs().max().item() <= EXACT

        # the returned cache decodes on like the model's own
        nxt = full[:, -1:].argmax(-1)
        with torch.no_grad():
            step = llava(input_ids=nxt, **{cache_argument(llava): result.cache}).logits[:, -1]
            whole = llava(input_ids=torch.cat([turn, nxt], dim=1), pixel_values=pixels).logits[:, -1]
        assert (step - whole).abs().max().item() <= EXACT


def test_llava_text_only_prompt_reuses_by_ids(
    llava: LlavaForConditionalGeneration, make_memory: MemoryFactory, prefix_cache: PrefixCacheFactory
) -> None:
    memory: kvmem.Memory = make_memory()
    pc = prefix_cache(llava, memory)
    ids = _text(29, 3 * BLOCK + 2)
    pc.prefill(ids)
    pc.flush()
    result = pc.prefill(ids)
    with torch.no_grad():
        full = llava(input_ids=ids).logits
    assert result.reused_tokens == 3 * BLOCK
    assert _max_diff(result, full) <= EXACT
