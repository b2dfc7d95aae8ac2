"""``LlavaImageEncoder``: a transformers LLaVA model's own vision tower as an :class:`ImageEncoder`.

Its tokens are exactly what ``LlavaModel.get_image_features`` feeds the
multimodal projector (transformers 5.24): the vision tower's hidden state at
``config.vision_feature_layer`` (or those states concatenated, for a list of
layers), CLS dropped under the ``default`` select strategy and kept under
``full``. The projector is *not* applied: it belongs to the language side, so
one cache of visual tokens serves every LLaVA checkpoint sharing this vision
tower and preprocessing, and the caller projects (``model.multi_modal_projector``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from PIL import Image
from transformers import BaseImageProcessor, CLIPImageProcessor, PreTrainedModel
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from kvmem.errors import UnsupportedModelError
from kvmem.kv.fingerprint import model_fingerprint

__all__ = ["LlavaImageEncoder", "clip_image_processor"]

STRATEGIES = ("default", "full")


def clip_image_processor(image_size: int) -> CLIPImageProcessor:
    """The LLaVA-1.5 preprocessing for ``image_size`` pixels: shortest edge resized, center crop, CLIP mean/std."""
    return CLIPImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD,
    )


def _llava_parts(model: PreTrainedModel) -> tuple[torch.nn.Module, Any]:
    """``(vision tower, config)`` of a ``LlavaForConditionalGeneration`` or a ``LlavaModel``."""
    inner = model.model if hasattr(model, "model") and hasattr(model.model, "vision_tower") else model
    tower = getattr(inner, "vision_tower", None)
    config = model.config
    if tower is None or not hasattr(config, "vision_feature_layer"):
        raise UnsupportedModelError(
            f"{type(model).__name__}: not a LLaVA model (no vision_tower or "
            "vision_feature_layer); accepted: LlavaForConditionalGeneration, LlavaModel"
        )
    if config.vision_feature_select_strategy not in STRATEGIES:
        raise UnsupportedModelError(
            f"vision_feature_select_strategy={config.vision_feature_select_strategy!r}: "
            f"accepted {' | '.join(STRATEGIES)}"
        )
    return tower, config


class LlavaImageEncoder:
    """The visual tokens a LLaVA model feeds its projector, and its vision tower's pooled output.

    Args:
        model: a ``LlavaForConditionalGeneration`` (or ``LlavaModel``); only its vision tower runs.
        image_processor: the checkpoint's image processor (``AutoImageProcessor.from_pretrained``);
            default :func:`clip_image_processor` of the vision config's ``image_size``.

    Attributes:
        num_tokens: visual tokens per image (the image placeholders a prompt needs), for
            a ViT tower: ``(image_size // patch_size) ** 2``, plus CLS under ``full``.

    Raises:
        UnsupportedModelError: not a LLaVA model, or an unknown select strategy.
    """

    def __init__(self, model: PreTrainedModel, image_processor: BaseImageProcessor | None = None) -> None:
        self.vision_tower, config = _llava_parts(model)
        vision = config.vision_config
        self.layer: int | list[int] = config.vision_feature_layer
        self.strategy: str = config.vision_feature_select_strategy
        self.processor = image_processor if image_processor is not None else clip_image_processor(vision.image_size)
        param = next(self.vision_tower.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_tokens = (vision.image_size // vision.patch_size) ** 2 + (self.strategy == "full")
        processor = type(self.processor)
        self.identity: Mapping[str, Any] = {
            "backend": "transformers-llava",
            "transformers": transformers.__version__,
            "vision_model": type(self.vision_tower).__name__,
            "fingerprint": model_fingerprint(self.vision_tower),
            "dtype": str(self.dtype).removeprefix("torch."),
            "layer": self.layer,
            "strategy": self.strategy,
            "processor": {
                "class": [c.__name__ for c in processor.__mro__ if c is not object],
                "config": json.loads(self.processor.to_json_string()),
            },
        }

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """See :meth:`ImageEncoder.preprocess`: the image processor's ``pixel_values``, ``[3, H, W]``."""
        return self.processor(images=image.convert("RGB"), return_tensors="pt")["pixel_values"][0]

    @torch.no_grad()
    def tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """See :meth:`ImageEncoder.tokens`: ``[B, T, D * feature layers]``, as ``get_image_features`` selects."""
        out = self.vision_tower(pixels.to(self.device, self.dtype), output_hidden_states=True, return_dict=True)
        layers = [self.layer] if isinstance(self.layer, int) else list(self.layer)
        states = [out.hidden_states[i] for i in layers]
        if self.strategy == "default":
            states = [s[:, 1:] for s in states]  # "default" drops CLS, "full" keeps it (LlavaModel's rule)
        return torch.cat(states, dim=-1)

    @torch.no_grad()
    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        """See :meth:`ImageEncoder.pooled`: the vision tower's ``pooler_output``, ``[B, D]``."""
        return self.vision_tower(pixels.to(self.device, self.dtype), return_dict=True).pooler_output
