"""Codecs: spec parsing, round trips of every tensor codec × lz4 over every dtype, error bounds, ratios."""

from __future__ import annotations

import lz4.block
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvmem import blob
from kvmem.codecs import CodecSpec, parse_codec, tensor_codec
from kvmem.codecs.lz4 import Lz4Codec
from kvmem.codecs.quant import QuantCodec
from kvmem.codecs.serialization import _encode_tree, decode_value, encode_value, reframe
from kvmem.errors import CodecError, ConfigError
from tests.bounds import assert_bit_exact, error_bound, exact_under

TENSOR_CODECS = ["none", "fp16", "bf16", "int8", "int4"]
SPECS = [f"{c}+lz4" if lz else c for c in TENSOR_CODECS for lz in (False, True)]
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


# -- helpers -----------------------------------------------------------------------------------
def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def make_case(dtype: torch.dtype, case: str) -> torch.Tensor:
    if case == "random":
        return random_tensor(dtype, (3, 5, 130))  # 130 columns: a partial (padded) quantization group
    if case == "0d":
        return random_tensor(dtype, (1,))[0]
    if case == "empty":
        return random_tensor(dtype, (0, 7))
    if case == "noncontiguous":
        t = random_tensor(dtype, (40, 66)).t()[::2, 1:]
        assert not t.is_contiguous()
        return t
    raise AssertionError(case)


def roundtrip(value: object, spec: str) -> tuple[object, dict, int, int]:
    encoded, raw = encode_value(value, parse_codec(spec))
    back, header = decode_value(encoded.to_tensor())
    return back, header, raw, encoded.nbytes


# -- spec parsing --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, CodecSpec("none", False)),
        ("none", CodecSpec("none", False)),
        ("fp16", CodecSpec("fp16", False)),
        ("bf16", CodecSpec("bf16", False)),
        ("int8", CodecSpec("int8", False)),
        ("int4", CodecSpec("int4", False)),
        ("lz4", CodecSpec("none", True)),
        ("int8+lz4", CodecSpec("int8", True)),
        ("lz4+int4", CodecSpec("int4", True)),
        ("INT4+LZ4", CodecSpec("int4", True)),
        (" fp16 + lz4 ", CodecSpec("fp16", True)),
        ("none+lz4", CodecSpec("none", True)),
    ],
)
def test_parse_codec_accepts(spec: str | None, expected: CodecSpec) -> None:
    assert parse_codec(spec) == expected
    assert parse_codec(str(expected)) == expected


@pytest.mark.parametrize(
    "spec", ["", "int3", "gzip", "lz4+lz4", "int8+int4", "+lz4", "int8+", "fp32", "int8+zstd", 5, b"int8", ["int8"]]
)
def test_parse_codec_refuses(spec: object) -> None:
    with pytest.raises(CodecError, match="codec") as info:
        parse_codec(spec)  # type: ignore[arg-type]
    assert "int8+lz4" in str(info.value) or "int4+lz4" in str(info.value), "the message shows an accepted form"
    with pytest.raises(ConfigError, match="compression"):
        parse_codec(spec, field_name="compression")  # type: ignore[arg-type]


def test_lossless_flags() -> None:
    assert [parse_codec(s).lossless for s in ("none", "lz4", "fp16", "bf16", "int8", "int4+lz4")] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def test_unknown_tensor_codec_and_bad_quant_params() -> None:
    with pytest.raises(CodecError, match="accepted none"):
        tensor_codec("int2")
    for bits, group in ((3, 64), (16, 64), (8, 63)):
        with pytest.raises(CodecError):
            QuantCodec(bits, group)


