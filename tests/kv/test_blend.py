"""``BlendCache`` on tiny real models (3 layers, random weights, fixed seeds) and a real ``Memory``.

What must hold exactly: recomputing every token is a full prefill; a segment's keys
computed at position 0 and re-rotated to ``p`` are the keys computed at ``p`` (Llama,
Qwen 2 and 3, Mistral, Gemma 2 and 3, linear, Llama 3 and YaRN RoPE); the stored
KV of a segment is found again by its content wherever it lands, from the CPU tier or,
in a fresh ``Memory``, from disk. How close a partial recompute comes to the full prefill
on a trained model is measured in ``benchmarks/bench_blend.py``, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, PreTrainedModel, Qwen3Config

import kvmem
from kvmem.errors import ConfigError, InvalidKeyError, UnsupportedModelError
from kvmem.kv import BlendCache, BlendResult, Segment, blend
from kvmem.kv.blend_mask import GroupedMask, attention_mask
from kvmem.kv.layout import held, kept_range, kv_layer
from tests.kv.conftest import MemoryFactory
from tests.kv.workers import VOCAB, WINDOW, build_model, prompt

# Mistral: sliding window 24, shorter than the prompts; Qwen 3: q/k norms before RoPE; Gemma 2: sliding
# layers, soft-capped logits, eager attention; Gemma 3: sliding layers with a RoPE of their own
ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3")
MORE_ARCHS = {"qwen3": Qwen3Config, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}
EXACT = 1e-5
LAYERS = 3  # layer 0 (exact after rotation), the check layer, one layer above it
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

SYSTEM, DOC_A, DOC_B, DOC_C = prompt(200, 12), prompt(201, 40), prompt(202, 33), prompt(203, 27)
QUESTION = prompt(204, 9)

BlendFactory = Callable[..., BlendCache]


def _model(arch: str, **overrides: object) -> PreTrainedModel:
    if arch not in MORE_ARCHS:
        return build_model(arch, num_hidden_layers=LAYERS, **overrides)
    settings: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": None,
        "pad_token_id": 0,
    }
    if arch.startswith("gemma"):  # layers 0 and 2 slide, layer 1 attends to everything
        settings["sliding_window"] = WINDOW
        settings["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MORE_ARCHS[arch](**{**settings, **overrides})).eval()


@pytest.fixture(scope="module")
def models() -> Callable[..., PreTrainedModel]:
    """``models(arch, **overrides)``: built once per module (kvmem never changes a model)."""
    built: dict[str, PreTrainedModel] = {}

    def get(arch: str, **overrides: object) -> PreTrainedModel:
        name = f"{arch}{sorted(overrides.items())}"
        if name not in built:
            built[name] = _model(arch, **overrides)
        return built[name]

    return get


@pytest.fixture
def blend_cache() -> Iterator[BlendFactory]:
    """``blend_cache(model, memory, **options)``: lossless segments; every instance closed at teardown."""
    made: list[BlendCache] = []

    def make(model: PreTrainedModel, memory: kvmem.Memory, **options: object) -> BlendCache:
        bc = BlendCache(model, memory, **{"compression": "none", **options})  # type: ignore[arg-type]
        made.append(bc)
        return bc

    yield make
    for bc in made:
        bc.close()


def _rag(*docs: torch.Tensor, question: torch.Tensor = QUESTION) -> list[Segment]:
    """``system + docs + question``: the system prompt and the question are computed, the documents reused."""
    return [Segment(SYSTEM, reusable=False), *(Segment(d) for d in docs), Segment(question, reusable=False)]


def _full(model: PreTrainedModel, segments: list[Segment]) -> tuple[torch.Tensor, object]:
    """Logits and cache of a plain full forward pass over the segments' concatenation."""
    ids = torch.cat([s.tokens for s in segments])[None]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return out.logits, out.cache


