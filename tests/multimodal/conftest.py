"""A tiny open_clip ViT (image 64, 3 blocks, width 64) registered once, offline."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = "kvmem-tiny-vit"
TINY_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": 3, "width": 64, "patch_size": 16, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="session", autouse=True)
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    import open_clip

    path = tmp_path_factory.mktemp("open_clip") / f"{TINY}.json"
    path.write_text(json.dumps(TINY_CONFIG))
    open_clip.add_model_config(path)
    return TINY


def picture(i: int, size: tuple[int, int] = (80, 60)) -> Image.Image:
    """A distinct RGB picture per ``i``: a gradient with a colored square."""
    img = Image.linear_gradient("L").resize(size).convert("RGB")
    img.paste((37 * i % 256, 90 + 29 * i % 160, 200 - 23 * i % 180), (5 + i, 5, 30 + i, 30))
    return img


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def images() -> list[Image.Image]:
    return [picture(i) for i in range(4)]


@pytest.fixture
def image_file(tmp_path: Path) -> Path:
    path = tmp_path / "photo.png"
    path.write_bytes(png(picture(9)))
    return path
