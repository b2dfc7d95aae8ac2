"""write_atomic: the one atomic file replacement (disk areas' state, the catalog journal, HNSW files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem.fsutil import write_atomic


@pytest.mark.parametrize("durable", [True, False])
def test_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path, durable: bool) -> None:
    path = tmp_path / "sub" / "state.json"
    write_atomic(path, "old", durable=durable)
    write_atomic(path, memoryview(b"new \xff"), durable=durable)
    assert path.read_bytes() == b"new \xff"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_failed_rename_keeps_the_old_target_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "graph.hnsw"
    target.mkdir()
    (target / "inside").write_text("kept")  # NOTE: a non-empty directory: os.replace over it fails for real
    with pytest.raises(OSError):
        write_atomic(target, b"data", durable=True)
    assert (target / "inside").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.hnsw"]