def _layer_kv(cache: object, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A cache layer's K, V and the absolute position of their first token."""
    lay = kv_layer(cache, layer)  # type: ignore[arg-type]
    keys, values = held(lay)
    return keys, values, kept_range(lay)[0]


def _blend(bc: BlendCache, segments: list[Segment], ratio: float, keep: int = 1) -> BlendResult:
    result = bc.prefill(segments, recompute_ratio=ratio, logits_to_keep=keep)
    bc.flush()
    return result


# -- exactness ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_full_recompute_equals_full_prefill(
    arch: str, models: Callable[..., PreTrainedModel], make_memory: MemoryFactory, blend_cache: BlendFactory
) -> None:
    model = models(arch)
    bc = blend_cache(model, make_memory())
    segments = _rag(DOC_A, DOC_B)
    logits, cache = _full(model, segments)
    _blend(bc, segments, 1.0)  # stores the documents
    result = _blend(bc, segments, 1.0, keep=QUESTION.shape[1])
    assert (result.loaded_segments, result.stored_segments, result.reused_tokens) == (2, 0, 0)
    assert (result.logits - logits[:, -QUESTION.shape[1] :]).abs().max().item() < EXACT
    for layer in range(LAYERS):
        k, v, first = _layer_kv(result.cache, layer)
        k_ref, v_ref, first_ref = _layer_kv(cache, layer)
        assert first == first_ref
        assert (k - k_ref).abs().max().item() < EXACT and (v - v_ref).abs().max().item() < EXACT
    # the cache decodes on: the next token's logits are the full forward's over the longer prompt
    nxt = prompt(205, 1)
    with torch.no_grad():
        step = model(nxt, cache=result.cache).logits[:, -1]
        whole = model(torch.cat([*(s.tokens for s in segments), nxt[0]])[None]).logits[:, -1]
    assert (step - whole).abs().max().item() < EXACT


def test_eager_attention_full_recompute_is_exact(make_memory: MemoryFactory, blend_cache: BlendFactory) -> None:
    model = _model("llama", attn_implementation="eager")
    bc = blend_cache(model, make_memory())
    segments = _rag(DOC_A, DOC_B)
    logits, _ = _full(model, segments)
    _blend(bc, segments, 0.0)
    assert (_blend(bc, segments, 1.0).logits - logits[:, -1:]).abs().max().item() < EXACT


@pytest.mark.parametrize("arch", ARCHS)
def test_one_segment_first_needs_no_recompute(
    arch: str, models: Callable[..., PreTrainedModel], make_memory: MemoryFactory, blend_cache: BlendFactory
) -> None:
    """A stored segment at position 0 followed by a question: its loaded K/V are the full prefill's at every
    layer (nothing precedes it), so ``recompute_ratio=0`` gives the full prefill's logits."""
    model = models(arch)
    bc = blend_cache(model, make_memory())
    segments = [Segment(DOC_A), Segment(QUESTION, reusable=False)]
    bc.store_segment(segments[0])
    result = _blend(bc, segments, 0.0, keep=QUESTION.shape[1])
    assert result.loaded_segments == 1 and result.reused_tokens == DOC_A.shape[1]
    logits, _ = _full(model, segments)
    assert (result.logits - logits[:, -QUESTION.shape[1] :]).abs().max().item() < EXACT


@pytest.mark.parametrize(
    ("arch", "rope"),
    [*((arch, None) for arch in ARCHS), ("llama", LINEAR), ("llama", LLAMA3), ("llama", YARN), ("qwen3", YARN)],
)
def test_rerotated_keys_equal_keys_computed_at_their_position(
    arch: str,
    rope: dict[str, object] | None,
    models: Callable[..., PreTrainedModel],
    make_memory: MemoryFactory,
    blend_cache: BlendFactory,
) -> None:
    """Layer 0's K/V depend on the token and its position only: a segment computed at 0 and rotated to
    its place must give the full forward's layer-0 K/V there (``recompute_ratio=0``: nothing recomputed)."""
    model = models(arch, **({"rope_parameters": rope} if rope else {}))
    bc = blend_cache(model, make_memory())
    segments = [Segment(DOC_A, reusable=False), Segment(DOC_B), Segment(DOC_C), Segment(QUESTION, reusable=False)]
    bc.store_segment(segments[1])
    bc.store_segment(segments[2])
    result = _blend(bc, segments, 0.0)
    assert result.loaded_segments == 2 and result.reused_tokens == DOC_B.shape[1] + DOC_C.shape[1]
    _, cache = _full(model, segments)
    k, v, first = _layer_kv(result.cache, 0)
    k_ref, v_ref, first_ref = _layer_kv(cache, 0)
    assert first == first_ref
    start = max(DOC_A.shape[1], first)  # a sliding layer keeps only its window
    stop = DOC_A.shape[1] + DOC_B.shape[1] + DOC_C.shape[1]
    moved = slice(start - first, stop - first)
    assert (k[:, :, moved] - k_ref[:, :, moved]).abs().max().item() < EXACT
    assert (v[:, :, moved] - v_ref[:, :, moved]).abs().max().item() < EXACT
    # above layer 0 the reused K/V differ (the documents did not see what precedes them): that is the blend's job
    k1, _, first1 = _layer_kv(result.cache, 1)
    k1_ref, _, _ = _layer_kv(cache, 1)
    moved1 = slice(max(DOC_A.shape[1], first1) - first1, stop - first1)
    assert (k1[:, :, moved1] - k1_ref[:, :, moved1]).abs().max().item() > 1e-3


