"""Fixtures of the KV tests: tiny real models (built once per session), their reference outputs, Memories."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import PreTrainedModel

import kvmem
from kvmem.kv import PrefixCache
from tests.conftest import MemoryFactory
from tests.kv.workers import BLOCK, NEW_TOKENS, PROMPT_B, build_model

ModelFactory = Callable[..., PreTrainedModel]


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run these tests on one intra-op thread, as the worker does.

    NOTE: on these tiny models every op is microseconds long; fanning it out to
    threads that spin-wait made the suite about 5x slower on 2 shared cores.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model() -> ModelFactory:
    """``tiny_model(arch, seed=0)``: the model of ``tests.kv.workers.build_model``, built once per session.

    NOTE: tests share these instances; nothing in kvmem may change a model.
    """
    built: dict[tuple[str, int], PreTrainedModel] = {}

    def get(arch: str, seed: int = 0) -> PreTrainedModel:
        if (arch, seed) not in built:
            built[arch, seed] = build_model(arch, seed)
        return built[arch, seed]

    return get


class Reference:
    """The plain transformers answers for ``PROMPT_B``: a full forward pass and greedy ``generate``."""

    def __init__(self, model: PreTrainedModel) -> None:
        with torch.no_grad():
            self.logits = model(PROMPT_B).logits
            self.generated = model.generate(PROMPT_B, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert self.generated.shape[1] == PROMPT_B.shape[1] + NEW_TOKENS


@pytest.fixture(scope="session")
def reference(tiny_model: ModelFactory) -> Callable[[str], Reference]:
    """``reference(arch)``: the :class:`Reference` of ``tiny_model(arch)``, computed once per session."""
    done: dict[str, Reference] = {}

    def get(arch: str) -> Reference:
        if arch not in done:
            done[arch] = Reference(tiny_model(arch))
        return done[arch]

    return get


@pytest.fixture
def prefix_cache(make_memory: MemoryFactory) -> Iterator[Callable[..., PrefixCache]]:
    """``prefix_cache(model, memory, **options)``: a PrefixCache with ``block_size=BLOCK``, lossless chunks.

    Every instance is closed at teardown (before the Memories it uses).
    """
    made: list[PrefixCache] = []

    def make(model: PreTrainedModel, memory: kvmem.Memory, **options: object) -> PrefixCache:
        settings: dict[str, object] = {"block_size": BLOCK, "compression": "none", **options}
        pc = PrefixCache(model, memory, **settings)  # type: ignore[arg-type]
        made.append(pc)
        return pc

    yield make
    for pc in made:
        pc.close()


EXACT = 1e-5  # max |logit difference| of a prefill that reuses stored KV from a full forward pass (fp32)


def store_prompt(pc: PrefixCache, ids: torch.Tensor) -> None:
    """Prefill ``ids`` through ``pc`` and wait until its chunks are stored."""
    pc.prefill(ids)
    pc.flush()


def assert_prefill_exact(model: PreTrainedModel, pc: PrefixCache, ids: torch.Tensor, reused: int) -> None:
    """``pc.prefill(ids)`` reuses ``reused`` tokens, computes the rest, and gives a full forward pass's logits."""
    result = pc.prefill(ids)
    assert (result.reused_tokens, result.computed_tokens) == (reused, ids.shape[1] - reused)
    with torch.no_grad():
        full = model(ids).logits
    assert (result.logits - full[:, reused:]).abs().max().item() <= EXACT
