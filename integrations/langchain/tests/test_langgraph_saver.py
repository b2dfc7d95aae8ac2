"""KVMemSaver: shared blobs, corruption, kill -9, two processes, capacity, and a real StateGraph resumed and forked.

The conformance suite (langgraph-checkpoint-conformance) runs in test_langchain_standard.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from crc32c import crc32c
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from sqlalchemy import select, update

import kvmem
from kvmem.errors import ConfigError
from langchain_kvmem import CheckpointCorrupt, KVMemSaver
from langchain_kvmem._checkpoint_rows import Element, blobs, channels, elements
from langchain_kvmem._verified import VerifiedElements
from tests.catalog.damage import FAULTS, damage_sqlite

HERE = Path(__file__).resolve().parent
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), str(HERE.parents[0]), os.environ.get("PYTHONPATH", "")]),
}


@pytest.fixture
def saver(tmp_path: Path, catalog: dict[str, str]) -> Iterator[KVMemSaver]:
    with kvmem.Memory(str(tmp_path / "kvmem"), fsync="never", **catalog) as mem:
        yield KVMemSaver(mem)


def put(
    saver: KVMemSaver,
    thread: str,
    values: dict[str, Any],
    versions: dict[str, int],
    new: dict[str, int],
    parent: dict | None = None,
    **metadata: Any,
) -> dict:
    """Store a checkpoint of ``values`` at ``versions`` (``new``: those that moved) after ``parent``; its config."""
    config: dict = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    if parent is not None:
        config["configurable"]["checkpoint_id"] = parent["configurable"]["checkpoint_id"]
    checkpoint = generate_checkpoint(channel_values=values, channel_versions=dict(versions))
    return saver.put(config, checkpoint, generate_metadata(**metadata), new)


def values_of(saver: KVMemSaver, config: dict) -> dict[str, Any]:
    found = saver.get_tuple(config)
    assert found is not None
    return found.checkpoint["channel_values"]


def test_unchanged_channels_and_forks_share_their_blobs(saver: KVMemSaver) -> None:
    big = {"document": "x" * 5000}
    one = put(saver, "t", {"big": big, "n": 1}, {"big": 1, "n": 1}, {"big": 1, "n": 1})
    two = put(saver, "t", {"big": big, "n": 2}, {"big": 1, "n": 2}, {"n": 2}, one)
    fork = put(saver, "t", {"big": big, "n": 3}, {"big": 1, "n": 2}, {"n": 2}, one)  # time travel from `one`
    # big stored once
    assert saver._rows.counts() == {"checkpoints": 3, "channels": 6, "blobs": 4, "elements": 0, "writes": 0}
    assert [values_of(saver, c)["n"] for c in (one, two, fork)] == [1, 2, 3]
    assert values_of(saver, fork)["big"] == big
    assert saver.get_tuple(fork).parent_config["configurable"]["checkpoint_id"] == one["configurable"]["checkpoint_id"]
    # an equal value stored under a new version is still one blob; a copied thread adds rows, not blobs
    put(saver, "t", {"big": dict(big), "n": 3}, {"big": 2, "n": 2}, {"big": 2}, fork)
    saver.copy_thread("t", "copy")
    assert saver._rows.counts() == {"checkpoints": 8, "channels": 16, "blobs": 4, "elements": 0, "writes": 0}
    saver.delete_thread("t")
    assert saver._rows.counts()["blobs"] == 4  # the copy still names every one
    assert [
        values_of(saver, {"configurable": {"thread_id": "copy", "checkpoint_id": c["configurable"]["checkpoint_id"]}})[
            "n"
        ]
        for c in (one, two, fork)
    ] == [1, 2, 3]
    saver.delete_thread("copy")
    assert saver._rows.counts() == {"checkpoints": 0, "channels": 0, "blobs": 0, "elements": 0, "writes": 0}


def message(i: int) -> dict[str, Any]:
    return {"role": "ai" if i % 2 else "user", "content": f"message {i} " + "words " * 20}


def test_a_growing_list_stores_each_element_once_and_forks_share_them(saver: KVMemSaver) -> None:
    """A 50-step thread's messages: one element row per message (linear), not one list per checkpoint."""
    configs = [put(saver, "t", {"messages": [message(0)]}, {"messages": 1}, {"messages": 1})]
    for step in range(1, 50):
        grown = [message(i) for i in range(2 * step + 1)]
        configs.append(
            put(saver, "t", {"messages": grown}, {"messages": step + 1}, {"messages": step + 1}, configs[-1])
        )
        assert saver._rows.counts()["elements"] == len(grown)
    assert values_of(saver, {"configurable": {"thread_id": "t"}})["messages"] == [message(i) for i in range(99)]
    assert values_of(saver, configs[10])["messages"] == [message(i) for i in range(21)]
    # a fork from step 25 shares its 51 messages and stores its 2 new ones; an edit stores the rest again
    fork = put(
        saver,
        "t",
        {"messages": [*map(message, range(51)), "fork a", "fork b"]},
        {"messages": 99},
        {"messages": 99},
        configs[25],
    )
    assert saver._rows.counts()["elements"] == 99 + 2
    put(
        saver,
        "t",
        {"messages": ["edited", *map(message, range(1, 99))]},
        {"messages": 100},
        {"messages": 100},
        configs[-1],
    )
    assert saver._rows.counts()["elements"] == 99 + 2 + 99
    assert values_of(saver, fork)["messages"][-3:] == [message(50), "fork a", "fork b"]
    # a copy names the same rows; the elements go with the last checkpoint that names them
    saver.copy_thread("t", "copy")
    assert saver._rows.counts()["elements"] == 200
    saver.prune(["t"])
    assert saver._rows.counts()["elements"] == 200  # the copy's checkpoints still name every one
    saver.delete_thread("copy")
    assert saver._rows.counts()["elements"] == 99  # the edited list: the latest checkpoint of "t"
    saver.delete_thread("t")
    assert saver._rows.counts() == {"checkpoints": 0, "channels": 0, "blobs": 0, "elements": 0, "writes": 0}


