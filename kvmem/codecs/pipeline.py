"""Old import path of :mod:`kvmem.codecs.serialization`, kept for one release; it goes in the next one.

Import from ``kvmem.codecs.serialization`` instead.
"""

from kvmem.codecs.serialization import (
    check_owner,
    decode_tensor_range,
    decode_value,
    encode_value,
    tensor_parts_range,
    value_kind,
)

__all__ = ["check_owner", "decode_tensor_range", "decode_value", "encode_value", "tensor_parts_range", "value_kind"]
