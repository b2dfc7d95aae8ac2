"""``VisualTokenCache``: an image encoder's outputs, stored by image content hash.

A CLIP-style vision tower costs hundreds of milliseconds per image on a CPU;
its output for an image never changes. Entries live in a
:class:`~kvmem.Memory` under the image's hash (:func:`image_digest`), in a
namespace hashed from the encoder's identity, the storage dtype and the format
version, so two encoders (or layers, features, dtypes) never share one. A
batch loads its hits and runs only its misses through the encoder, in one
forward pass; a corrupt entry fails its CRC, counts as a miss and is encoded
again. Pooled embeddings are cached the same way and indexed for
:meth:`VisualTokenCache.similar`.

A miss's tokens are stored behind the caller, on a thread of their own (a
store is a copy, a CRC and a file write: not the request's work), once no
request is in flight on the memory (at most 50 ms later): a request that
encodes an image and then prefills a prompt counts itself as one with
``with memory.activity:``, and its store runs after its first token, not beside
its forward pass. Until then this cache serves them from its queue (another
cache over the same memory sees them once stored), and ``flush``, ``close`` and
the memory's ``flush`` and ``close`` store them at once and wait for them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvmem.errors import UnsupportedValueError
from kvmem.kv.background import WriteBehind
from kvmem.multimodal.encoder import ImageEncoder, OpenClipEncoder
from kvmem.multimodal.images import ImageInput, decode_image, image_digest

if TYPE_CHECKING:
    import os

    from kvmem.api import Memory
    from kvmem.semantic import SemanticIndex

__all__ = ["ImageMatch", "VisualTokenCache"]

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ImageMatch:
    """A stored image whose pooled embedding is near the query's: its content hash and cosine score."""

    digest: str
    score: float


@dataclass(frozen=True)
class _PooledSpace:
    """The "embedder" of an image index: vectors come from the encoder, never from text."""

    name: str
    dim: int
    threshold: float

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        raise UnsupportedValueError("an image index embeds no text; accepted: VisualTokenCache.similar(image)")


def _namespace(kind: str, identity: dict[str, object]) -> str:
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return f"visual/{kind}/{hashlib.sha256(blob).hexdigest()[:32]}"


