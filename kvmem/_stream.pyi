"""Streaming copies of large host buffers (the C module kvmem/_stream.c)."""

from collections.abc import Sequence

STREAMING: int
"""1 where the copies use streaming stores (x86-64), 0 where they are memcpy."""

def copy(pairs: Sequence[tuple[int, int, int]], /) -> None:
    """Copy each ``(dst_address, src_address, nbytes)`` (non-overlapping host memory), without the GIL."""
