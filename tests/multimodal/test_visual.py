"""VisualTokenCache on open_clip: keys, hits and misses, LLaVA-style extraction, offline weights, similar images."""

from __future__ import annotations

import io
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from kvmem import Memory
from kvmem.errors import ConfigError, UnsupportedValueError
from kvmem.kv.background import WriteBehind
from kvmem.multimodal import VisualTokenCache, decode_image, image_digest
from kvmem.multimodal import visual as visual_module
from tests.multimodal.conftest import TINY, picture, png
from tests.test_api import corrupt_every_copy


def tiny(mem: Memory, **options: object) -> VisualTokenCache:
    return VisualTokenCache(TINY, memory=mem, **options)  # type: ignore[arg-type]


class BatchLog:
    """Records the batch size of every call to an encoder's ``tokens`` (which still runs for real)."""

    def __init__(self, vc: VisualTokenCache) -> None:
        self.sizes: list[int] = []
        real = vc.encoder.tokens

        def tokens(pixels: torch.Tensor) -> torch.Tensor:
            self.sizes.append(pixels.shape[0])
            return real(pixels)

        vc.encoder.tokens = tokens  # type: ignore[method-assign]


def test_mixed_batch_encodes_only_misses_in_one_batch_and_keeps_order(memory: Memory, images: list) -> None:
    vc = tiny(memory)
    log = BatchLog(vc)
    first = vc.encode(images[:2])
    assert first.shape == (2, 16, 64) and log.sizes == [2] and (vc.hits, vc.misses) == (0, 2)
    mixed = vc.encode([images[3], images[1], images[2], images[0], images[3]])
    assert log.sizes == [2, 2]  # images 3 and 2, once each, in one forward
    assert (vc.hits, vc.misses) == (3, 4)
    assert torch.equal(mixed[1], first[1]) and torch.equal(mixed[3], first[0]) and torch.equal(mixed[0], mixed[4])
    again = vc.encode(images)
    assert log.sizes == [2, 2] and torch.equal(again, mixed[[3, 1, 2, 0]])


def test_png_bytes_path_and_decoded_image(memory: Memory, image_file: Path) -> None:
    """Bytes and their file share one key; the decoded image gets its own key (pixels hashed), same tokens."""
    vc = tiny(memory)
    raw = image_file.read_bytes()
    decoded = Image.open(io.BytesIO(raw))
    assert vc.digest(raw) == vc.digest(image_file) == vc.digest(str(image_file)) != vc.digest(decoded)
    by_bytes = vc.encode([raw])
    assert vc.misses == 1
    by_path = vc.encode([image_file])
    assert vc.hits == 1 and torch.equal(by_path, by_bytes)
    by_pixels = vc.encode([decoded])
    assert vc.misses == 2 and torch.equal(by_pixels, by_bytes)  # another entry, equal tokens
    assert image_digest(decoded.convert("P")) != image_digest(decoded)  # mode is part of the pixel hash


def test_exif_orientation_is_applied_to_encoded_bytes() -> None:
    img = picture(1, (80, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif)
    assert decode_image(buf.getvalue()).size == (40, 80)
    assert decode_image(img).size == (80, 40)  # a decoded image is taken as given


def test_tokens_are_the_penultimate_block_like_llava(memory: Memory, images: list) -> None:
    vc = tiny(memory)
    visual = vc.encoder.model.visual
    pixels = torch.stack([vc.encoder.preprocess(img) for img in images[:2]])
    with torch.no_grad():
        x = visual._embeds(pixels)
        for block in visual.transformer.resblocks[:2]:  # blocks 0 and 1 of 3: layer -2 is block 1
            x = block(x)
    assert vc.encoder.identity["layer"] == 1
    assert torch.equal(vc.encode(images[:2]), x[:, 1:])  # CLS dropped
    with_cls = tiny(memory, feature="cls_patch").encode(images[:2])
    assert with_cls.shape == (2, 17, 64) and torch.equal(with_cls, x)


def test_encoders_layers_features_and_dtypes_never_share(memory: Memory, images: list) -> None:
    caches = [
        tiny(memory),
        tiny(memory, layer=1),
        tiny(memory, layer=-1),
        tiny(memory, feature="cls_patch"),
        tiny(memory, dtype=torch.float16),
        tiny(memory, seed=1),
        VisualTokenCache("ViT-B-32", memory=memory),
    ]
    assert caches[0].namespace == caches[1].namespace  # -2 and 1 are the same block of 3
    namespaces = {vc.namespace for vc in caches[1:]}
    assert len(namespaces) == len(caches) - 1
    outs = []
    for vc in caches:
        outs.append(vc.encode(images[:1]))
        vc.flush()  # NOTE: stored behind the call; another cache over the memory sees what is stored
    assert all(vc.misses == 1 and vc.hits == 0 for vc in caches[2:])
    assert (caches[1].hits, caches[1].misses) == (1, 0)  # the entry caches[0] stored
    assert outs[4].dtype == torch.float16 and torch.equal(outs[4], outs[0].half())
    assert not torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[5])
    assert outs[6].shape == (1, 49, 768)