class VisualTokenCache:
    """Visual tokens and pooled embeddings of images, cached by image content hash.

    Args:
        model_name: open_clip model (see :class:`OpenClipEncoder`).
        pretrained: tag with locally cached weights, local file or directory, or None (random, ``seed``).
        layer: block whose tokens are taken (-2: LLaVA's penultimate), stored as an absolute index.
        feature: ``patch`` or ``cls_patch``.
        memory: where entries live (default: the module's default memory).
        dtype: storage dtype of tokens (None: as the encoder computes them, lossless).
        precision: as in :class:`OpenClipEncoder`.
        device: as in :class:`OpenClipEncoder`.
        seed: as in :class:`OpenClipEncoder`.
        similar_threshold: cosine floor of :meth:`similar` (not calibrated: near-duplicates of
            one photo score above 0.9 with real CLIP weights).
    """

    def __init__(
        self,
        model_name: str = "ViT-B-16",
        pretrained: str | os.PathLike[str] | None = None,
        *,
        layer: int = -2,
        feature: str = "patch",
        memory: Memory | None = None,
        dtype: torch.dtype | None = None,
        precision: str = "fp32",
        device: str | torch.device = "cpu",
        seed: int = 0,
        similar_threshold: float = 0.9,
    ) -> None:
        encoder = OpenClipEncoder(
            model_name, pretrained, layer=layer, feature=feature, precision=precision, device=device, seed=seed
        )
        self._setup(encoder, memory, dtype, similar_threshold)

    @classmethod
    def from_encoder(
        cls,
        encoder: ImageEncoder,
        *,
        memory: Memory | None = None,
        dtype: torch.dtype | None = None,
        similar_threshold: float = 0.9,
    ) -> VisualTokenCache:
        """A cache over any :class:`ImageEncoder` (e.g. a LLaVA model's own vision tower)."""
        cache = cls.__new__(cls)
        cache._setup(encoder, memory, dtype, similar_threshold)
        return cache

    def _setup(
        self, encoder: ImageEncoder, memory: Memory | None, dtype: torch.dtype | None, similar_threshold: float
    ) -> None:
        from kvmem.api import default_memory

        self.encoder = encoder
        self.memory = memory if memory is not None else default_memory()
        self.dtype = dtype
        self.similar_threshold = similar_threshold
        identity = {**encoder.identity, "dtype": str(dtype), "format": FORMAT_VERSION}
        self.namespace = _namespace("tokens", identity)
        pooled_identity = {k: v for k, v in identity.items() if k not in ("layer", "feature", "dtype")}
        self.pooled_namespace = _namespace("pooled", pooled_identity)
        self.hits = 0  # images served from the cache, by encode() and embed()
        self.misses = 0  # images run through the encoder
        self._lock = threading.Lock()
        self._index: SemanticIndex | None = None
        self._queued: dict[tuple[str, str], torch.Tensor] = {}  # (namespace, digest) -> tokens not stored yet
        self._writer = WriteBehind(activity=self.memory.activity)
        self.memory.add_writer(self._writer)

    # -- public API -----------------------------------------------------------------------
    @staticmethod
    def digest(image: ImageInput) -> str:
        """The content hash entries of ``image`` are stored under (see :mod:`kvmem.multimodal.images`)."""
        return image_digest(image)

    def encode(self, images: Sequence[ImageInput], *, digests: Sequence[str] | None = None) -> torch.Tensor:
        """Visual tokens ``[B, T, D]`` of ``images``, in input order; only misses are encoded (one batch).

        Args:
            digests: each image's :meth:`digest`, when the caller has them already (e.g. for a prefix
                scope): not computed again. NOTE: not checked: entries are stored and found under them.

        Raises:
            UnsupportedValueError: an input that is not an image, an empty list, or ``digests`` not one
                per image.
        """
        return self._cached(images, self.namespace, self.encoder.tokens, self.dtype, digests=digests)

    def embed(self, images: Sequence[ImageInput]) -> torch.Tensor:
        """Pooled embeddings ``[B, E]`` (not normalized), cached and indexed for :meth:`similar`."""
        return self._cached(images, self.pooled_namespace, self.encoder.pooled, None, index=True)

    def similar(self, image: ImageInput, k: int = 5, threshold: float | None = None) -> list[ImageMatch]:
        """Stored images (given to :meth:`embed` before) nearest to ``image``, best first, itself excluded.

        Only images embedded by this encoder are searched: its identity is the partition.
        """
        digest = image_digest(image)
        vec = torch.nn.functional.normalize(self.embed([image]).float(), dim=-1)[0].numpy()
        self.flush()  # NOTE: every image embedded so far is in the index
        found = self._semantic(len(vec)).search_vector(vec, self.pooled_namespace, k + 1, threshold)
        return [ImageMatch(text, score) for _, score, text in found if text != digest][:k]

    def flush(self) -> None:
        """Wait until the tokens of every miss so far are stored."""
        self._writer.flush()

    def close(self) -> None:
        """Store what is queued and stop the writer's thread."""
        self._writer.close()

    def __enter__(self) -> VisualTokenCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------
    def _semantic(self, dim: int) -> SemanticIndex:
        """The index of this encoder's pooled embeddings (``dim`` wide), read back on first use."""
        with self._lock:
            if self._index is None:
                space = _PooledSpace(self.pooled_namespace, dim, self.similar_threshold)
                self._index = self.memory.semantic_index(space)
            return self._index

    def _cached(
        self,
        images: Sequence[ImageInput],
        namespace: str,
        run: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype | None,
        index: bool = False,
        digests: Sequence[str] | None = None,
    ) -> torch.Tensor:
        images = list(images)
        if not images:
            raise UnsupportedValueError("images: an empty list; accepted: one or more images")
        if digests is None:
            digests = [image_digest(image) for image in images]
        elif len(digests) != len(images):
            raise UnsupportedValueError(
                f"digests: {len(digests)} for {len(images)} images; accepted: one per image (VisualTokenCache.digest)"
            )
        first = dict(zip(reversed(digests), reversed(images)))  # digest -> its first image
        found: dict[str, torch.Tensor] = {}
        for digest in first:
            with self._lock:
                queued = self._queued.get((namespace, digest))
            if queued is not None:  # NOTE: a copy: the queued tensor is the writer's until it is stored
                found[digest] = queued.clone()
                continue
            value = self.memory.load(digest, namespace=namespace, default=None)
            if isinstance(value, torch.Tensor):  # None on a miss or a corrupt entry (CRC): encoded again
                found[digest] = value
        misses = [d for d in first if d not in found]
        if misses:
            pixels = torch.stack([self.encoder.preprocess(decode_image(first[d])) for d in misses])
            out = run(pixels).to("cpu")
            if dtype is not None:
                out = out.to(dtype)
            for digest, row in zip(misses, out):
                found[digest] = row.clone()  # NOTE: the caller's copy: the encoder's row is the writer's alone
                with self._lock:
                    self._queued[(namespace, digest)] = row
                self._writer.submit(partial(self._store, namespace, digest, row, index))
        with self._lock:
            self.hits += len(images) - len(misses)
            self.misses += len(misses)
        if len(digests) == 1:  # a loaded, copied or fresh value is already the caller's own: no second copy
            return found[digests[0]].unsqueeze(0)
        return torch.stack([found[d] for d in digests])

    def _store(self, namespace: str, digest: str, value: torch.Tensor, index: bool) -> None:
        """Store one miss's tokens (on the writer's thread), index a pooled embedding, and unqueue it."""
        try:
            skey = self.memory.store(digest, value, namespace=namespace)
            if index:
                vec = torch.nn.functional.normalize(value.float(), dim=-1).numpy()
                self._semantic(len(vec)).add_vector(skey, vec, namespace, digest)
        finally:
            with self._lock:
                self._queued.pop((namespace, digest), None)