# -- round trips ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["random", "0d", "empty", "noncontiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip(spec: str, dtype: torch.dtype, case: str, record_property: pytest.RecordProperty) -> None:
    x = make_case(dtype, case)
    back, header, raw, stored = roundtrip(x, spec)
    assert isinstance(back, torch.Tensor)
    assert back.dtype == x.dtype and back.shape == x.shape
    assert raw == x.numel() * x.element_size()
    codec = parse_codec(spec).tensor
    if exact_under(x, codec):
        assert_bit_exact(x, back)
        return
    err = (back.double() - x.double()).abs()
    bound = error_bound(x, codec)
    record_property("max_abs_error", float(err.max()))
    record_property("mean_abs_error", float(err.mean()))
    print(f"{spec} {dtype} {case}: max {float(err.max()):.3g} mean {float(err.mean()):.3g} ratio {raw / stored:.2f}")
    assert bool((err <= bound).all()), f"max error/bound {float((err / bound).max()):.4f}"
    assert float(err.max()) > 0, "a lossy codec that changed nothing was not applied"


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_large(spec: str) -> None:
    x = random_tensor(torch.float32, (8, 256, 256), seed=1)  # 2 MiB
    back, header, raw, stored = roundtrip(x, spec)
    codec = parse_codec(spec).tensor
    assert back.shape == x.shape and back.dtype == x.dtype
    if codec == "none":
        assert_bit_exact(x, back)
    else:
        err = (back.double() - x.double()).abs()
        print(f"{spec} large: max {float(err.max()):.3g} mean {float(err.mean()):.3g} ratio {raw / stored:.2f}")
        assert bool((err <= error_bound(x, codec)).all())


@pytest.mark.parametrize("spec", SPECS)
def test_tree_of_mixed_leaves(spec: str) -> None:
    x = random_tensor(torch.float32, (4, 64))
    ids = torch.arange(10)
    value = {
        "layers": [(x, ids)],
        "meta": {"n": 3, "ok": True, "name": None, "pi": 3.5},
        "arr": np.arange(12, dtype=np.int16).reshape(3, 4),
        "raw": b"\x00\xff" * 50,
        "text": "héllo",
    }
    back, header, _, _ = roundtrip(value, spec)
    assert isinstance(back, dict) and isinstance(back["layers"], list) and isinstance(back["layers"][0], tuple)
    assert back["meta"] == value["meta"] and back["raw"] == value["raw"] and back["text"] == value["text"]
    np.testing.assert_array_equal(back["arr"], value["arr"])
    assert back["arr"].dtype == np.int16
    assert_bit_exact(ids, back["layers"][0][1])
    codec = parse_codec(spec).tensor
    got = back["layers"][0][0]
    if codec == "none":
        assert_bit_exact(x, got)
    else:
        assert bool(((got.double() - x.double()).abs() <= error_bound(x, codec)).all())


# -- lossy specifics --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [65536.0, -70000.0, 1e30, float("inf"), float("-inf")])
def test_fp16_out_of_range_raises(dtype: torch.dtype, value: float) -> None:
    x = torch.zeros(10, dtype=dtype)
    x[3] = value
    for spec in ("fp16", "fp16+lz4"):
        with pytest.raises(CodecError, match="fp16 range"):
            encode_value(x, parse_codec(spec))
    assert torch.isfinite(roundtrip(torch.tensor([65504.0, -65504.0]), "fp16")[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("spec", ["int8", "int4", "int8+lz4", "int4+lz4"])
def test_int_codecs_refuse_non_finite(spec: str, bad: float, dtype: torch.dtype) -> None:
    x = random_tensor(dtype, (4, 100))
    x[2, 77] = bad
    with pytest.raises(CodecError, match="inf or nan"):
        encode_value({"k": x}, parse_codec(spec))


def test_lossless_codecs_keep_non_finite_bits() -> None:
    x = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, -float("inf")])
    for spec in ("none", "lz4"):
        assert_bit_exact(x, roundtrip(x, spec)[0])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("data", ["offset_channel", "tiny", "huge", "constant", "two_values"])
