"""Linux libc calls Python does not offer, through ctypes (which releases the GIL for each call)."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["libc_function"]


def libc_function(name: str, *argtypes: Any) -> Any | None:
    """libc's ``name`` returning an ``int``, with these argument types; ``None`` off Linux or where libc lacks it."""
    if sys.platform != "linux":
        return None
    try:
        call = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    call.argtypes = argtypes
    call.restype = ctypes.c_int
    return call
