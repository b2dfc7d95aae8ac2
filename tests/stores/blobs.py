"""Blobs for the tier tests: a payload framed as a one-segment kvmem blob."""

from __future__ import annotations

import numpy as np

from kvmem import blob as blobfmt


def blob_of(payload: bytes, kind: str = "test") -> blobfmt.EncodedBlob:
    """``payload`` as the one segment of a blob whose header names ``kind``."""
    return blobfmt.encode({"kind": kind}, [np.frombuffer(payload, dtype=np.uint8)])
