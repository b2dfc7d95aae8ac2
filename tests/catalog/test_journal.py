"""The catalog journal: files of live processes are left alone, dead ones claimed once, torn lines skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

from kvmem.catalog.journal import Journal


def _rows(path: Path) -> list[dict[str, object]]:
    """The rows of a journal file (each line: JSON, a tab, its CRC32)."""
    return [json.loads(line.partition("\t")[0]) for line in path.read_text().splitlines()]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rows_of_a_dead_process_are_claimed_once_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    dead = tmp_path / f"pending.{_dead_pid()}.aaaa.jsonl"
    dead.write_text(json.dumps({"key": "k1", "version": 1}) + "\n" + '{"key": "k2", "vers')  # cut by a crash
    live = tmp_path / f"pending.{os.getpid()}.bbbb.jsonl"  # another catalog of this (live) process
    live.write_text(json.dumps({"key": "mine", "version": 1}) + "\n")
    claimant = Journal(tmp_path)
    assert claimant.claim_orphans() == [{"key": "k1", "version": 1}]
    assert not dead.exists() and live.exists()
    assert _rows(claimant.path) == [{"key": "k1", "version": 1}]
    assert Journal(tmp_path).claim_orphans() == []  # the claimant is alive: its journal is its own


def test_a_claim_cut_short_by_a_crash_is_claimed_again(tmp_path: Path) -> None:
    (tmp_path / f"pending.{_dead_pid()}.cccc.jsonl.claimed.{_dead_pid()}").write_text('{"key": "k", "version": 2}\n')
    assert Journal(tmp_path).claim_orphans() == [{"key": "k", "version": 2}]
    assert [p.name.startswith("pending.") for p in tmp_path.iterdir()] == [True]  # only the claimant's own


def test_rewrite_keeps_what_is_queued_and_removes_an_empty_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.append([{"key": "a", "version": 1}, {"key": "b", "version": 1}])
    journal.rewrite([{"key": "b", "version": 1}])
    text = '{"key":"b","version":1}'
    assert journal.path.read_text().splitlines() == [f"{text}\t{zlib.crc32(text.encode()):08x}"]
    journal.rewrite([])
    assert not journal.path.exists()
    (tmp_path / "blocked").write_text("a file where the directory should be")
    Journal(tmp_path / "blocked").append([{"key": "x"}])  # cannot be written: logged, never raised


def test_a_journal_with_damaged_lines_gives_its_intact_rows_and_is_set_aside(tmp_path: Path) -> None:
    writer = Journal(tmp_path)
    writer.append([{"key": f"k{i}", "version": 1} for i in range(4)])
    writer.close()
    lines = writer.path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b"k1", b"k9")  # still JSON: only the CRC tells
    lines[2] = b"\xff" + lines[2][1:]  # not UTF-8
    dead = tmp_path / f"pending.{_dead_pid()}.dddd.jsonl"
    dead.write_bytes(b"\n".join(lines))
    writer.path.unlink()
    told: list[str] = []
    assert Journal(tmp_path, told.append).claim_orphans() == [{"key": "k0", "version": 1}, {"key": "k3", "version": 1}]
    [aside] = tmp_path.glob("pending.*.corrupt-*")
    assert aside.read_bytes() == b"\n".join(lines) and told == ["journal"]
    assert Journal(tmp_path).claim_orphans() == []  # the file set aside is never claimed again
