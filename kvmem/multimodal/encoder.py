"""Image encoders: the ``ImageEncoder`` protocol and its open_clip implementation.

An encoder's :attr:`~ImageEncoder.identity` names everything that changes its
output; the visual-token cache hashes it into the namespace of its entries, so
two encoders never share one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image

from kvmem.errors import ConfigError, UnsupportedModelError
from kvmem.kv.fingerprint import model_fingerprint

__all__ = ["FEATURES", "ImageEncoder", "OpenClipEncoder"]

FEATURES = ("patch", "cls_patch")
PRECISIONS = ("fp32", "fp16", "bf16")
# the names open_clip saves and the hub repos use, tried in this order inside a directory
_WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin", "model.safetensors", "pytorch_model.bin")


class ImageEncoder(Protocol):
    """What :class:`~kvmem.multimodal.VisualTokenCache` needs of an image encoder."""

    identity: Mapping[str, Any]  # JSON-able: backend, model, weights, precision, preprocessing, layer, feature

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """One RGB image -> its ``[3, H, W]`` input tensor."""
        ...

    def tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` -> visual tokens ``[B, T, D]``."""
        ...

    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` -> pooled image embeddings ``[B, E]``."""
        ...


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _cached_tag_file(cfg: Mapping[str, Any]) -> Path | None:
    """The local copy of a pretrained tag's weights (HF hub cache or open_clip's URL cache), if any."""
    hub = cfg.get("hf_hub", "")
    if hub:
        from huggingface_hub import try_to_load_from_cache

        repo, filename = os.path.split(hub)  # "org/model/" names no file: open_clip's defaults
        for name in (filename,) if filename else _WEIGHT_FILES[:2]:
            found = try_to_load_from_cache(repo, name)
            if isinstance(found, str):
                return Path(found)
    url = cfg.get("url", "")
    if url:
        local = Path(os.path.expanduser("~/.cache/clip")) / os.path.basename(url)
        if local.is_file():
            return local
    return None


def _resolve(
    model_name: str, pretrained: str | os.PathLike[str] | None, seed: int
) -> tuple[Path | None, str, Mapping[str, Any]]:
    """(weights file or None, the weights' identity, the tag's pretrained config) for ``pretrained``.

    Never touches the network: a tag resolves only to a copy already in a local cache.
    """
    import open_clip

    if pretrained is None:
        return None, f"random:seed={seed}", {}
    path = Path(pretrained)
    if path.is_dir():
        found = next((path / n for n in _WEIGHT_FILES if (path / n).is_file()), None)
        if found is None:
            raise ConfigError(
                f"pretrained={os.fspath(pretrained)!r}: a directory without weights; accepted: a "
                f"directory holding one of {', '.join(_WEIGHT_FILES)}"
            )
        path = found
    if path.is_file():
        return path, f"file:sha256={_file_digest(path)}", {}
    tag = str(pretrained)
    cfg = open_clip.get_pretrained_cfg(model_name, tag)
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(model_name)
        raise ConfigError(
            f"pretrained={tag!r}: not a local file or directory, nor a tag of {model_name} "
            f"(its tags: {', '.join(tags) or 'none'}); or pass pretrained=None for random weights"
        )
    local = _cached_tag_file(cfg)
    if local is None:
        raise ConfigError(
            f"pretrained={tag!r}: the weights of {model_name}/{tag} are in no local cache (HF hub "
            "cache, ~/.cache/clip) and kvmem never downloads; pass a local .safetensors/.bin file "
            "or directory, or download them once beforehand"
        )
    return local, f"tag:{tag}", cfg


class OpenClipEncoder:
    """An open_clip vision tower: patch tokens of one block (as LLaVA takes them) and the pooled embedding.

    Args:
        model_name: an open_clip model name (``ViT-B-16``, ``ViT-L-14-336``, or one added with
            ``open_clip.add_model_config``); only ViT towers.
        pretrained: a pretrained tag whose weights are in a local cache, a local ``.safetensors``/``.bin``
            file, a local directory holding one, or None for random weights drawn with ``seed``.
        layer: block whose output is taken; negative counts from the end (-2: the penultimate).
        feature: ``patch`` (CLS dropped, as LLaVA) or ``cls_patch`` (CLS first).
        precision: ``fp32``, ``fp16`` or ``bf16``.
        device: where the tower runs.
        seed: seed of the random weights when ``pretrained`` is None.

    Raises:
        ConfigError: a bad argument, or weights that are not available locally.
        UnsupportedModelError: the model's vision tower is not a ViT.
    """

    def __init__(
        self,
        model_name: str,
        pretrained: str | os.PathLike[str] | None = None,
        *,
        layer: int = -2,
        feature: str = "patch",
        precision: str = "fp32",
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        import open_clip
        from open_clip.transformer import VisionTransformer

        if feature not in FEATURES:
            raise ConfigError(f"feature={feature!r}: accepted {' | '.join(FEATURES)}")
        if precision not in PRECISIONS:
            raise ConfigError(f"precision={precision!r}: accepted {' | '.join(PRECISIONS)}")
        model_cfg = open_clip.get_model_config(model_name)
        if model_cfg is None:
            raise ConfigError(
                f"model_name={model_name!r}: not an open_clip model config; accepted e.g. "
                f"{', '.join(open_clip.list_models()[:6])}, ... (open_clip.list_models())"
            )
        weights, weights_id, tag_cfg = _resolve(model_name, pretrained, seed)
        options: dict[str, Any] = {"force_quick_gelu": bool(tag_cfg.get("quick_gelu", False))}
        for ours, theirs in (
            ("image_mean", "mean"),
            ("image_std", "std"),
            ("image_interpolation", "interpolation"),
            ("image_resize_mode", "resize_mode"),
        ):
            if theirs in tag_cfg:  # what open_clip applies for a tag, applied to its local file
                options[ours] = tag_cfg[theirs]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, _, self._transform = open_clip.create_model_and_transforms(
                model_name, pretrained=str(weights) if weights else None, precision=precision, device=device, **options
            )
        model.eval()
        if not isinstance(model.visual, VisionTransformer):
            raise UnsupportedModelError(
                f"model_name={model_name!r}: its vision tower is {type(model.visual).__name__}; accepted: ViT towers"
            )
        self.model, self.device = model, torch.device(device)
        self.dtype = next(model.visual.parameters()).dtype
        blocks = len(model.visual.transformer.resblocks)
        if not -blocks <= layer < blocks:
            raise ConfigError(f"layer={layer}: {model_name} has {blocks} blocks; accepted {-blocks}..{blocks - 1}")
        self.layer, self.feature = layer % blocks, feature
        self.identity: Mapping[str, Any] = {
            "backend": f"open_clip {open_clip.__version__}",
            "model": model_name,
            "model_config": model_cfg,
            "weights": weights_id,
            "fingerprint": model_fingerprint(model.visual),
            "precision": precision,
            "preprocess": open_clip.get_model_preprocess_cfg(model),
            "layer": self.layer,
            "feature": feature,
        }

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """See :meth:`ImageEncoder.preprocess` (the model's own validation transform)."""
        return self._transform(image)

    @torch.inference_mode()
    def tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """See :meth:`ImageEncoder.tokens`: block ``layer``'s output, ``[B, patches (+1), width]``."""
        out = self.model.visual.forward_intermediates(
            pixels.to(self.device, self.dtype),
            indices=[self.layer],
            stop_early=True,
            intermediates_only=True,
            output_fmt="NLC",
            output_extra_tokens=self.feature == "cls_patch",
        )
        patch = out["image_intermediates"][0]
        if self.feature == "cls_patch":
            return torch.cat([out["image_intermediates_prefix"][0], patch], dim=1)
        return patch

    @torch.inference_mode()
    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        """See :meth:`ImageEncoder.pooled`: ``encode_image``, not normalized."""
        return self.model.encode_image(pixels.to(self.device, self.dtype))