def test_bf16_keys_are_rotated_in_fp32_then_stored_in_bf16(
    make_memory: MemoryFactory, blend_cache: BlendFactory
) -> None:
    """A bf16 model's loaded keys are turned in fp32 and written back as bf16: within bf16 rounding of the
    keys the full forward computes at their positions."""
    model = _model("llama").to(torch.bfloat16)
    bc = blend_cache(model, make_memory())
    segments = [Segment(DOC_A, reusable=False), Segment(DOC_B), Segment(QUESTION, reusable=False)]
    bc.store_segment(segments[1])
    result = _blend(bc, segments, 0.0)
    k, _, _ = _layer_kv(result.cache, 0)
    k_ref, _, _ = _layer_kv(_full(model, segments)[1], 0)
    moved = slice(DOC_A.shape[1], DOC_A.shape[1] + DOC_B.shape[1])
    assert k.dtype == torch.bfloat16 and result.loaded_segments == 1
    assert (k[:, :, moved].float() - k_ref[:, :, moved].float()).abs().max().item() < 0.02 * k_ref.abs().max().item()


# -- reuse by content, any position, any tier -------------------------------------------------------------------


def test_documents_in_another_order_reuse_the_stored_kv(
    models: Callable[..., PreTrainedModel], make_memory: MemoryFactory, blend_cache: BlendFactory
) -> None:
    model = models("llama")
    memory = make_memory()
    bc = blend_cache(model, memory)
    first = _blend(bc, _rag(DOC_A, DOC_B), 0.15)
    assert (first.loaded_segments, first.stored_segments) == (0, 2)
    assert bc.lookup(_rag(DOC_B, DOC_C)) == [False, True, False, False]
    reordered = _rag(DOC_C, DOC_B, DOC_A, question=prompt(206, 7))
    second = _blend(bc, reordered, 1.0)
    assert (second.loaded_segments, second.stored_segments) == (2, 1)  # B and A loaded, C new
    logits, _ = _full(model, reordered)
    assert (second.logits - logits[:, -1:]).abs().max().item() < EXACT
    assert memory.metrics.value("kvmem_kv_tokens_total", kind="requested") > 0


def test_stored_segments_round_trip_through_disk(make_memory: MemoryFactory, blend_cache: BlendFactory) -> None:
    """A second BlendCache on the same path (a fresh Memory: empty CPU tier) loads the segments from disk and
    blends them exactly as the first one blended them from memory."""
    model = _model("qwen2")  # a fresh instance: nothing shared with the first BlendCache but the files
    segments = _rag(DOC_B, DOC_A)
    bc = blend_cache(model, make_memory("shared"))
    _blend(bc, segments, 0.0)
    warm = _blend(bc, segments, 0.15, keep=4)
    bc.close()
    again = blend_cache(_model("qwen2"), make_memory("shared"))
    cold = _blend(again, segments, 0.15, keep=4)
    assert (cold.loaded_segments, cold.stored_segments) == (2, 0)
    assert cold.recomputed_tokens == warm.recomputed_tokens
    assert (cold.logits - warm.logits).abs().max().item() < EXACT