def test_a_corrupt_or_missing_element_is_never_returned(saver: KVMemSaver) -> None:
    """A saver that reads an element from the database checks it: here another process's saver (the writer keeps
    the elements it made, and the ones it checked, in memory: it returns those, as stored)."""
    one = put(saver, "t", {"messages": ["a", "b"]}, {"messages": 1}, {"messages": 1})
    two = put(saver, "t", {"messages": ["a", "b", "c"]}, {"messages": 2}, {"messages": 2}, one)
    assert values_of(saver, two) == {"messages": ["a", "b", "c"]}
    with saver.memory.database.connection() as conn:
        (key,) = conn.execute(select(channels.c.blob).order_by(channels.c.checkpoint.desc()).limit(1)).scalars()
        data = conn.execute(select(elements.c.data).where(elements.c.key == key)).scalar_one()
    changed = data[:-1] + bytes([data[-1] ^ 1])
    cases = [
        ({"data": changed}, "failed its check"),  # a flipped bit
        ({"data": changed, "crc": crc32c(changed)}, "no longer hashes to its key"),  # rewritten, CRC and all
    ]
    for values, message_ in cases:
        with saver.memory.database.transaction() as conn:
            conn.execute(update(elements).where(elements.c.key == key).values(**values))
        for reader in (KVMemSaver(saver.memory), KVMemSaver(saver.memory, element_cache_bytes=0)):
            assert values_of(reader, one) == {"messages": ["a", "b"]}  # an older list without it reads
            with pytest.raises(CheckpointCorrupt, match=rf"'messages''s element 1 from the end.*{message_}") as bad:
                reader.get_tuple({"configurable": {"thread_id": "t"}})
            assert bad.value.checkpoint_id == two["configurable"]["checkpoint_id"]
        assert values_of(saver, two) == {"messages": ["a", "b", "c"]}  # the writer's own copy: the bytes stored
    with saver.memory.database.transaction() as conn:
        conn.execute(update(elements).where(elements.c.key == key).values(parent=None, data=data, crc=crc32c(data)))
    with pytest.raises(CheckpointCorrupt, match="no longer hashes to its key"):  # cut from its list
        KVMemSaver(saver.memory).get_tuple(two)
    with saver.memory.database.transaction() as conn:
        conn.execute(elements.delete().where(elements.c.key == key))
    with pytest.raises(CheckpointCorrupt, match="is missing"):
        KVMemSaver(saver.memory).get_tuple(two)