def test_quant_bound_holds_on_awkward_ranges(bits: int, data: str) -> None:
    """Ranges where fp16 scales are too coarse: the half-step bound must still hold."""
    g = torch.Generator().manual_seed(bits)
    x = {
        "offset_channel": torch.randn(32, 128, generator=g) * 0.3 + 50,
        "tiny": torch.randn(32, 128, generator=g) * 1e-6,
        "huge": torch.randn(32, 128, generator=g) * 1e6,
        "constant": torch.full((32, 128), 0.1),
        "two_values": (torch.rand(32, 128, generator=g) > 0.5).float() * 3 - 1,
    }[data]
    back, _, _, _ = roundtrip(x, f"int{bits}")
    err = (back.double() - x.double()).abs()
    bound = error_bound(x, f"int{bits}")
    print(f"int{bits} {data}: max {float(err.max()):.3g} max err/bound {float((err / bound).max()):.4f}")
    assert bool((err <= bound).all())


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    axis=st.sampled_from([-1, -2, 0]),
    scale=st.sampled_from([1e-7, 1e-3, 1.0, 300.0, 1e5]),
    offset=st.sampled_from([0.0, 1.0, -40.0, 3e4]),
    bits=st.sampled_from([8, 4]),
    seed=st.integers(0, 2**16),
)
@example(shape=[1, 3], axis=-2, scale=1e-7, offset=1.0, bits=8, seed=0)  # constant groups: fp16 lo is 2 ulp off
def test_quant_bound_holds_for_any_shape_axis_and_range(
    shape: list[int], axis: int, scale: float, offset: float, bits: int, seed: int
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale + offset
    axis = axis if -x.ndim <= axis < x.ndim else -1
    codec = QuantCodec(bits)
    parts, meta = codec.encode(x.contiguous(), axis)
    back = codec.decode(parts, meta, x.dtype, tuple(x.shape))
    assert back.shape == x.shape and back.dtype == x.dtype
    err = (back.double() - x.double()).abs()
    bound = error_bound(x, f"int{bits}", axis)
    assert bool((err <= bound).all()), float((err / bound).max())


def test_quant_error_scales_with_bits() -> None:
    x = random_tensor(torch.float32, (64, 256), seed=5)
    e8 = (roundtrip(x, "int8")[0] - x).abs()
    e4 = (roundtrip(x, "int4")[0] - x).abs()
    print(
        f"int8 max {float(e8.max()):.4g} mean {float(e8.mean()):.4g}; "
        f"int4 max {float(e4.max()):.4g} mean {float(e4.mean()):.4g}"
    )
    assert float(e4.mean()) > 8 * float(e8.mean())  # 15 levels vs 255: ~17x coarser


# -- KV layout: keys per channel, values per token -------------------------------------------------------------
def kv_with_outlier_channels(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[batch, heads, tokens, head_dim] with a few channels 100x larger, as attention keys have."""
    g = torch.Generator().manual_seed(11)
    t = torch.randn(1, 2, 128, 64, generator=g)
    t[..., ::16] *= 100
    return t.to(dtype)


@pytest.mark.parametrize(
    "name, axis",
    [
        ("k", -2),
        ("key", -2),
        ("keys", -2),
        ("key_states", -2),
        ("key_cache", -2),
        ("K", -2),
        ("v", -1),
        ("value_states", -1),
        ("x", -1),
    ],
)
def test_quant_axis_from_dict_key(name: str, axis: int) -> None:
    t = kv_with_outlier_channels()
    _, header, _, _ = roundtrip({name: t}, "int8")
    assert header["leaves"][0]["meta"]["axis"] == axis


def test_axis_hint_reaches_nested_leaves() -> None:
    t = kv_with_outlier_channels()
    _, header, _, _ = roundtrip({"layers": [{"k": [t, t], "v": t}]}, "int4")
    assert [leaf["meta"]["axis"] for leaf in header["leaves"]] == [-2, -2, -1]


@pytest.mark.parametrize("spec", ["int8", "int4", "int4+lz4"])
def test_keys_per_channel_beat_per_token_on_outlier_channels(spec: str) -> None:
    t = kv_with_outlier_channels()
    back, _, _, _ = roundtrip({"k": t, "v": t}, spec)
    codec = parse_codec(spec).tensor
    assert bool(((back["k"].double() - t.double()).abs() <= error_bound(t, codec, axis=-2)).all())
    assert bool(((back["v"].double() - t.double()).abs() <= error_bound(t, codec, axis=-1)).all())
    normal = torch.ones(64, dtype=torch.bool)
    normal[::16] = False
    err_k = (back["k"] - t)[..., normal].abs().mean()
    err_v = (back["v"] - t)[..., normal].abs().mean()
    print(
        f"{spec}: mean error on normal channels: keys (per channel) {float(err_k):.4g}, "
        f"values (per token) {float(err_v):.4g}"
    )
    assert err_k * 10 < err_v


# -- ratios --------------------------------------------------------------------------------------------------
def kv_bf16() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {
        "k": torch.randn(1, 8, 256, 128, generator=g).to(torch.bfloat16),
        "v": torch.randn(1, 8, 256, 128, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize(
    "spec, at_least",
    [("int4", 3.5), ("int4+lz4", 3.5), ("int8", 1.85), ("int8+lz4", 1.85), ("none", 0.99), ("fp16", 0.99)],
)
def test_ratio_on_bf16_kv(spec: str, at_least: float) -> None:
    kv = kv_bf16()
    _, _, raw, stored = roundtrip(kv, spec)
    assert raw == 2 * 8 * 256 * 128 * 2
    print(f"{spec} on bf16 KV: {raw / stored:.3f}x")
    assert raw / stored >= at_least


def test_shuffle_makes_lz4_worth_it_on_bf16_kv() -> None:
    kv = kv_bf16()
    plain = kv["v"].reshape(-1).view(torch.uint8).numpy()
    unshuffled = plain.size / len(lz4.block.compress(plain.tobytes(), store_size=False))
    _, _, raw, stored = roundtrip(kv, "lz4")
    print(f"lz4 on bf16 KV: without shuffle {unshuffled:.3f}x, kvmem (shuffled) {raw / stored:.3f}x")
    assert unshuffled < 1.05
    assert raw / stored > 1.12


def test_fp16_halves_fp32() -> None:
    x = random_tensor(torch.float32, (8, 256, 128))
    _, _, raw, stored = roundtrip(x, "fp16")
    assert 1.95 < raw / stored <= 2.0


def test_incompressible_bytes_are_stored_raw_under_lz4() -> None:
    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    back, header, raw, stored = roundtrip(data, "lz4")
    assert back == data
    assert "raw" not in header["leaves"][0]["data"]
    assert stored < raw + 1024
    zeros = bytes(100_000)
    back, header, raw, stored = roundtrip(zeros, "lz4")
    assert back == zeros and header["leaves"][0]["data"]["raw"] == raw and stored < raw / 50


def test_memory_reports_compression_ratio(memory) -> None:  # type: ignore[no-untyped-def]
    kv = kv_bf16()
    memory.store("kv", kv, compression="int4")
    ratio = memory.metrics.value("kvmem_compression_ratio")
    info = memory.info("kv")
    assert info is not None and info.codec == "int4"
    assert ratio == pytest.approx(info.size / info.stored_size)
    assert ratio >= 3.5


def test_lz4_refuses_garbage() -> None:
    with pytest.raises(CodecError, match="lz4"):
        Lz4Codec().decompress(np.frombuffer(b"\xff" * 40, dtype=np.uint8), 1000, 2)


@pytest.mark.parametrize("codec", ["none", "int8", "int4+lz4", "fp16+lz4"])
def test_reframe_moves_a_blob_between_formats_without_touching_its_encoded_bytes(codec: str) -> None:
    g = torch.Generator().manual_seed(3)
    value = {
        "k": torch.randn(2, 8, 256, 64, generator=g),
        "v": torch.randn(2, 8, 256, 64, generator=g).bfloat16(),
        "empty": torch.empty(0),
        "raw": b"xyz",
        "n": np.arange(5),
        "note": "hi",
    }
    old = encode_value(value, parse_codec(codec), blob_format=1)[0].to_tensor()
    new = reframe(old, 2).to_tensor()
    assert blob.format_of(old) == (1, 64) and blob.format_of(new) == (2, blob.PAGE)
    blob.verify(new)
    # the same blob a format-2 writer makes, and back to the byte: quantized parts were copied, not requantized
    assert torch.equal(new, encode_value(value, parse_codec(codec), blob_format=2)[0].to_tensor())
    assert torch.equal(reframe(new, 1).to_tensor(), old)
    a, b = decode_value(old)[0], decode_value(new)[0]
    assert all(torch.equal(a[k], b[k]) for k in ("k", "v", "empty")) and np.array_equal(a["n"], b["n"])
    assert (a["raw"], a["note"]) == (b["raw"], b["note"])
    small = encode_value({"x": 1}, parse_codec(codec), blob_format=2)[0].to_tensor()
    assert blob.format_of(small) == (2, 64) and np.shares_memory(reframe(small, 2).parts[0], small.numpy())  # as is


@pytest.mark.parametrize(
    ("spec", "make"),
    [
        ("none", lambda: torch.randn(4, 8).to(torch.bfloat16)),
        ("bf16", lambda: torch.randn(4, 8).to(torch.bfloat16)),
        ("fp16", lambda: torch.randn(3, 5).to(torch.float16)),
        ("none", lambda: torch.arange(12, dtype=torch.int64).reshape(3, 4)),
        ("none", lambda: torch.randn(2, 4, 16, 8)[:, :, 4:12]),  # a KV-cache slice: not contiguous
        ("none", lambda: torch.randn(5, requires_grad=True)),
        ("none", lambda: torch.tensor(3.5)),
    ],
)
def test_a_tensor_stored_as_is_gets_the_header_of_the_general_path(spec: str, make: object) -> None:
    # the header of such a tensor is rendered once per shape and reused: it must say what the general path says
    t = make()  # type: ignore[operator]
    info = {"namespace": "ns", "key": 'k"\u00e9', "storage_key": "ab" * 32}
    fast, raw = encode_value(t, parse_codec(spec), {"m": [1, 2]}, info=info)
    again, _ = encode_value(t.detach().clone(), parse_codec(spec), None, info=info)  # the cached rendering
    general, raw_general = _encode_tree(t, parse_codec(spec), {"m": [1, 2]}, info, blob.FORMAT_VERSION)
    buf = fast.to_tensor()
    assert blob.parse(buf)[0] == blob.parse(general.to_tensor())[0] and raw == raw_general
    assert blob.parse(again.to_tensor())[0]["metadata"] == {}
    value, header = decode_value(buf)
    assert header["info"] == info and torch.equal(value, t.detach())
    # it also says where its tensor lies, as the header does (a tier copies it in and out by that)
    (_h, start), part = blob.verify(buf), header["leaves"][0]["parts"]["data"]
    assert fast.plain == (t.dtype, tuple(t.shape), part["off"], part["n"]) and general.plain is None
    lo = start + fast.plain.offset
    assert torch.equal(buf[lo : lo + fast.plain.nbytes], t.detach().contiguous().reshape(-1).view(torch.uint8))


def test_a_tensor_its_codec_changes_takes_the_general_path() -> None:
    t = torch.randn(4, 8)  # fp32 under bf16: cast, so its bytes are not the tensor's
    encoded, _ = encode_value(t, parse_codec("bf16"))
    value, header = decode_value(encoded.to_tensor())
    assert header["leaves"][0]["parts"]["data"]["dtype"] == "bfloat16" and value.dtype == torch.float32
