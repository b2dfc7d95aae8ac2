"""Multimodal: image-encoder outputs cached by image content hash.

``VisualTokenCache`` keeps a CLIP vision tower's patch tokens (what LLaVA-style
models feed their projector) and pooled embeddings; see :mod:`kvmem.multimodal.visual`.
Needs the ``clip`` extra (open-clip-torch, pillow).
"""

from kvmem.multimodal.encoder import ImageEncoder, OpenClipEncoder
from kvmem.multimodal.images import ImageInput, decode_image, image_digest
from kvmem.multimodal.visual import ImageMatch, VisualTokenCache

__all__ = [
    "ImageEncoder",
    "ImageInput",
    "ImageMatch",
    "OpenClipEncoder",
    "VisualTokenCache",
    "decode_image",
    "image_digest",
]
