"""int8/int4 prefix chunks load through the fused dequantize + scatter op, bit for bit as the decode path.

The decode path (``QuantCodec.decode`` through :func:`kvmem.codecs.serialization.decode_tensor_range`)
is the reference: the fused path must put exactly its values into the cache, so the
logits and generated tokens of a prefill are the same with either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import kvmem
import kvmem.cuda
from kvmem.codecs import tensor_codec
from kvmem.codecs.quant import QuantCodec
from kvmem.codecs.serialization import decode_value
from kvmem.cuda.kvquant import dequantize_kv_into
from kvmem.errors import CodecError
from kvmem.kv import PrefixCache
from kvmem.kv import stream as kvstream
from kvmem.kv.layout import cache_argument, new_cache
from kvmem.kv.stream import ChunkLoadError, ChunkSource, LayerwiseLoader, StreamingCache
from tests.kv.workers import BLOCK, NEW_TOKENS, PROMPT_B, SHARED, stored_sources

QUANT = ["int8", "int4", "int4+lz4"]


# -- the op against the codec --------------------------------------------------------------------------------


def _kv(shape: tuple[int, ...], dtype: torch.dtype, offset: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3 + offset).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (``torch.equal`` on floats calls -0.0 and 0.0 equal)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 128), (8, 16), (4, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("shape", [(1, 2, 16, 8), (2, 3, 37, 64), (1, 2, 256, 64), (1, 1, 5, 7)])
def test_reference_op_is_quantcodec_decode_bit_for_bit(
    bits: int, group: int, dtype: torch.dtype, axis: int, shape: tuple[int, ...]
) -> None:
    codec = QuantCodec(bits, group)
    # offset 1000: a group's range is tiny next to its magnitude, so its scales fall back to fp32
    for seed, offset in enumerate((0.0, 1000.0)):
        t = _kv(shape, dtype, offset, seed)
        parts, meta = codec.encode(t, axis)
        want = codec.decode(parts, meta, dtype, shape)
        got = torch.full(shape, float("nan"), dtype=dtype)
        dequantize_kv_into(got, 0, parts, meta)
        assert torch.equal(_bits(got), _bits(want))
        # a token range of the chunk (a sliding window's front cut, a prefix's last partial chunk)
        t_len = shape[2]
        for skip, count in ((0, t_len - 1), (t_len // 3, t_len - t_len // 3), (1, max(t_len - 3, 1))):
            dst = torch.full((shape[0], shape[1], count + 4, shape[3]), 7.0, dtype=dtype)
            dequantize_kv_into(dst, 2, parts, meta, skip=skip, count=count)
            assert torch.equal(_bits(dst[:, :, 2 : 2 + count]), _bits(want[:, :, skip : skip + count]))
            assert (dst[:, :, :2] == 7).all() and (dst[:, :, 2 + count :] == 7).all()


def test_dequantize_refuses_parts_that_do_not_match_their_metadata() -> None:
    parts, meta = QuantCodec(8, 16).encode(_kv((1, 2, 16, 8), torch.float32, 0.0, 0), -2)
    dst = torch.empty(1, 2, 16, 8)
    with pytest.raises(CodecError, match="do not match"):
        dequantize_kv_into(dst, 0, {**parts, "q": parts["q"][:, :, :4]}, meta)
    with pytest.raises(CodecError, match="accepted a \\[B, H, T, D\\] chunk"):
        dequantize_kv_into(dst, 0, parts, {**meta, "axis": 3})
    with pytest.raises(CodecError, match="tokens \\[4, 20\\)"):
        dequantize_kv_into(dst, 0, parts, meta, skip=4, count=16)


def test_packed_transfer_keeps_every_part() -> None:
    parts = [
        {
            "q": torch.arange(37, dtype=torch.uint8).reshape(37, 1, 1),
            "step": torch.randn(3, 1, 1).half(),
            "lo": torch.randn(5, 1, 1),
        },
        {"q": torch.arange(9, dtype=torch.uint8), "step": torch.randn(2).double()},
    ]
    moved = kvstream._packed_to(torch.device("cpu"), parts)
    for want, got in zip(parts, moved):
        assert want.keys() == got.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])


# -- the load path ---------------------------------------------------------------------------------------------


class Calls:
    """Counts calls of the real op and of the decode path, by wrapping them (both still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fused = 0
        self.decoded = 0
        op, decode = kvmem.cuda.dequantize_into, kvstream.decode_tensor_range

        def fused(*args: object, **kwargs: object) -> None:
            self.fused += 1
            op(*args, **kwargs)

        def decoded(*args: object, **kwargs: object) -> torch.Tensor:
            self.decoded += 1
            return decode(*args, **kwargs)

        monkeypatch.setattr(kvmem.cuda, "dequantize_into", fused)
        monkeypatch.setattr(kvstream, "decode_tensor_range", decoded)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    yield Calls(monkeypatch)


def _decoded_prefix(
    memory: kvmem.Memory, sources: list[ChunkSource], layer_idx: int, first: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix tokens ``[first, tokens)`` of a layer by the decode path, from the whole blobs."""
    keys, values = [], []
    for source in sources:
        buf = next(t for t in memory._tiers.tiers if t.name == source.tier).get(source.key)
        assert buf is not None
        chunk, header = decode_value(buf)
        assert {leaf["codec"] for leaf in header["leaves"]} <= {"int8", "int4"}
        keys.append(chunk[layer_idx]["k"])
        values.append(chunk[layer_idx]["v"])
    return torch.cat(keys, dim=-2)[:, :, first:tokens], torch.cat(values, dim=-2)[:, :, first:tokens]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("compression", QUANT)
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_fused_load_writes_the_decode_paths_values(
    tiny_model: Callable,
    make_memory: Callable,
    prefix_cache: Callable,
    calls: Calls,
    arch: str,
    compression: str,
    tier: str,
) -> None:
    model = tiny_model(arch)
    memory = make_memory(cpu_bytes="64MiB" if tier == "cpu" else 0)
    sources = stored_sources(memory, prefix_cache(model, memory, compression=compression))[:4]
    assert {s.tier for s in sources} == {tier}
    tokens = 4 * BLOCK - 3  # the last chunk is cut; mistral's window also starts inside a chunk
    cache = new_cache(model, StreamingCache)
    calls.fused = calls.decoded = 0
    LayerwiseLoader(memory.chunk_store(), sources, cache, BLOCK, tokens, torch.device("cpu"), room=5).wait_all()
    assert calls.decoded == 0 and calls.fused > 0
    for layer_idx, layer in enumerate(cache.layers):
        first = tokens - layer.keys.shape[-2]
        want_k, want_v = _decoded_prefix(memory, sources, layer_idx, first, tokens)
        assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)


def _prefill_and_generate(pc: PrefixCache) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    result = pc.prefill(PROMPT_B)
    assert result.reused_tokens == SHARED
    model = pc.model
    nxt = torch.tensor([[5]])
    with torch.no_grad():  # one decoding step on the returned cache
        step = model(nxt, use_cache=True, **{cache_argument(model): result.cache}).logits
    kv = [t for layer in result.cache.layers for t in (layer.keys, layer.values)]
    generated = pc.generate(PROMPT_B, max_new_tokens=NEW_TOKENS, do_sample=False)
    return result.logits, step, kv, generated


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral"])
@pytest.mark.parametrize("compression", QUANT)
def test_prefill_and_generate_are_bit_identical_to_the_decode_path(
    tiny_model: Callable,
    make_memory: Callable,
    prefix_cache: Callable,
    calls: Calls,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    compression: str,
) -> None:
    model = tiny_model(arch)
    memory = make_memory(cpu_bytes=0)  # ranged reads from disk
    stored_sources(memory, prefix_cache(model, memory, compression=compression))
    # prefill and generate each load 4 chunks: one op call per chunk, layer and K/V (a sliding layer: its window's)
    windows = [getattr(layer, "sliding_window", SHARED + 1) - 1 for layer in new_cache(model).layers]
    chunk_layers = sum(4 - max(0, SHARED - w) // BLOCK for w in windows)

    calls.fused = calls.decoded = 0
    fused = _prefill_and_generate(prefix_cache(model, memory, compression=compression))
    assert (calls.fused, calls.decoded) == (2 * chunk_layers * 2, 0)

    monkeypatch.setattr(kvstream, "quantized_leaf", lambda leaf: False)  # the decode path, as before the fused one
    calls.fused = calls.decoded = 0
    decoded = _prefill_and_generate(prefix_cache(model, memory, compression=compression))
    assert (calls.fused, calls.decoded) == (0, 2 * chunk_layers * 2)

    assert torch.equal(_bits(fused[0]), _bits(decoded[0])) and torch.equal(_bits(fused[1]), _bits(decoded[1]))
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(fused[2], decoded[2]))
    assert torch.equal(fused[3], decoded[3])


@pytest.mark.parametrize("layerwise", [True, False])
def test_the_prompts_new_tokens_go_into_the_room_the_prefix_is_not_copied(
    tiny_model: Callable,
    make_memory: Callable,
    prefix_cache: Callable,
    monkeypatch: pytest.MonkeyPatch,
    layerwise: bool,
) -> None:
    model = tiny_model("llama")
    memory = make_memory()
    stored_sources(memory, prefix_cache(model, memory, compression="int8"))
    buffers: list[torch.Tensor] = []
    fused_layer = LayerwiseLoader._fused_layer

    def record(self: LayerwiseLoader, *args: object) -> object:
        filled = fused_layer(self, *args)  # type: ignore[arg-type]
        buffers.extend((filled.keys, filled.values))
        return filled

    monkeypatch.setattr(LayerwiseLoader, "_fused_layer", record)
    result = prefix_cache(model, memory, compression="int8", layerwise=layerwise).prefill(PROMPT_B)
    held = [t for layer in result.cache.layers for t in (layer.keys, layer.values)]
    assert len(buffers) == len(held)
    assert all(
        h.data_ptr() == b.data_ptr() and h.shape == b.shape == (1, 2, PROMPT_B.shape[1], 16)
        for h, b in zip(held, buffers)
    )


def test_room_that_does_not_fit_the_update_falls_back_to_one_copy(
    tiny_model: Callable, make_memory: Callable, prefix_cache: Callable
) -> None:
    model = tiny_model("qwen2")
    memory = make_memory()
    sources = stored_sources(memory, prefix_cache(model, memory, compression="int8"))[:4]
    suffix = PROMPT_B[:, SHARED : SHARED + 3]
    logits = []
    for room in (3, 7):  # exactly the 3 new tokens; more than them
        cache = new_cache(model, StreamingCache)
        cache.loader = LayerwiseLoader(
            memory.chunk_store(), sources, cache, BLOCK, SHARED, torch.device("cpu"), room=room
        )
        with torch.no_grad():
            logits.append(model(suffix, use_cache=True, **{cache_argument(model): cache}).logits)
        assert cache.get_seq_length() == SHARED + 3 and cache.layers[0].keys.shape[-2] == SHARED + 3
    assert torch.equal(logits[0], logits[1])


def _chunk_file(memory: kvmem.Memory, source: ChunkSource) -> Path:
    return Path(memory.config.path) / "disk" / "blobs" / source.key[:2] / f"{source.key}.kvb"


def test_a_corrupt_int8_segment_is_caught_before_the_op_reads_it(
    tiny_model: Callable, make_memory: Callable, prefix_cache: Callable, calls: Calls
) -> None:
    model = tiny_model("llama")
    memory = make_memory(cpu_bytes=0)
    sources = stored_sources(memory, prefix_cache(model, memory, compression="int8"))[:4]
    path = _chunk_file(memory, sources[2])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last layer's V segment
    path.write_bytes(bytes(data))
    cache = new_cache(model, StreamingCache)
    calls.fused = 0
    loader = LayerwiseLoader(memory.chunk_store(), sources, cache, BLOCK, 4 * BLOCK, torch.device("cpu"))
    loader.wait(0)  # layer 0 of every chunk is intact and arrives: a layer waits only for its own bytes
    with pytest.raises(ChunkLoadError) as info:
        loader.wait(len(cache.layers) - 1)
    assert (info.value.index, info.value.corrupt) == (2, True) and "CRC32C" in str(info.value)
    assert calls.fused == 4 * 2 + 2 * 2  # layer 0: 4 chunks; the last layer: chunks 0 and 1, then the bad one


def test_lossless_chunks_keep_the_decode_path(
    tiny_model: Callable, make_memory: Callable, prefix_cache: Callable, calls: Calls
) -> None:
    model = tiny_model("llama")
    memory = make_memory()
    stored_sources(memory, prefix_cache(model, memory, compression="fp16"))
    assert not isinstance(tensor_codec("fp16"), QuantCodec)
    calls.fused = calls.decoded = 0
    assert prefix_cache(model, memory, compression="fp16").prefill(PROMPT_B).reused_tokens == SHARED
    assert (calls.fused, calls.decoded) == (0, 4 * 2 * 2)