def test_kept_elements_spare_the_reads_of_a_thread_s_history(saver: KVMemSaver) -> None:
    """A reader that checked a list once reads only the elements it has not seen; its memory is bounded."""
    config = put(saver, "t", {"messages": [f"m{i}" for i in range(50)]}, {"messages": 1}, {"messages": 1})
    reader = KVMemSaver(saver.memory)
    assert values_of(reader, config)["messages"] == [f"m{i}" for i in range(50)]
    assert len(reader._verified) == 50
    with saver.memory.database.transaction() as conn:  # history the reader checked: changed under it
        conn.execute(update(elements).where(elements.c.parent.is_(None)).values(data=b"\x00", crc=0))
    longer = put(saver, "t", {"messages": [f"m{i}" for i in range(52)]}, {"messages": 2}, {"messages": 2}, config)
    assert values_of(reader, longer)["messages"][-3:] == ["m49", "m50", "m51"]  # read: m50, m51 only
    with pytest.raises(CheckpointCorrupt, match="element 52 from the end.*failed its check"):
        KVMemSaver(saver.memory).get_tuple(longer)  # a reader without them reads the first element
    with pytest.raises(ConfigError, match=r"element_cache_bytes=-1: expected an int >= 0"):
        KVMemSaver(saver.memory, element_cache_bytes=-1)


def test_kept_elements_stay_within_their_capacity() -> None:
    chain = [Element(f"k{i}", f"k{i - 1}" if i else None, "bytes", 0, b"x" * 10) for i in range(10)]
    kept = VerifiedElements(capacity=45)
    kept.add(chain)
    assert len(kept) == 4  # the last four added, 40 bytes
    found, missing = kept.chain("k9")
    assert [e.key for e in found] == ["k9", "k8", "k7", "k6"] and missing == "k5"
    kept.add([Element("other", None, "bytes", 0, b"y" * 10)])  # drops the list's first kept element
    assert kept.missing("k9") == "k6" and kept.chain("k9")[0][-1].key == "k7"
    nothing = VerifiedElements(capacity=0)
    nothing.add(chain)
    assert len(nothing) == 0 and nothing.missing("k9") == "k9"


def test_a_list_stored_whole_still_reads(saver: KVMemSaver) -> None:
    """Checkpoints written before lists were stored element by element hold them as one blob."""
    config = put(saver, "t", {"messages": ["x"]}, {"messages": 1}, {"messages": 1})
    kind, data = saver.serde.dumps_typed(["a", "b"])
    with saver.memory.database.transaction() as conn:
        key = kvmem.content_hash(data, "kvmem/langgraph/value", kind)
        conn.execute(blobs.insert(), {"key": key, "body": saver.memory.compress({"type": kind, "data": data})})
        conn.execute(update(channels).values(blob=key))
    assert values_of(saver, config) == {"messages": ["a", "b"]}


@pytest.mark.parametrize("fault", FAULTS)
def test_lists_survive_a_damaged_catalog(tmp_path: Path, fault: str) -> None:
    """Element rows are kept as records too: a catalog rebuilt from them reads every list back."""
    path = tmp_path / "kvmem"
    with kvmem.Memory(str(path), fsync="never") as mem:
        saver = KVMemSaver(mem)
        one = put(saver, "t", {"messages": ["a", "b"]}, {"messages": 1}, {"messages": 1})
        two = put(saver, "t", {"messages": ["a", "b", "c"]}, {"messages": 2}, {"messages": 2}, one)
        put(saver, "gone", {"messages": ["x", "y"]}, {"messages": 1}, {"messages": 1})
        saver.delete_thread("gone")
        before = saver._rows.counts()
    damage_sqlite(path / "catalog.sqlite3", fault)
    with kvmem.Memory(str(path), fsync="never") as mem:
        saver = KVMemSaver(mem)
        assert saver._rows.counts() == before
        assert [values_of(saver, c)["messages"] for c in (one, two)] == [["a", "b"], ["a", "b", "c"]]
    assert len(list((path / "catalog.sqlite3.records" / "langgraph-elements").iterdir())) == before["elements"] == 3


