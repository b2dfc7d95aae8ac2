"""Codec registry and the codec-spec parser (``"int4+lz4"``).

A spec is a tensor codec (``none``, ``fp16``, ``bf16``, ``int8``, ``int4``), optionally
followed by ``+lz4``; ``"lz4"`` alone means ``"none+lz4"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmem.codecs.base import ByteCodec, TensorCodec
from kvmem.codecs.cast import CastCodec, NoneCodec
from kvmem.codecs.lz4 import Lz4Codec
from kvmem.codecs.quant import QuantCodec
from kvmem.errors import CodecError, ConfigError

__all__ = ["CodecSpec", "parse_codec", "tensor_codec", "register_tensor_codec", "TensorCodec", "ByteCodec", "LZ4"]

_TENSOR_CODECS: dict[str, TensorCodec] = {
    "none": NoneCodec(),
    "fp16": CastCodec("fp16", torch.float16),
    "bf16": CastCodec("bf16", torch.bfloat16),
    "int8": QuantCodec(8),
    "int4": QuantCodec(4, group=128),  # 128 keeps int4 >= 3.5x smaller than bf16 with its scales
}
LZ4: ByteCodec = Lz4Codec()


def register_tensor_codec(codec: TensorCodec) -> None:
    """Make ``codec`` available by its ``name`` in codec specs."""
    _TENSOR_CODECS[codec.name] = codec


def tensor_codec(name: str) -> TensorCodec:
    """The registered tensor codec called ``name``."""
    try:
        return _TENSOR_CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}: accepted {', '.join(_TENSOR_CODECS)}") from None


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec: one tensor codec, and whether lz4 runs on top."""

    tensor: str
    lz4: bool

    def __str__(self) -> str:
        return f"{self.tensor}+lz4" if self.lz4 else self.tensor

    @property
    def lossless(self) -> bool:
        return tensor_codec(self.tensor).lossless


_LOSSLESS = CodecSpec("none", False)


def parse_codec(spec: str | None, field_name: str = "codec") -> CodecSpec:
    """Parse ``"int8+lz4"``, ``"fp16"``, ``"lz4"``, ``None`` (= ``"none"``).

    Raises:
        CodecError: (a :class:`ConfigError` when ``field_name`` is a config field)
            naming the spec and the accepted forms.
    """
    if spec is None:
        return _LOSSLESS
    err = ConfigError if field_name == "compression" else CodecError
    if not isinstance(spec, str):
        raise err(f"{field_name}={spec!r}: expected a string such as 'int8+lz4'")
    parts = [p.strip().lower() for p in spec.split("+")]
    use_lz4 = "lz4" in parts
    rest = [p for p in parts if p != "lz4"]
    if len(rest) > 1 or parts.count("lz4") > 1 or (rest and rest[0] not in _TENSOR_CODECS):
        raise err(
            f"{field_name}={spec!r}: accepted one of {', '.join(_TENSOR_CODECS)}, "
            "optionally with '+lz4' (e.g. 'int4+lz4'), or 'lz4' alone"
        )
    return CodecSpec(rest[0] if rest else "none", use_lz4)