def test_a_corrupt_entry_is_encoded_again(tmp_path: Path, images: list) -> None:
    with Memory(tmp_path / "kvmem", fsync="never", cpu_verify=True) as mem:
        vc = tiny(mem)
        want = vc.encode(images[:2])
        vc.flush()
        assert corrupt_every_copy(mem, vc.digest(images[0]), namespace=vc.namespace) == 2  # cpu and disk
        log = BatchLog(vc)
        got = vc.encode(images[:2])
        assert log.sizes == [1] and torch.equal(got, want)  # the corrupt one re-encoded, the other loaded
        assert torch.equal(vc.encode(images[:1]), want[:1]) and log.sizes == [1]  # stored again: a hit


def test_entries_survive_a_reopen(tmp_path: Path, images: list) -> None:
    with Memory(tmp_path / "kvmem") as mem:
        want = tiny(mem).encode(images)
    with Memory(tmp_path / "kvmem") as mem:
        vc = tiny(mem)
        assert torch.equal(vc.encode(images), want) and (vc.hits, vc.misses) == (4, 0)


def test_real_size_vit_b_32_alone_equals_batched(memory: Memory, images: list) -> None:
    vc = VisualTokenCache("ViT-B-32", memory=memory, seed=7)
    batch = vc.encode(images[:3])
    alone = VisualTokenCache("ViT-B-32", memory=Memory(memory.config.path + "-2"), seed=7).encode([images[1]])
    assert batch.shape == (3, 49, 768) and torch.equal(alone[0], batch[1])


def test_local_checkpoint_file_and_directory(tmp_path: Path, memory: Memory, images: list) -> None:
    seeded = tiny(memory, seed=3)
    ckpt = tmp_path / "ckpt" / "open_clip_model.safetensors"
    ckpt.parent.mkdir()
    save_file({k: v.contiguous() for k, v in seeded.encoder.model.state_dict().items()}, ckpt)
    from_file = tiny(memory, pretrained=str(ckpt))  # seed 0, but the weights come from the file
    from_dir = tiny(memory, pretrained=ckpt.parent)
    assert from_file.encoder.identity["weights"].startswith("file:sha256=")
    assert from_file.namespace == from_dir.namespace != seeded.namespace
    assert torch.equal(from_file.encode(images[:1]), seeded.encode(images[:1]))
    from_file.flush()  # NOTE: its store runs in the background; another cache sees it once flushed
    assert from_dir.hits == 0 and torch.equal(from_dir.encode(images[:1]), seeded.encode(images[:1]))
    assert from_dir.hits == 1


def test_missing_weights_fail_fast_and_say_why(memory: Memory, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="in no local cache"):
        VisualTokenCache("ViT-B-32", pretrained="openai", memory=memory)
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(ConfigError, match="nor a tag of ViT-B-32.*openai"):
        VisualTokenCache("ViT-B-32", pretrained="no-such-tag", memory=memory)
    with pytest.raises(ConfigError, match="a directory without weights"):
        VisualTokenCache(TINY, pretrained=tmp_path, memory=memory)
    with pytest.raises(ConfigError, match="model_name='ViT-Nope'"):
        VisualTokenCache("ViT-Nope", memory=memory)
    with pytest.raises(ConfigError, match="layer=3: .* accepted -3..2"):
        tiny(memory, layer=3)
    with pytest.raises(ConfigError, match="feature='cls'"):
        tiny(memory, feature="cls")


def test_bad_images_name_the_value(memory: Memory, tmp_path: Path) -> None:
    vc = tiny(memory)
    with pytest.raises(UnsupportedValueError, match="image of type int"):
        vc.encode([123])  # type: ignore[list-item]
    with pytest.raises(UnsupportedValueError, match="not a decodable image"):
        vc.encode([b"not an image"])
    with pytest.raises(UnsupportedValueError, match="cannot be read"):
        vc.encode([tmp_path / "missing.png"])
    with pytest.raises(UnsupportedValueError, match="empty list"):
        vc.encode([])


def test_similar_images_within_one_encoder(memory: Memory, images: list) -> None:
    vc = tiny(memory)
    pooled = vc.embed(images)
    assert pooled.shape == (4, 32) and vc.misses == 4
    query = picture(0)
    query.putpixel((70, 50), (1, 2, 3))  # a near-duplicate of image 0
    found = vc.similar(query, k=2, threshold=-1.0)
    assert len(found) == 2 and found[0].digest == image_digest(images[0])
    assert found[0].score >= found[1].score
    assert [m.digest for m in vc.similar(images[0], k=3, threshold=-1.0)] and all(
        m.digest != image_digest(images[0]) for m in vc.similar(images[0], k=3, threshold=-1.0)
    )
    other = tiny(memory, seed=5)  # another encoder: another partition
    assert other.similar(images[1], k=3, threshold=-1.0) == []
    assert vc.similar(png(images[1]), k=3, threshold=1.01) == []  # nothing scores above 1


