"""The saver thread on real memories: a finished request is reported only once its chunks are stored, each
one entry of its blocks, and closing finishes every save queued."""

from __future__ import annotations

from pathlib import Path

import torch

import kvmem
from kvmem_vllm.saver import Saver

NS = "vllm/test"


def blocks(n: int) -> list[list[torch.Tensor]]:
    """``n`` distinct chunks of 2 blocks of 256 KiB (a block of every layer, as the worker's views are)."""
    return [[torch.full((4, 2, 64, 128), float(i) + j / 2) for j in range(2)] for i in range(n)]


def stored(path: Path, keys: list[str]) -> list[bool]:
    with kvmem.Memory(str(path), cpu_bytes=0) as mem:
        return mem.contains_many(keys, namespace=NS)


def test_a_finished_request_is_reported_only_with_its_blocks_stored(tmp_path: Path) -> None:
    with kvmem.Memory(str(tmp_path), cpu_bytes="64MiB", disk_bytes="256MiB") as mem:
        saver = Saver(mem, NS, "none")
        values = blocks(6)
        saver.submit({"a"}, [(f"a/{i}", values[i]) for i in range(4)])
        saver.submit({"a", "b"}, [("a/4", values[4]), ("b/0", values[5])])
        assert saver.finished(set()) == set()  # nothing finished yet, whatever is stored
        reported: set[str] = set()
        while "a" not in reported:
            reported |= saver.finished({"a"})
            if "a" in reported:  # NOTE: at the moment it is reported, every one of its blocks is loadable
                got = mem.load_many([f"a/{i}" for i in range(5)], namespace=NS)
                assert all(torch.equal(g, torch.stack(v)) for g, v in zip(got, values))  # a chunk: rows = blocks
        assert "b" not in reported  # running: its blocks stay vLLM's, never reported
        saver.close()
        assert saver.saved_blocks == 12  # 6 chunks of 2 blocks


def test_a_request_whose_saves_were_dropped_is_still_reported(tmp_path: Path) -> None:
    with kvmem.Memory(str(tmp_path), cpu_bytes="16MiB", disk_bytes="64MiB") as mem:
        saver = Saver(mem, NS, "none")
        saver.submit({"failed-load"}, [])  # the scheduler holds its blocks: it must hear it is done
        assert saver.finished({"failed-load", "never-saved"}) == {"failed-load"}
        assert saver.finished({"failed-load"}) == set()  # reported once
        saver.close()


def test_waiting_for_a_preempted_request_returns_with_its_blocks_stored(tmp_path: Path) -> None:
    with kvmem.Memory(str(tmp_path), cpu_bytes="64MiB", disk_bytes="256MiB") as mem:
        saver = Saver(mem, NS, "none")
        values = blocks(8)
        saver.submit({"p"}, [(f"p/{i}", v) for i, v in enumerate(values)])
        saver.wait_for({"p"})
        assert all(mem.contains_many([f"p/{i}" for i in range(8)], namespace=NS))
        saver.close()


def test_close_finishes_every_queued_save(tmp_path: Path) -> None:
    keys = [f"k/{i}" for i in range(32)]
    with kvmem.Memory(str(tmp_path), cpu_bytes="64MiB", disk_bytes="256MiB") as mem:
        saver = Saver(mem, NS, "none")
        values = blocks(32)
        for i in range(0, 32, 4):
            saver.submit({f"r{i}"}, [(keys[j], values[j]) for j in range(i, i + 4)])
        saver.close()
    assert stored(tmp_path, keys) == [True] * 32  # on disk, read by another memory


def test_blocks_already_stored_are_not_stored_again(tmp_path: Path) -> None:
    with kvmem.Memory(str(tmp_path), cpu_bytes="64MiB", disk_bytes="256MiB") as mem:
        saver = Saver(mem, NS, "none")
        doc = [(f"doc/{i}", v) for i, v in enumerate(blocks(3))]
        saver.submit({"q1"}, doc)
        saver.submit({"q2"}, doc)  # a second question on the document, computed while q1's saves were in flight
        saver.submit({"q3", "q4"}, [*doc, *doc])  # two more, computed in one step: one batch
        saver.close()
        assert saver.saved_blocks == 6  # 3 chunks of 2 blocks, once
        assert saver.finished({"q1", "q2", "q3", "q4"}) == {"q1", "q2", "q3", "q4"}