def test_prune_keeps_the_latest_checkpoint_whole_and_frees_the_rest(saver: KVMemSaver) -> None:
    one = put(saver, "t", {"a": "a1", "b": "b1"}, {"a": 1, "b": 1}, {"a": 1, "b": 1})
    two = put(saver, "t", {"a": "a2", "b": "b1"}, {"a": 2, "b": 1}, {"a": 2}, one)
    saver.put_writes(two, [("a", "pending")], "task")
    saver.put_writes(one, [("a", "old")], "task")
    saver.prune(["t"])
    assert values_of(saver, {"configurable": {"thread_id": "t"}}) == {"a": "a2", "b": "b1"}
    # "a1" went
    assert saver._rows.counts() == {"checkpoints": 1, "channels": 2, "blobs": 2, "elements": 0, "writes": 1}
    assert saver.get_tuple(one) is None


def test_bad_input_is_named(saver: KVMemSaver, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="names no thread"):
        saver.get_tuple({"configurable": {}})
    with pytest.raises(ConfigError, match=r"thread_id=1\.5: expected a str"):
        saver.delete_thread(1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"strategy='oldest': accepted 'keep_latest', 'delete'"):
        saver.prune(["t"], strategy="oldest")
    with pytest.raises(ConfigError, match="put_writes needs the id"):
        saver.put_writes({"configurable": {"thread_id": "t"}}, [("a", 1)], "task")
    with pytest.raises(ConfigError, match="compression='gzip'"):
        KVMemSaver(saver.memory, compression="gzip")
    with pytest.raises(ConfigError, match="falls back to pickle"):
        KVMemSaver(saver.memory, serde=JsonPlusSerializer(pickle_fallback=True))
    assert saver.get_tuple({"configurable": {"thread_id": 7}}) is None  # an int thread id is its text


def test_a_value_stored_as_pickle_is_never_unpickled(saver: KVMemSaver) -> None:
    """A database written by someone else can hold a pickle: it is reported, never loaded."""
    config = put(saver, "t", {"a": "fine"}, {"a": 1}, {"a": 1})
    with saver.memory.database.transaction() as conn:  # the stranger's row: a pickle, sealed and keyed properly
        data = b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01x\x94."
        key = kvmem.content_hash(data, "kvmem/langgraph/value", "pickle")
        conn.execute(blobs.insert(), {"key": key, "body": saver.memory.compress({"type": "pickle", "data": data})})
        conn.execute(update(channels).values(blob=key))
    with pytest.raises(CheckpointCorrupt, match="is pickled: KVMemSaver never unpickles"):
        saver.get_tuple(config)