def test_vit_b_16_gives_llava_15s_196_patch_tokens(memory: Memory, images: list) -> None:
    vc = VisualTokenCache("ViT-B-16", memory=memory)
    assert vc.encoder.identity["layer"] == 10 and vc.encode(images[:1]).shape == (1, 196, 768)


def test_similar_forgets_deleted_images_and_survives_a_reopen(tmp_path: Path, images: list) -> None:
    with Memory(tmp_path / "kvmem") as mem:
        vc = tiny(mem)
        vc.embed(images)
        assert mem.delete(vc.digest(images[1]), namespace=vc.pooled_namespace)
        left = {m.digest for m in vc.similar(images[0], k=5, threshold=-1.0)}
        assert left == {vc.digest(images[2]), vc.digest(images[3])}
    with Memory(tmp_path / "kvmem") as mem:
        vc = tiny(mem)
        assert {m.digest for m in vc.similar(images[0], k=5, threshold=-1.0)} == left
        assert vc.hits == 1  # the query's own embedding came from the cache


def test_a_miss_is_stored_behind_the_call_from_a_copy_of_its_own(tmp_path: Path, images: list) -> None:
    with Memory(tmp_path / "kvmem") as mem:
        vc = tiny(mem)
        log = BatchLog(vc)
        given = vc.encode(images[:1])
        want = given.clone()
        given.zero_()  # NOTE: the caller's tensor is its own: what is stored (or queued) does not change
        again = vc.encode(images[:1])  # queued or stored by now: a hit either way, never encoded twice
        assert log.sizes == [1] and (vc.hits, vc.misses) == (1, 1) and torch.equal(again, want)
        again.zero_()
        vc.flush()
        assert torch.equal(mem.load(vc.digest(images[0]), namespace=vc.namespace), want[0])
        vc.encode(images[1:2])  # queued when the memory closes: close waits for it
    with Memory(tmp_path / "kvmem") as mem:
        vc = tiny(mem)
        assert torch.equal(vc.encode(images[:1]), want) and vc.encode(images[1:2]).shape == want.shape
        assert (vc.hits, vc.misses) == (2, 0)


def test_a_delete_wins_over_a_store_still_queued(memory: Memory, images: list) -> None:
    with tiny(memory) as vc:
        vc.encode(images[:1])
        assert memory.delete(vc.digest(images[0]), namespace=vc.namespace)
        vc.flush()
        assert not memory.contains(vc.digest(images[0]), namespace=vc.namespace)


def test_a_miss_in_a_request_is_stored_after_the_request_and_nothing_is_lost_on_close(
    tmp_path: Path, images: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: a store never runs for want of time (max_wait): only the request's end (or a flush) lets it
    monkeypatch.setattr(visual_module, "WriteBehind", partial(WriteBehind, max_wait=60))
    with Memory(tmp_path / "kvmem") as mem:
        vc = tiny(mem)
        key = vc.digest(images[0])
        with mem.activity:  # NOTE: an encode and the prefill after it are one request
            want = vc.encode(images[:1])
            time.sleep(0.2)
            assert not mem.contains(key, namespace=vc.namespace)  # not stored beside the request
            assert torch.equal(vc.encode(images[:1]), want)  # served from the queue meanwhile
        vc.flush()
        assert torch.equal(mem.load(key, namespace=vc.namespace), want[0])
        with mem.activity:
            more = vc.encode(images[1:2])
            mem.close()  # NOTE: in the request: the queued store is done first
    with Memory(tmp_path / "kvmem") as mem:
        vc = tiny(mem)
        assert torch.equal(vc.encode(images[1:2]), more) and (vc.hits, vc.misses) == (1, 0)


def test_digests_given_are_used_not_computed_again(
    memory: Memory, images: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    vc = tiny(memory)
    digests = [vc.digest(image) for image in images[:2]]

    def never(image: object) -> str:
        raise AssertionError("hashed again")

    monkeypatch.setattr(visual_module, "image_digest", never)
    want = vc.encode(images[:2], digests=digests)
    vc.flush()
    assert torch.equal(memory.load(digests[1], namespace=vc.namespace), want[1])
    assert torch.equal(vc.encode(images[:2], digests=digests), want) and (vc.hits, vc.misses) == (2, 2)
    with pytest.raises(UnsupportedValueError, match=r"digests: 1 for 2 images"):
        vc.encode(images[:2], digests=digests[:1])