def test_recompute_ratio_sets_how_many_reused_tokens_are_recomputed(
    models: Callable[..., PreTrainedModel], make_memory: MemoryFactory, blend_cache: BlendFactory
) -> None:
    bc = blend_cache(models("mistral"), make_memory(), recompute_ratio=0.25)
    segments = _rag(DOC_A, DOC_B)
    docs = DOC_A.shape[1] + DOC_B.shape[1]
    computed = SYSTEM.shape[1] + QUESTION.shape[1]
    assert _blend(bc, segments, 0.0).recomputed_tokens == computed
    result = bc.prefill(segments)  # the instance's ratio
    assert result.recomputed_tokens == computed + -(-docs // 4)
    assert result.reused_tokens + result.recomputed_tokens == docs + computed
    assert result.cache.get_seq_length() == docs + computed


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gemma2"])  # Gemma 2 runs eager attention
@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_attention_in_runs_of_queries_changes_nothing(
    arch: str,
    ratio: float,
    models: Callable[..., PreTrainedModel],
    make_memory: MemoryFactory,
    blend_cache: BlendFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SDPA computes the selected tokens' attention in runs of queries, each over the keys up to its last
    position (Mistral: only those in its window): the same logits and K/V as one run over the whole prompt."""
    segments = _rag(DOC_A, DOC_B, DOC_C)
    bc = blend_cache(models(arch), make_memory())
    _blend(bc, segments, ratio)  # stores the documents
    monkeypatch.setattr("kvmem.kv.blend_mask.GROUP_QUERIES", 10_000)
    whole = _blend(bc, segments, ratio, keep=QUESTION.shape[1])
    monkeypatch.setattr("kvmem.kv.blend_mask.GROUP_QUERIES", 3)
    attend, runs = GroupedMask._attend, []

    def counted(mask: GroupedMask, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        runs.append(len(mask.runs))
        return attend(mask, *args, **kwargs)

    monkeypatch.setattr(GroupedMask, "_attend", counted)
    grouped = _blend(bc, segments, ratio, keep=QUESTION.shape[1])
    assert len(runs) >= LAYERS - 1 and min(runs) > 3  # transformers' SDPA call went through the runs
    assert grouped.recomputed_tokens == whole.recomputed_tokens > 3 * 3
    assert (grouped.logits - whole.logits).abs().max().item() < EXACT
    for layer in range(LAYERS):
        k, v, first = _layer_kv(grouped.cache, layer)
        k_ref, v_ref, first_ref = _layer_kv(whole.cache, layer)
        assert first == first_ref
        assert (k - k_ref).abs().max().item() < EXACT and (v - v_ref).abs().max().item() < EXACT


# -- refusals ----------------------------------------------------------------------------------------------------


def test_models_without_supported_rotary_embeddings_are_refused(make_memory: MemoryFactory) -> None:
    memory = make_memory()
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel has no model\.embed_tokens.*rope_type"):
        BlendCache(build_model("gpt2"), memory)
    for rope_type in ("dynamic", "longrope"):
        rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64}
        if rope_type == "longrope":
            rope |= {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
        with pytest.raises(UnsupportedModelError, match=rf"rope_type='{rope_type}'.*depend on the sequence length"):
            BlendCache(_model("llama", rope_parameters=rope), memory)
    gemma = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    rope = {"full_attention": gemma, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    with pytest.raises(UnsupportedModelError, match=r"'dynamic' \(layer type full_attention\)"):
        BlendCache(_model("gemma3", rope_parameters=rope), memory)
    with pytest.raises(UnsupportedModelError, match=r"attn_implementation='flex_attention'.*'sdpa' or 'eager'"):
        BlendCache(_model("llama", attn_implementation="flex_attention"), memory)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, True, "0.15", float("nan")])
def test_bad_recompute_ratios_are_refused(
    ratio: object, models: Callable[..., PreTrainedModel], make_memory: MemoryFactory, blend_cache: BlendFactory
) -> None:
    model, memory = models("llama"), make_memory()
    with pytest.raises(ConfigError, match=r"recompute_ratio=.*expected a number from 0\.0 to 1\.0"):
        BlendCache(model, memory, recompute_ratio=ratio)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="recompute_ratio="):
        blend_cache(model, memory).prefill(_rag(DOC_A), recompute_ratio=ratio)  # type: ignore[arg-type]


def test_bad_segments_and_options_are_refused(
    models: Callable[..., PreTrainedModel], make_memory: MemoryFactory, blend_cache: BlendFactory
) -> None:
    model, memory = models("llama"), make_memory()
    with pytest.raises(ConfigError, match=r"check_layer=0: expected an int from 1 to 2"):
        BlendCache(model, memory, check_layer=0)
    with pytest.raises(InvalidKeyError, match=r"segment ids of shape \(0,\)"):
        Segment([])
    with pytest.raises(InvalidKeyError, match="dtype torch.float32"):
        Segment(torch.ones(3))
    bc = blend_cache(model, memory)
    with pytest.raises(InvalidKeyError, match="expected a non-empty list of kvmem.kv.Segment"):
        bc.prefill([])
    with pytest.raises(InvalidKeyError, match="expected a non-empty list of kvmem.kv.Segment"):
        bc.prefill([DOC_A])  # type: ignore[list-item]
    total = SYSTEM.shape[1] + DOC_A.shape[1] + QUESTION.shape[1]
    with pytest.raises(ConfigError, match=rf"logits_to_keep=0: expected an int from 1 to {total}"):
        bc.prefill(_rag(DOC_A), logits_to_keep=0)


def test_runs_start_at_keys_aligned_for_cuda_kernels() -> None:
    """A sliding window's run starts its keys at a multiple of 16 (CUDA's memory-efficient SDPA reads the
    mask in 16-byte vectors); the keys added before the window stay masked out."""
    queries = torch.arange(101, 1000, 3)
    mask = attention_mask(queries, 1000, 37, torch.float32)
    assert isinstance(mask, GroupedMask) and len(mask.runs) > 1
    plain = mask.as_subclass(torch.Tensor)[0, 0]
    for rows, keys in mask.runs:
        first = int(queries[rows][0])
        assert keys.start % 16 == 0 and first - 37 - 16 < keys.start <= first - 36
        assert (plain[rows, keys.start : first - 36] == torch.finfo(torch.float32).min).all()


# -- the selection: CacheBlend's gradual filtering, KV deviation ------------------------------------------------


def _changed(cache: object, reference: object, layer: int, positions: slice) -> torch.Tensor:
    """Which of ``positions`` hold other K/V at ``layer`` in ``cache`` than in ``reference`` (beyond rounding)."""
    k, v, _ = _layer_kv(cache, layer)
    k_ref, v_ref, _ = _layer_kv(reference, layer)
    diff = (k - k_ref).abs().amax(dim=(0, 1, 3)) + (v - v_ref).abs().amax(dim=(0, 1, 3))
    return diff[positions] > EXACT


@pytest.mark.parametrize("deviation", ["values", "keys_values"])
def test_gradual_filtering_narrows_the_recomputed_tokens_layer_by_layer(
    deviation: str, models: Callable[..., PreTrainedModel], make_memory: MemoryFactory, blend_cache: BlendFactory
) -> None:
    """``filter_layers=2``: layer 1 recomputes twice the final share of the reused tokens, layer 2 the final
    share, a subset of layer 1's; the rest keep their loaded K/V (those of ``recompute_ratio=0``)."""
    model = models("llama")
    bc = blend_cache(model, make_memory(), filter_layers=2, deviation=deviation)
    segments = _rag(DOC_A, DOC_B, DOC_C)
    naive = _blend(bc, segments, 0.0)  # stores the documents; every reused token keeps its loaded K/V
    result = _blend(bc, segments, 0.2)
    docs = DOC_A.shape[1] + DOC_B.shape[1] + DOC_C.shape[1]
    picks = -(-docs // 5)
    assert result.recomputed_tokens == SYSTEM.shape[1] + QUESTION.shape[1] + picks
    reused = slice(SYSTEM.shape[1], SYSTEM.shape[1] + docs)
    layer1 = _changed(result.cache, naive.cache, 1, reused)
    layer2 = _changed(result.cache, naive.cache, 2, reused)
    assert (int(layer1.sum()), int(layer2.sum())) == (2 * picks, picks)
    assert not (layer2 & ~layer1).any()
    assert not _changed(result.cache, naive.cache, 0, reused).any()  # layer 0 is exact: never changes


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_key_deviation_is_zero_where_the_loaded_keys_are_exact(
    arch: str,
    models: Callable[..., PreTrainedModel],
    make_memory: MemoryFactory,
    blend_cache: BlendFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stored segment first in the prompt has the full prefill's K/V at every layer, so the keys the
    selection computes (projection, Qwen 3's and Gemma 3's key norm, RoPE at the token's place) must match
    the loaded ones: a wrong norm or rotation would show as a deviation."""
    seen: list[torch.Tensor] = []
    measure = blend._relative_deviation

    def kept(fresh: torch.Tensor, loaded: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
        out = measure(fresh, loaded, reused)
        seen.append(out[reused])
        return out

    monkeypatch.setattr(blend, "_relative_deviation", kept)
    bc = blend_cache(models(arch), make_memory(), filter_layers=2, deviation="keys_values")
    segments = [Segment(DOC_A), Segment(DOC_B), Segment(QUESTION, reusable=False)]
    bc.store_segment(segments[0])
    bc.store_segment(segments[1])
    _blend(bc, segments, 0.3)
    assert len(seen) == 4  # values and keys, at layers 1 and 2
    first = DOC_A.shape[1]
    assert max(d[:first].max().item() for d in seen[:2]) < 1e-10  # layer 1: DOC_A's K and V exact
    assert min(d[first:].max().item() for d in seen[:2]) > 1e-4  # DOC_B's did not see DOC_A


def test_bad_filtering_options_are_refused(models: Callable[..., PreTrainedModel], make_memory: MemoryFactory) -> None:
    model, memory = models("llama"), make_memory()
    with pytest.raises(ConfigError, match=r"filter_layers=0: expected an int from 1 to 2"):
        BlendCache(model, memory, filter_layers=0)
    with pytest.raises(ConfigError, match=r"check_layer=2 with filter_layers=2: .* last layer \(2\)"):
        BlendCache(model, memory, check_layer=2, filter_layers=2)
    with pytest.raises(ConfigError, match=r"deviation='keys': expected one of \('values', 'keys_values'\)"):
        BlendCache(model, memory, deviation="keys")
