"""Visual-token cache: a CLIP vision tower's encode time against loading its cached tokens.

Not a test: a measurement (issue 5, requirement 7). For each model, the same
images are encoded the plain way (preprocess + the tower's forward to the
penultimate block, what ``VisualTokenCache`` computes on a miss) and then
served by ``VisualTokenCache.encode`` as hits from

- the CPU tier (a ``Memory`` with a CPU tier only),
- the disk tier with the page cache warm (a ``Memory`` with a disk tier only),
- the disk tier cold (each entry's file dropped from the page cache first),

per image (batches of 1) and per batch of 8, medians of ``--repeat`` runs.
A hit includes everything a caller pays: hashing the image bytes, the catalog-free
tier lookup, the CRC check and the copy out. Weights are random (nothing is
downloaded); encode time does not depend on them.

Usage (from the repository root, offline)::

    HF_HUB_OFFLINE=1 python benchmarks/bench_visual.py                       # ViT-B-32, ViT-B-16, ViT-L-14
    HF_HUB_OFFLINE=1 python benchmarks/bench_visual.py --models ViT-B-32 --repeat 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import records
import torch
from machine import drop_page_cache, filesystem_of, load_average
from PIL import Image

from kvmem import Memory
from kvmem.multimodal import VisualTokenCache, decode_image
from kvmem.stores import DiskTier

GOALS = {"cpu": 1000.0, "disk warm": 1000.0, "disk cold": 100.0}


def pictures(n: int, size: int = 320) -> list[bytes]:
    """``n`` distinct PNG images (gradients with a colored square), as encoded bytes."""
    out = []
    for i in range(n):
        img = Image.linear_gradient("L").resize((size, size * 3 // 4)).convert("RGB")
        img.paste((40 * i % 256, 200 - 17 * i % 180, 90 + 31 * i % 160), (10 + 9 * i, 20, 90 + 9 * i, 100))
        buf = io.BytesIO()
        img.save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def median_seconds(fn: Callable[[], object], repeat: int, before: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def disk_files(mem: Memory, vc: VisualTokenCache, images: list[bytes]) -> list[Path]:
    disk = next(t for t in mem._tiers.tiers if isinstance(t, DiskTier))
    return [disk.path(mem.storage_key(vc.digest(img), vc.namespace)) for img in images]


def bench_model(
    name: str, images: list[bytes], repeat: int, root: Path, dtype: torch.dtype | None
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    t0 = time.perf_counter()
    cpu_mem = Memory(str(root / f"{name}-cpu"), disk_bytes=0, cpu_bytes="4GiB")
    vc = VisualTokenCache(name, memory=cpu_mem, dtype=dtype)
    build_s = time.perf_counter() - t0
    enc = vc.encoder

    def plain(batch: list[bytes]) -> torch.Tensor:
        return enc.tokens(torch.stack([enc.preprocess(decode_image(img)) for img in batch]))

    disk_mem = Memory(str(root / f"{name}-disk"), cpu_bytes=0, fsync="always")
    vc_disk = VisualTokenCache.from_encoder(enc, memory=disk_mem, dtype=dtype)
    tokens = vc.encode(images)
    assert torch.equal(vc_disk.encode(images), tokens)  # stored on disk, fsynced
    files = disk_files(disk_mem, vc_disk, images)
    shape = tuple(tokens.shape[1:])
    print(
        f"\n{name}: tokens {shape} {tokens.dtype} ({tokens[0].nbytes / 1024:.0f} KiB an image), layer "
        f"{enc.identity['layer']}, built in {build_s:.1f}s"
    )
    for batch_size in (1, 8):
        batches = [images[i : i + batch_size] for i in range(0, len(images), batch_size)]

        def each(fn: Callable[[list[bytes]], object], batches: list[list[bytes]] = batches) -> Callable[[], None]:
            return lambda: [fn(b) for b in batches]

        per = len(images)  # NOTE: every row is per image, whatever the batch
        base = median_seconds(each(plain), repeat) / per
        hits = {
            "cpu": median_seconds(each(vc.encode), repeat) / per,
            "disk warm": median_seconds(each(vc_disk.encode), repeat) / per,
            "disk cold": median_seconds(each(vc_disk.encode), repeat, lambda: drop_page_cache(files)) / per,
        }
        for where, seconds in hits.items():
            rows.append(
                {
                    "model": name,
                    "batch": batch_size,
                    "tier": where,
                    "encode_ms": base * 1e3,
                    "cached_ms": seconds * 1e3,
                    "speedup": base / seconds,
                    "goal": GOALS[where],
                }
            )
    cpu_mem.close()
    disk_mem.close()
    return rows


def figures(rows: list[dict[str, Any]]) -> list[dict[str, object]]:
    """The results record's figures: per model, batch and tier, a cached load beside the encode it saves."""
    return [
        records.figure(
            records.slug(f"{r['model']} b{r['batch']} {r['tier']}"),
            f"{r['model']}, batch {r['batch']}, {r['tier']}: per image",
            "ms",
            r["cached_ms"],
            records.ref("encode (decode + preprocess + tower)", r["encode_ms"], r["speedup"]),
            ratio=f"encode time / cached load time (goal >= {r['goal']:g})",
            group=str(r["model"]),
        )
        for r in rows
    ]


def main() -> None:
    run = records.start("bench_visual")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="ViT-B-32,ViT-B-16,ViT-L-14")
    ap.add_argument("--repeat", type=int, default=5, help="repetitions; the table shows medians")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk to measure")
    ap.add_argument(
        "--dtype",
        choices=["fp32", "fp16"],
        default="fp32",
        help="storage dtype of the tokens (fp32: as encoded, lossless)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    images = pictures(8)
    print(
        f"kvmem visual-token benchmark  |  {platform.node()}  load {load_average()}  |  torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, CPU  |  8 PNG images 320x240, median of "
        f"{args.repeat}"
    )
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-visual-", dir=args.dir) as tmp:
        print(f"scratch: {tmp} ({filesystem_of(Path(tmp))})")
        for name in args.models.split(","):
            rows += bench_model(name, images, args.repeat, Path(tmp), torch.float16 if args.dtype == "fp16" else None)
    print(
        f"\n{'model':<10} {'batch':>5} {'tier':<10} {'encode ms/img':>13} {'cached ms/img':>13} "
        f"{'speed-up':>9} {'goal':>6}"
    )
    for r in rows:
        ok = "ok" if r["speedup"] >= r["goal"] else "MISS"  # type: ignore[operator]
        print(
            f"{r['model']:<10} {r['batch']:>5} {r['tier']:<10} {r['encode_ms']:13.2f} {r['cached_ms']:13.3f} "
            f"{r['speedup']:8.0f}x {r['goal']:5.0f}x {ok}"
        )
    figs = figures(rows)
    records.write(
        run,
        figs,
        headline=[str(f["id"]) for f in figs if str(f["id"]).endswith("b1-cpu")][-1:],
        machine={"torch_threads": torch.get_num_threads(), "dtype": args.dtype},
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