def test_a_corrupt_blob_on_disk_is_never_returned(tmp_path: Path) -> None:
    path = tmp_path / "kvmem"
    with kvmem.Memory(str(path), fsync="never") as mem:
        saver = KVMemSaver(mem, compression="none")
        one = put(saver, "t", {"doc": "intact", "n": 1}, {"doc": 1, "n": 1}, {"doc": 1, "n": 1})
        two = put(saver, "t", {"doc": "CORRUPT ME " * 40, "n": 1}, {"doc": 2, "n": 1}, {"doc": 2}, one)
        saver.put_writes(one, [("n", 5)], "task")
        with mem.database.connection() as conn:
            (body,) = [b for b in conn.execute(select(blobs.c.body)).scalars() if b"CORRUPT ME" in b]
    files = [f for f in path.glob("catalog.sqlite3*") if f.is_file()]
    hits = [(f, f.read_bytes().find(body[len(body) // 2 : len(body) // 2 + 64])) for f in files]
    hits = [(f, at) for f, at in hits if at >= 0]
    assert len(hits) == 1, hits
    target, at = hits[0]
    raw = bytearray(target.read_bytes())
    raw[at + 10] ^= 0x20  # one bit, inside the value's serialized bytes, in the database file
    target.write_bytes(bytes(raw))

    with kvmem.Memory(str(path), fsync="never") as mem:
        saver = KVMemSaver(mem)
        for read in (lambda: saver.get_tuple({"configurable": {"thread_id": "t"}}), lambda: saver.get_tuple(two)):
            with pytest.raises(CheckpointCorrupt, match=r"channel 'doc'.* failed its check") as bad:
                read()
            assert bad.value.checkpoint_id == two["configurable"]["checkpoint_id"]
            assert isinstance(bad.value, kvmem.errors.IntegrityError)
        with pytest.raises(CheckpointCorrupt):
            list(saver.list({"configurable": {"thread_id": "t"}}))
        older = list(saver.list({"configurable": {"thread_id": "t"}}, before=two))  # time travel past it
        assert [t.checkpoint["channel_values"] for t in older] == [{"doc": "intact", "n": 1}]
        assert older[0].pending_writes == [("task", "n", 5)]


def test_committed_checkpoints_are_never_evicted_by_tier_capacity(tmp_path: Path) -> None:
    rng = random.Random(7)
    with kvmem.Memory(str(tmp_path / "kvmem"), cpu_bytes="1MiB", disk_bytes="2MiB", fsync="never") as mem:
        saver = KVMemSaver(mem)
        payloads, configs, parent = [], [], None
        for i in range(12):  # 12 x 256 KiB of incompressible values: more than both tiers hold
            payloads.append(rng.randbytes(256 * 1024))
            parent = put(saver, "t", {"blob": payloads[-1]}, {"blob": i + 1}, {"blob": i + 1}, parent)
            configs.append(parent)
            mem.store(f"filler-{i}", rng.randbytes(512 * 1024))  # the tiers fill up and evict
        assert mem.stats().evictions > 0
        assert [values_of(saver, c)["blob"] for c in configs] == payloads


KILLED_WRITER = """
import sys, kvmem
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata
from langchain_kvmem import KVMemSaver
with kvmem.Memory(sys.argv[1], fsync="never") as mem:
    saver = KVMemSaver(mem)
    found = saver.get_tuple({"configurable": {"thread_id": "t"}})
    i = 0 if found is None else found.metadata["step"] + 1
    config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    if found is not None:
        config = found.config
    while True:
        versions = {"step": i + 1, "log": i + 1}
        cp = generate_checkpoint(channel_values={"step": i, "log": "x" * (i % 97)}, channel_versions=versions)
        config = saver.put(config, cp, generate_metadata(step=i), versions)
        sys.stdout.write(f"{config['configurable']['checkpoint_id']} {i}\\n")  # one write: a kill cuts no line
        sys.stdout.flush()
        i += 1
"""


def test_a_writer_killed_mid_put_loses_no_acknowledged_checkpoint(tmp_path: Path) -> None:
    path, rng = str(tmp_path / "kvmem"), random.Random(11)
    acknowledged: dict[str, int] = {}
    for _ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", KILLED_WRITER, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
        )
        assert child.stdout is not None
        first = child.stdout.readline()  # started: its first put returned
        assert first, child.stderr.read().decode() if child.stderr else ""
        time.sleep(rng.uniform(0.05, 0.4))  # it puts checkpoints back to back: the kill lands in one
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        for line in (first + out).decode().split("\n")[:-1]:  # NOTE: a line cut short was not acknowledged
            checkpoint_id, step = line.split()
            acknowledged[checkpoint_id] = int(step)
    with kvmem.Memory(path, fsync="never") as mem:
        saver = KVMemSaver(mem)
        for checkpoint_id, step in acknowledged.items():
            found = saver.get_tuple({"configurable": {"thread_id": "t", "checkpoint_id": checkpoint_id}})
            assert found is not None and found.checkpoint["channel_values"] == {"step": step, "log": "x" * (step % 97)}
        steps = [t.metadata["step"] for t in saver.list({"configurable": {"thread_id": "t"}})]
    assert steps == sorted(steps, reverse=True) and set(acknowledged.values()) <= set(steps)
    assert len(steps) <= len(acknowledged) + 3  # at most one unacknowledged (committed, unprinted) per kill


SECOND_PROCESS = """
import json, sys, time, kvmem
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata
from langchain_kvmem import KVMemSaver
with kvmem.Memory(sys.argv[1], fsync="never", **json.loads(sys.argv[2])) as mem:
    saver = KVMemSaver(mem)
    config = {"configurable": {"thread_id": "child", "checkpoint_ns": ""}}
    for i in range(30):
        cp = generate_checkpoint(channel_values={"i": i}, channel_versions={"i": i + 1})
        config = saver.put(config, cp, generate_metadata(step=i), {"i": i + 1})
    deadline = time.time() + 60
    parent = {"configurable": {"thread_id": "parent"}}
    while len(list(saver.list(parent))) < 30 and time.time() < deadline:
        time.sleep(0.05)
    print(json.dumps([t.checkpoint["channel_values"]["i"] for t in saver.list(parent)]))
"""


def test_two_processes_writing_their_threads_see_each_others(tmp_path: Path, catalog: dict[str, str]) -> None:
    path = str(tmp_path / "kvmem")
    with kvmem.Memory(path, fsync="never", **catalog) as mem:
        saver = KVMemSaver(mem)
        child = subprocess.Popen(
            [sys.executable, "-c", SECOND_PROCESS, path, json.dumps(catalog)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        parent = None
        for i in range(30):  # both write at once
            parent = put(saver, "parent", {"i": i}, {"i": i + 1}, {"i": i + 1}, parent, step=i)
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err
        assert json.loads(out) == list(range(29, -1, -1))
        assert [
            t.checkpoint["channel_values"]["i"] for t in saver.list({"configurable": {"thread_id": "child"}})
        ] == list(range(29, -1, -1))


def run_turn(path: str, catalog: dict[str, str], update: dict[str, Any]) -> dict[str, Any]:
    """One turn of tiny_graph's thread in a process of its own; the state after it."""
    done = subprocess.run(
        [sys.executable, str(HERE / "tiny_graph.py"), path, json.dumps(catalog), json.dumps(update)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_state_graph_resumes_in_a_new_process_and_travels_in_time(tmp_path: Path, catalog: dict[str, str]) -> None:
    from tiny_graph import CONFIG, build

    path = str(tmp_path / "kvmem")
    assert run_turn(path, catalog, {"log": ["hello"], "turns": 0}) == {
        "log": ["hello", "think 0", "act 0 after 2"],
        "turns": 1,
    }
    resumed = run_turn(path, catalog, {"log": ["again"]})  # a new process picks the thread up where it was
    assert resumed == {"log": ["hello", "think 0", "act 0 after 2", "again", "think 1", "act 1 after 5"], "turns": 2}

    with kvmem.Memory(path, fsync="never", **catalog) as mem:
        saver = KVMemSaver(mem)
        graph = build(saver)
        history = list(graph.get_state_history(CONFIG))
        assert history[0].values == resumed and len(history) == 8  # input, think, act, end: twice
        before_act = next(s for s in history if s.next == ("act",) and s.values["turns"] == 1)
        rows = saver._rows.counts()
        # time travel: edit the state before the second "act" and run on from there (a fork)
        forked = graph.update_state(before_act.config, {"log": ["edited"]})
        assert graph.invoke(None, forked)["log"][-2:] == ["edited", "act 1 after 6"]
        grown = {name: n - rows[name] for name, n in saver._rows.counts().items()}
        assert grown["checkpoints"] == 2 and grown["blobs"] < grown["channels"]  # "turns" and the rest: shared
        # the original branch is intact and still readable; replaying from a checkpoint re-runs what followed it
        assert graph.get_state(history[0].config).values == resumed
        assert graph.invoke(None, before_act.config) == resumed
        assert graph.get_state(CONFIG).values == resumed  # the replay is the newest checkpoint now
