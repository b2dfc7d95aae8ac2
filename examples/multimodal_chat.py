"""A chat about one image with a LLaVA model, its visual tokens and image+system prefix KV served by kvmem.

Every turn's prompt is ``[BOS][image placeholders][system prompt][earlier turns][question]``
and is answered twice, side by side:

- **plain**: ``LlavaForConditionalGeneration`` as transformers runs it: the image is
  preprocessed, the vision tower encodes it, and the whole prompt is prefilled;
- **kvmem**: the visual tokens come from a :class:`~kvmem.multimodal.VisualTokenCache`
  over the model's own vision tower (:class:`~kvmem.multimodal.llava.LlavaImageEncoder`,
  cached by the image's content hash), are projected (``model.multi_modal_projector``)
  and merged into the prompt's embeddings at the placeholders, and a
  :class:`~kvmem.kv.PrefixCache` prefills them, loading every stored chunk of the
  prompt's KV instead of computing it. The chunk keys are scoped by the image's hash
  and the encoder's identity: placeholder ids are the same for every image, the KV is not.

Turn 1 encodes the image and stores the prefix; later turns load both and compute
only the new tokens, so their time to first token (TTFT: request in, first-token
logits out) drops. The first-token logits of both ways must agree (checked); the
answer is decoded greedily from kvmem's cache and becomes part of the conversation.

By default the model is a tiny LLaVA (CLIP vision tower + Llama) built from a config
with random weights, and words become ids by a hash (a random model has no
vocabulary): the numbers are about the mechanics, the answers are noise. Pass
``--model`` a local LLaVA-1.5-style checkpoint (``LlavaForConditionalGeneration``, one
image per prompt; e.g. a download of ``llava-hf/llava-1.5-7b-hf``) to chat for real;
nothing is ever downloaded.

Usage (from the repository root)::

    python examples/multimodal_chat.py                       # tiny random LLaVA, generated image, 3 turns
    python examples/multimodal_chat.py --model ~/models/llava-1.5-7b-hf --image photo.jpg --turns 4
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    CLIPVisionConfig,
    DynamicCache,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

import kvmem
from kvmem.kv import PrefixCache
from kvmem.multimodal import VisualTokenCache
from kvmem.multimodal.llava import LlavaImageEncoder

SYSTEM = (
    "You are a careful visual assistant. Look at the picture above and answer each question about it in one "
    "short sentence. Name colours, shapes and positions exactly as they appear; say so when something is not "
    "visible, and never guess beyond what the picture shows. Keep answers consistent with earlier ones."
)
QUESTIONS = (
    "What is in the picture?",
    "What colour is the circle?",
    "How many shapes can you see?",
    "Is the square left or right of the circle?",
    "What is in the background?",
    "Describe the picture in one sentence.",
)
TINY_VOCAB = 2048


# -- model, tokenizer, image -------------------------------------------------------------------------------------
def tiny_llava(seed: int) -> LlavaForConditionalGeneration:
    """A tiny LLaVA with random weights: a 4-layer CLIP tower on 224 px images (196 patches) and a 4-layer Llama."""
    vision = CLIPVisionConfig(
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=224,
        patch_size=16,
        projection_dim=64,
    )
    text = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=TINY_VOCAB - 1, image_seq_length=196)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlavaForConditionalGeneration(config).eval()


class WordTokenizer:
    """Words to ids by a hash, for a model with random weights (it has no vocabulary to match).

    Ids 0-2 (pad, BOS, EOS) and ``reserved`` (the image placeholder) are never produced.
    """

    def __init__(self, vocab_size: int, reserved: int) -> None:
        self.vocab_size, self.reserved = vocab_size, reserved

    def encode(self, text: str) -> list[int]:
        ids = [3 + zlib.crc32(word.lower().encode()) % (self.vocab_size - 3) for word in text.split()]
        return [i if i != self.reserved else 3 for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(f"<{i}>" for i in ids)


class HFTokenizer:
    """A checkpoint's own tokenizer, encoding pieces without special tokens."""

    def __init__(self, path: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


def sample_image(seed: int, size: tuple[int, int] = (320, 240)) -> Image.Image:
    """A deterministic picture: a vertical gradient, a circle, a square and a triangle, placed by ``seed``."""
    rng = random.Random(seed)
    img = Image.linear_gradient("L").resize(size).convert("RGB")
    draw = ImageDraw.Draw(img)
    w, h = size
    x, y, r = rng.randrange(w // 2), rng.randrange(h // 3, h - h // 4), rng.randrange(20, 50)
    draw.ellipse((x, y - r, x + 2 * r, y + r), fill=(220, rng.randrange(40, 90), 40))
    x = rng.randrange(w // 2, w - 60)
    draw.rectangle((x, 20, x + 50, 70), fill=(30, 60, rng.randrange(150, 250)))
    draw.polygon([(w // 2, h - 10), (w // 2 + 40, h - 70), (w // 2 + 80, h - 10)], fill=(40, 180, 60))
    return img


# -- one turn, both ways ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TurnResult:
    """One turn: its prompt, what kvmem reused, both TTFTs, and how far apart their first-token logits are.

    ``metrics`` holds this turn's change of kvmem's own counters: ``kv_reused_tokens``
    (``kvmem_kv_tokens_total{kind="reused"}``), ``kv_chunk_hits`` (``kvmem_kv_chunk_hits_total``)
    and ``tensor_hits`` (``kvmem_hits_total{kind="tensor"}``: visual tokens loaded).
    """

    turn: int
    prompt_tokens: int
    reused_tokens: int
    visual_hit: bool
    ttft_plain_ms: float
    ttft_kvmem_ms: float
    max_abs_diff: float
    logit_scale: float  # max |logit| of the plain way: what the difference is measured against
    same_first_token: bool
    answer: str
    metrics: dict[str, float]

    @property
    def speedup(self) -> float:
        return self.ttft_plain_ms / self.ttft_kvmem_ms


@dataclass
class ChatReport:
    """What :func:`main` measured."""

    model: str
    image_tokens: int
    prefix_tokens: int  # BOS + image placeholders + system prompt
    block_size: int
    rtol: float  # first-token logits may differ by rtol * max(1, max |logit|) (fp32: 1e-4; 16-bit: 2e-2)
    visual_hits: int = 0
    visual_misses: int = 0
    turns: list[TurnResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the two ways' first-token logits agree on every turn.

        NOTE: the greedy first token is reported, not required: a 16-bit model's near-ties may flip it.
        """
        return all(t.max_abs_diff <= self.rtol * max(1.0, t.logit_scale) for t in self.turns)


class Chat:
    """The model, both ways of answering, and the conversation so far (token ids).

    Args:
        model: a ``LlavaForConditionalGeneration``.
        encoder: its vision tower (cached in ``visual``).
        visual: the visual-token cache.
        prefix: the prefix KV cache.
        tokenizer: ``encode(str) -> ids`` and ``decode(ids) -> str``.
    """

    def __init__(
        self,
        model: LlavaForConditionalGeneration,
        encoder: LlavaImageEncoder,
        visual: VisualTokenCache,
        prefix: PrefixCache,
        tokenizer: WordTokenizer | HFTokenizer,
    ) -> None:
        self.model, self.encoder, self.visual, self.prefix, self.tokenizer = model, encoder, visual, prefix, tokenizer
        self.device = next(model.parameters()).device
        self.image_token = model.config.image_token_id
        eos = model.config.text_config.eos_token_id
        self.stops = set(eos) if isinstance(eos, list) else {eos}
        bos = model.config.text_config.bos_token_id
        self.ids = [bos] if bos is not None else []
        self.ids += [self.image_token] * encoder.num_tokens + tokenizer.encode("\n" + SYSTEM)
        self.prefix_tokens = len(self.ids)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def plain(self, image: Image.Image, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Transformers' way: preprocess, encode, prefill everything. Returns (first-token logits, seconds)."""
        start = time.perf_counter()
        pixels = self.encoder.preprocess(image).unsqueeze(0).to(self.device)
        logits = self.model(input_ids=ids, pixel_values=pixels, logits_to_keep=1).logits[:, -1]
        self._sync()
        return logits, time.perf_counter() - start

    @torch.no_grad()
    def warm_up(self, image: Image.Image, ids: torch.Tensor) -> None:
        """Run the model calls of both ways once, kvmem's without kvmem: vision tower, projector, prefill."""
        self.plain(image, ids)
        pixels = self.encoder.preprocess(image).unsqueeze(0).to(self.device)
        features = self.model.model.multi_modal_projector(self.encoder.tokens(pixels))[0]
        self.model(inputs_embeds=self._merge(ids, features), logits_to_keep=1)
        self._sync()

    def _merge(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The prompt's embeddings with the image's projected visual tokens at its placeholders."""
        embeds = self.model.get_input_embeddings()(ids)
        return embeds.masked_scatter((ids == self.image_token).unsqueeze(-1), features.to(embeds.dtype))

    @torch.no_grad()
    def cached(self, image: Image.Image, ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache, int, float]:
        """kvmem's way. Returns (first-token logits, the prompt's cache, tokens reused, seconds).

        NOTE: encode and prefill are one request (``memory.activity``): the stores of a miss wait for its
        first token, not run beside its forward pass, and are not part of its time.
        """
        start = time.perf_counter()
        with self.prefix.memory.activity:
            digest = self.visual.digest(image)
            tokens = self.visual.encode([image], digests=[digest]).to(self.device, self.encoder.dtype)
            embeds = self._merge(ids, self.model.model.multi_modal_projector(tokens)[0])
            # NOTE: the KV depends on the image as well as the ids: the scope names the image and the encoder
            scope = f"{self.visual.namespace}/{digest}"
            result = self.prefix.prefill(ids, inputs_embeds=embeds, scope=scope, logits_to_keep=1)
            self._sync()
        return result.logits[:, -1], result.cache, result.reused_tokens, time.perf_counter() - start

    @torch.no_grad()
    def answer(self, logits: torch.Tensor, cache: DynamicCache, max_tokens: int) -> list[int]:
        """Greedy tokens from the first-token logits on, decoded on ``cache`` (never an image placeholder)."""
        out: list[int] = []
        while len(out) < max_tokens:
            logits[..., self.image_token] = float("-inf")
            token = int(logits.argmax(-1))
            out.append(token)
            if token in self.stops or len(out) == max_tokens:
                break
            step = torch.tensor([[token]], device=self.device)
            logits = self.model(input_ids=step, cache=cache, logits_to_keep=1).logits[:, -1]
        return out

    def turn(self, number: int, image: Image.Image, question: str, answer_tokens: int) -> TurnResult:
        """Ask ``question``, answer it both ways, and extend the conversation with kvmem's answer."""
        self.ids += self.tokenizer.encode(f" USER: {question} ASSISTANT:")
        ids = torch.tensor([self.ids], device=self.device)
        before, hits = _counters(self.prefix.memory), self.visual.hits
        plain_logits, plain_s = self.plain(image, ids)
        logits, cache, reused, kvmem_s = self.cached(image, ids)
        after = _counters(self.prefix.memory)
        diff = (logits.float() - plain_logits.float()).abs().max().item()
        scale = plain_logits.float().abs().max().item()
        same = bool(logits.argmax(-1) == plain_logits.argmax(-1))
        answer = self.answer(logits.clone(), cache, answer_tokens)
        self.prefix.flush()  # NOTE: the new chunks are stored before the next turn looks them up
        self.ids += answer
        return TurnResult(
            number,
            ids.shape[1],
            reused,
            self.visual.hits > hits,
            plain_s * 1e3,
            kvmem_s * 1e3,
            diff,
            scale,
            same,
            self.tokenizer.decode(answer),
            {k: after[k] - before[k] for k in after},
        )


def _counters(memory: kvmem.Memory) -> dict[str, float]:
    m = memory.metrics
    tensor_hits = sum(
        s.value
        for metric in m.registry.collect()
        for s in metric.samples
        if s.name == "kvmem_hits_total" and s.labels.get("kind") == "tensor"
    )
    return {
        "kv_reused_tokens": m.value("kvmem_kv_tokens_total", kind="reused"),
        "kv_chunk_hits": m.total("kvmem_kv_chunk_hits_total"),
        "tensor_hits": tensor_hits,
    }


# -- output ----------------------------------------------------------------------------------------------------
def render(report: ChatReport) -> str:
    """The per-turn table."""
    head = (
        f"{'turn':>4}  {'prompt':>6}  {'reused':>6}  {'visual':>6}  {'TTFT plain':>10}  {'TTFT kvmem':>10}  "
        f"{'speed-up':>8}  {'max |dlogit|':>12}"
    )
    rows = [head, "-" * len(head)]
    for t in report.turns:
        rows.append(
            f"{t.turn:>4}  {t.prompt_tokens:>6}  {t.reused_tokens:>6}  {'hit' if t.visual_hit else 'miss':>6}  "
            f"{t.ttft_plain_ms:>7.1f} ms  {t.ttft_kvmem_ms:>7.1f} ms  {t.speedup:>7.2f}x  "
            f"{t.max_abs_diff:>12.2e}"
        )
    return "\n".join(rows)


@contextmanager
def data_dir(path: str | None) -> Iterator[str]:
    """``path``, or a temporary directory removed afterwards."""
    if path:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kvmem-chat-") as tmp:
        yield tmp


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a local LLaVA checkpoint directory (default: a tiny random LLaVA)")
    p.add_argument("--image", help="an image file (default: a generated test picture)")
    p.add_argument("--turns", type=int, default=3, help="questions asked about the image (default 3)")
    p.add_argument("--path", help="kvmem directory (default: a temporary one, removed after)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights and of the picture")
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV chunk (default 32)")
    p.add_argument("--answer-tokens", type=int, default=6, help="tokens decoded per answer (default 6)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; 1 on a busy machine)")
    args = p.parse_args(argv)
    if args.turns < 1 or args.block_size < 1 or args.answer_tokens < 1:
        p.error("--turns, --block-size and --answer-tokens must be at least 1")
    return args


def load(
    args: argparse.Namespace,
) -> tuple[LlavaForConditionalGeneration, LlavaImageEncoder, WordTokenizer | HFTokenizer]:
    """The model (``--model`` or the tiny one), its vision encoder, and a tokenizer."""
    if args.model is None:
        model = tiny_llava(args.seed).to(args.device)
        return model, LlavaImageEncoder(model), WordTokenizer(TINY_VOCAB, model.config.image_token_id)
    model = LlavaForConditionalGeneration.from_pretrained(args.model).to(args.device).eval()
    processor = (
        AutoImageProcessor.from_pretrained(args.model)
        if (Path(args.model) / "preprocessor_config.json").is_file()
        else None
    )
    has_tokenizer = any((Path(args.model) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    tokenizer = (
        HFTokenizer(args.model)
        if has_tokenizer
        else WordTokenizer(model.config.text_config.vocab_size, model.config.image_token_id)
    )
    return model, LlavaImageEncoder(model, processor), tokenizer


def main(argv: Sequence[str] | None = None) -> ChatReport:
    """Run the chat; print the table. Returns the report (``report.ok``: the two ways agree on every turn)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, encoder, tokenizer = load(args)
    image = Image.open(args.image).convert("RGB") if args.image else sample_image(args.seed)
    dtype = next(model.parameters()).dtype
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    with data_dir(args.path) as path, kvmem.Memory(path, cpu_bytes="256MiB", disk_bytes="1GiB") as memory:
        visual = VisualTokenCache.from_encoder(encoder, memory=memory)
        prefix = PrefixCache(model, memory, block_size=args.block_size, compression="none")
        chat = Chat(model, encoder, visual, prefix, tokenizer)
        report = ChatReport(
            args.model or f"tiny random LLaVA (seed {args.seed})",
            encoder.num_tokens,
            chat.prefix_tokens,
            args.block_size,
            rtol,
        )
        print(
            f"{report.model} on {args.device}, {dtype}: {encoder.num_tokens} image tokens, a "
            f"{chat.prefix_tokens}-token image+system prefix, {args.block_size}-token KV chunks"
        )
        # NOTE: a model's first calls are slow (allocation, lazy init): both ways' model calls are warmed up, on
        # another picture and without kvmem, so turn 1 shows what kvmem's first miss costs and nothing else
        chat.warm_up(sample_image(args.seed + 1), torch.tensor([chat.ids], device=chat.device))
        try:
            for i in range(args.turns):
                question = QUESTIONS[i % len(QUESTIONS)]
                result = chat.turn(i + 1, image, question, args.answer_tokens)
                report.turns.append(result)
                print(f"  turn {i + 1}  Q: {question}  A: {result.answer}")
        finally:
            prefix.close()
        report.visual_hits, report.visual_misses = visual.hits, visual.misses
    print(render(report))
    same = sum(t.same_first_token for t in report.turns)
    print(
        f"visual tokens: {report.visual_hits} hit(s), {report.visual_misses} miss(es); first-token logits "
        f"{'agree' if report.ok else 'DISAGREE'} on every turn (rtol {rtol:g} of max |logit|), the greedy first "
        f"token on {same} of {len(report.turns)}"
    )
    return report


if __name__ == "__main__":
    raise SystemExit(0 if main().ok else 1)
