"""``examples/recsys_feature_cache.py``: item features by content hash, user-history K/V by history hash.

Small catalogues keep these fast; the default 2,000-item run is what a user sees, and is not a test.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

import kvmem
from tests.examples_loader import load_example

# pass, wall, encode, store, load (ms), encoder calls, items encoded, users encoded, hit rate, served by, speed-up
_ROW = re.compile(
    r"^(\d \w+)\s+([\d.]+) ms\s+([\d.]+) ms\s+([\d.]+) ms\s+([\d.]+) ms\s+(\d+)\s+(\d+)\s+(\d+)\s+"
    r"([\d.]+)%\s+(.+?)\s+([\d.]+)x$",
    re.M,
)


@pytest.fixture(scope="module")
def recsys() -> ModuleType:
    """The example script, imported by path (``examples/`` is not a package)."""
    return load_example("recsys_feature_cache.py")


def test_main_runs_cold_warm_and_reopened_passes(
    recsys: ModuleType, tmp_path: Path, one_thread: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--users", "12", "--items", "150", "--candidates", "20", "--seed", "3", "--path", str(tmp_path)]
    start = time.perf_counter()
    assert recsys.main(argv) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "150 items, 12 users" in out and "20 candidates per user (seed 3)" in out
    rows = {r[0]: r for r in _ROW.findall(out)}
    assert list(rows) == ["1 cold", "2 warm", "3 reopened"], out
    cold, warm, reopened = rows.values()
    assert sum(float(r[1]) for r in rows.values()) <= elapsed * 1e3
    for row in rows.values():  # the wall time holds its encode, store and load parts (each rounded to 0.1 ms)
        assert float(row[1]) + 0.2 >= float(row[2]) + float(row[3]) + float(row[4]), row
    assert int(cold[5]) >= 1 and int(cold[6]) > 100 and int(cold[7]) == 12 and float(cold[8]) == 0.0
    assert float(cold[2]) > 0 and float(cold[3]) > 0 and cold[9] == "-" and float(cold[10]) == 1.0
    for row, tier in ((warm, "cpu"), (reopened, "disk")):
        assert (float(row[2]), float(row[3])) == (0.0, 0.0), row  # nothing encoded, nothing stored
        assert (int(row[5]), int(row[6]), int(row[7]), float(row[8])) == (0, 0, 0, 100.0), row
        assert re.fullmatch(rf"{tier} \d+", row[9]), row  # reopened: only the disk tier survived
        assert float(row[1]) > 0 and float(row[10]) > 0
    assert re.search(
        r"^no cache\s+[\d.]+ s a pass .*pass 2 warm [\d.]+x faster, pass 3 reopened [\d.]+x faster$", out, re.M
    )
    assert re.search(r"^OK: 2 warm scores == 1 cold scores \(12 users, 240 candidate scores, bit for bit\)$", out, re.M)
    assert re.search(r"^OK: 3 reopened scores == 1 cold scores", out, re.M)
    assert (tmp_path / "catalog.sqlite3").exists()  # --path: a real directory, kept

    assert recsys.main([*argv, "--fsync", "batch"]) == 0  # a second run on the same directory: nothing encoded
    again = {r[0]: r for r in _ROW.findall(capsys.readouterr().out)}
    assert (int(again["1 cold"][6]), float(again["1 cold"][8])) == (0, 100.0)


def test_passes_load_exactly_what_was_computed(recsys: ModuleType, memory: kvmem.Memory, one_thread: None) -> None:
    catalogue = recsys.make_catalogue(120, 6, 15, seed=1)
    model = recsys.Recommender.build(1)
    cold = recsys.score_users(memory, model, catalogue, "cold")
    needed = {i for u in catalogue.users for i in (*u.history, *u.candidates)}
    assert sorted(cold.encoded_items) == sorted(needed) and cold.hit_rate == 0.0
    assert cold.encoded_users == [0, 1, 2, 3, 4, 5]
    warm = recsys.score_users(memory, model, catalogue, "warm")
    assert (warm.encoder_calls, warm.encoded_items, warm.encoded_users, warm.hit_rate) == (0, [], [], 1.0)
    assert warm.user_hits == 6 and warm.item_lookups == len({i for u in catalogue.users for i in u.candidates})
    assert recsys.same_scores(cold, warm)
    feature = memory.load(recsys.item_key(catalogue.items[0]), namespace=model.item_namespace)
    assert feature.shape == (recsys.FEATURE_DIM,) and feature.dtype == torch.float32

    other = recsys.Recommender.build(2)  # other weights: other namespaces, nothing shared
    assert other.item_namespace != model.item_namespace and other.user_namespace != model.user_namespace
    assert recsys.score_users(memory, other, catalogue, "other").hit_rate == 0.0


def test_an_edit_recomputes_only_the_edited_item(recsys: ModuleType, memory: kvmem.Memory, one_thread: None) -> None:
    catalogue = recsys.make_catalogue(120, 8, 15, seed=2)
    model = recsys.Recommender.build(2)
    before = recsys.score_users(memory, model, catalogue, "before")
    item = catalogue.users[0].history[0]
    edited = recsys.edit_item(catalogue, item, "now with a new description entirely")
    assert recsys.item_key(edited.items[item]) != recsys.item_key(catalogue.items[item])

    after = recsys.score_users(memory, model, edited, "after")
    holders = [u.user_id for u in catalogue.users if item in u.history]
    assert after.encoded_items == [item] and after.encoder_calls == 1
    assert after.encoded_users == holders  # their history key names the item's content key
    for user in catalogue.users:
        if user.user_id not in holders and item not in user.candidates:
            assert torch.equal(after.scores[user.user_id], before.scores[user.user_id])
    assert not torch.equal(after.scores[0], before.scores[0])

    reverted = recsys.score_users(memory, model, catalogue, "reverted")  # the old content's key is still stored
    assert (reverted.encoded_items, reverted.encoded_users, reverted.hit_rate) == ([], [], 1.0)
    assert recsys.same_scores(before, reverted)


def test_a_new_interaction_recomputes_only_that_users_history(
    recsys: ModuleType, memory: kvmem.Memory, one_thread: None
) -> None:
    catalogue = recsys.make_catalogue(120, 5, 15, seed=4)
    model = recsys.Recommender.build(4)
    recsys.score_users(memory, model, catalogue, "before")
    clicked = catalogue.users[3].candidates[0]  # already encoded: a candidate of user 3
    result = recsys.score_users(memory, model, recsys.add_interaction(catalogue, 3, clicked), "after")
    assert (result.encoded_items, result.encoded_users, result.user_hits) == ([], [3], 4)


def test_bad_sizes_are_rejected(recsys: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        recsys.main(["--items", "10"])
    assert exc.value.code == 2 and "--items >= 60" in capsys.readouterr().err
