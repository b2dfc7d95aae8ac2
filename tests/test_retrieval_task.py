"""The retrieval task and training aids of ``benchmarks/train_retrieval_lm.py`` (the model ``bench_blend`` scores):
answers only the documents hold, copying sequences that need an induction head, and growth that keeps what
the model computes.

Trains nothing: the training itself is measured by the script.
"""

from __future__ import annotations

import random

import torch
from transformers import LlamaForCausalLM

from tests.examples_loader import load_benchmark

task = load_benchmark("train_retrieval_lm")


def test_each_answer_joins_two_facts_from_two_documents() -> None:
    rng = random.Random(3)
    for _ in range(20):
        world = task.make_world(rng, facts=4)
        assert [len(d) for d in world.docs] == [1 + task.FACT_TOKENS * 4] * task.DOCS
        for chain in range(len(world.chains)):
            (_, _, person), (company, city) = world.question(chain)
            works = [d for d, doc in enumerate(world.docs) if _has(doc, [task.WORKS, person, company])]
            located = [d for d, doc in enumerate(world.docs) if _has(doc, [task.IN, company, city])]
            assert len(works) == len(located) == 1 and works != located


def test_copying_repeats_at_distances_that_differ() -> None:
    torch.manual_seed(0)
    length = 16
    ids, labels = task.copy_batch(32, length)
    assert ids.shape == labels.shape == (32, 3 * length - 1)
    starts = set()
    for row in range(32):
        at = (labels[row] != -100).nonzero()[:, 0]
        start = at[0].item()
        assert at.tolist() == list(range(start, start + length - 1))  # the repeat, from its second name
        assert ids[row, start : start + length - 1].tolist() == ids[row, : length - 1].tolist()
        assert labels[row, at].tolist() == ids[row, 1:length].tolist()  # the name after, in the first copy
        starts.add(start)
    assert len(starts) > 4  # no fixed distance for one head to learn


def test_growing_keeps_the_models_outputs_and_saves_as_the_deeper_model(tmp_path) -> None:
    torch.manual_seed(0)
    model = task.build_model(max_positions=256, layers=2, width=64).eval()
    ids = torch.tensor([[task.BOS] + [t for d in task.make_world(random.Random(1), 2).docs for t in d]])
    before = model(ids).logits
    task.grow(model, 5)
    assert model.config.num_hidden_layers == len(model.model.layers) == 5
    torch.testing.assert_close(model(ids).logits, before)
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reloaded.config.num_hidden_layers == 5
    torch.testing.assert_close(reloaded(ids).logits, before)


def _has(doc: list[int], fact: list[int]) -> bool:
    return any(doc[i : i + len(fact)] == fact for i in range(len(doc)))
