"""Worker processes for the persistence, crash and concurrency tests, and the values they share.

Run as a script (``python tests/workers.py COMMAND ...``); the tests import the
value builders and checkers from here so both sides agree on every byte.

Commands:
    persist-store PATH EXIT     store ``persistence_values()`` and exit (``close`` or ``abort``: os._exit)
    persist-load PATH           load them back, compare bit for bit, print ``OK <n>``
    store-delete-abort PATH     store keys ``kept`` and ``deleted``, delete ``deleted``, then os._exit (no flush)
    crash-zygote PATH           import kvmem once, then fork a storing child per ``run SEED ROUND`` line
    store-many-zygote PATH      the same, each child storing batches with ``store_many`` (``ACK <batch>`` each)
    churn PATH SEED OPS THREADS PEERS   store/load/delete a small key set alongside PEERS-1 other
                                        processes, checking every loaded value
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import kvmem

# -- values that encode their own key and version ------------------------------------------------------


def _seed(key: str, ver: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}/{ver}".encode()).digest()[:8], "little") >> 1


def make_value(key: str, ver: int, max_items: int = 4096) -> dict[str, Any]:
    """A value naming ``key`` and ``ver``, with a payload derived from both (size varies with ``ver``)."""
    n = 64 + _seed(key, ver) % max_items
    data = torch.randint(
        -(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(_seed(key, ver))
    )
    return {"key": key, "ver": ver, "data": data}


def check_value(key: str, value: object, max_items: int = 4096) -> int:
    """The version of ``value`` if it is exactly a value :func:`make_value` made for ``key``.

    Raises:
        AssertionError: ``value`` belongs to another key or its payload is not the one of its version.
    """
    assert isinstance(value, dict) and set(value) == {"key", "ver", "data"}, f"{key}: malformed value {value!r:.200}"
    assert value["key"] == key, f"{key}: got the value of key {value['key']!r}"
    expected = make_value(key, value["ver"], max_items)["data"]
    assert value["data"].dtype == expected.dtype and torch.equal(value["data"], expected), (
        f"{key}: payload of version {value['ver']} is wrong"
    )
    return int(value["ver"])


# -- persistence ---------------------------------------------------------------------------------------


def persistence_values() -> dict[str, tuple[object, dict[str, Any] | None]]:
    """``key -> (value, metadata)``: every kind of value ``store`` accepts, built deterministically."""
    g = torch.Generator().manual_seed(1234)
    f32 = torch.randn(3, 5, 7, generator=g)
    f32[0, 0, 0] = float("nan")
    f32[0, 0, 1] = float("-inf")
    f32[0, 0, 2] = -0.0
    kv = {"k": torch.randn(2, 1, 4, 16, 8, generator=g), "v": torch.randn(2, 1, 4, 16, 8, generator=g)}
    layers = [
        (
            torch.randn(1, 2, 8, 4, generator=g).to(torch.bfloat16),
            torch.randn(1, 2, 8, 4, generator=g).to(torch.bfloat16),
        )
        for _ in range(3)
    ]
    return {
        "t/f32": (f32, {"dim": 7, "note": "nan, -inf, -0.0 inside"}),
        "t/bf16": (torch.randn(64, generator=g).to(torch.bfloat16), None),
        "t/f16": (torch.randn(4, 4, generator=g).to(torch.float16), None),
        "t/f64": (torch.randn(9, generator=g, dtype=torch.float64), None),
        "t/i8": (torch.randint(-128, 127, (33,), dtype=torch.int8, generator=g), None),
        "t/u8": (torch.randint(0, 255, (2, 3), dtype=torch.uint8, generator=g), None),
        "t/i64": (torch.randint(-(2**62), 2**62, (5,), dtype=torch.int64, generator=g), None),
        "t/bool": (torch.rand(17, generator=g) > 0.5, None),
        "t/0d": (torch.tensor(3.25), None),
        "t/empty": (torch.empty(0, 4), None),
        "t/noncontig": (torch.arange(60, dtype=torch.float32).reshape(6, 10).t()[::2], None),
        "kv/dict": (kv, {"layers": 2, "model": "tiny"}),
        "kv/layers": (layers, None),
        "np/f32": (np.arange(24, dtype=np.float32).reshape(2, 3, 4), None),
        "np/u16": (np.array([[1, 65535]], dtype=np.uint16), None),
        "raw/bytes": (bytes(range(256)) * 3, {"source": "bytes"}),
        "raw/empty": (b"", None),
        "text": ("héllo wörld \u2603 \x00 end", None),
        "json": ({"a": 1, "b": [1.5, None, True, "x"], "c": {"d": "e"}}, {"kind": "json"}),
        "versioned": ("second", {"ver": 2}),
    }


def same(a: object, b: object) -> bool:
    """Bit-exact equality of two values: types, dtypes, shapes, structure and every byte."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.contiguous().reshape(-1).view(torch.uint8).tolist()
            == b.contiguous().reshape(-1).view(torch.uint8).tolist()
        )
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def _persist_store(path: str, how: str) -> None:
    mem = kvmem.Memory(path, cpu_bytes="8MiB", disk_bytes="64MiB", fsync="always")
    mem.store("versioned", "first", metadata={"ver": 1})
    for key, (value, meta) in persistence_values().items():
        mem.store(key, value, metadata=meta)
    print("stored", flush=True)
    if how == "abort":
        os._exit(0)  # no close(), no atexit: only what store() made durable survives
    mem.close()


def _store_delete_abort(path: str) -> None:
    mem = kvmem.Memory(path, cpu_bytes="8MiB", disk_bytes="64MiB", fsync="always")
    mem.store("kept", "kept value", metadata={"kept": True})
    mem.store("deleted", "deleted value", metadata={"kept": False})
    assert mem.delete("deleted")
    print("stored", flush=True)
    os._exit(0)  # no close(), no atexit: the catalog rows were never flushed


def _persist_load(path: str) -> None:
    with kvmem.Memory(path, cpu_bytes="8MiB", disk_bytes="64MiB") as mem:
        expected = persistence_values()
        bad = [key for key, (value, _) in expected.items() if not same(mem.load(key), value)]
    print(f"BAD {bad}" if bad else f"OK {len(expected)}", flush=True)
    sys.exit(1 if bad else 0)


# -- crash safety --------------------------------------------------------------------------------------

CRASH_KEYS = [f"crash-{i}" for i in range(16)]


def append_steps(path: str, worker: int, n: int, catalog_url: str | None = None) -> int:
    """Append ``n`` steps to agent session 'race' from this process, resuming on every conflict; the conflicts."""
    from kvmem.agent import AgentSession, SessionConflict

    conflicts = 0
    with kvmem.Memory(path, catalog_url=catalog_url) as mem:
        for i in range(n):
            while True:
                try:
                    AgentSession.resume("race", memory=mem).append_step(f"w{worker} step {i}", "", "")
                    break
                except SessionConflict:
                    conflicts += 1
    return conflicts


def crash_ops(seed: int, round_no: int, n: int = 2_000) -> list[tuple[str, str, int]]:
    """The op sequence of one crash round: ``(op, key, version)`` with op ``store`` or ``delete``."""
    rng = random.Random(seed)
    return [
        ("delete" if rng.random() < 0.15 else "store", rng.choice(CRASH_KEYS), round_no * 1_000_000 + i)
        for i in range(n)
    ]


def _crash_child(path: str, seed: int, round_no: int) -> None:
    mem = kvmem.Memory(path, cpu_bytes="64KiB", disk_bytes="64MiB", fsync="always")
    for i, (op, key, ver) in enumerate(crash_ops(seed, round_no)):
        if op == "store":
            mem.store(key, make_value(key, ver))
        else:
            mem.delete(key)
        sys.stdout.write(f"done {i}\n")
        sys.stdout.flush()


MANY_KEYS = [f"many-{i}" for i in range(12)]
MANY_BATCH = 8


def many_batch(seed: int, round_no: int, batch: int) -> dict[str, int]:
    """Batch ``batch`` (from 0) of a store-many round: ``key -> version`` for 8 of ``MANY_KEYS``."""
    keys = random.Random(f"{seed}/{batch}").sample(MANY_KEYS, MANY_BATCH)
    return {key: round_no * 1_000_000 + batch for key in keys}


def _store_many_child(path: str, seed: int, round_no: int) -> None:
    """``store_many`` one batch after another; ``ACK <batch>`` once each has returned."""
    mem = kvmem.Memory(path, cpu_bytes="64KiB", disk_bytes="64MiB", fsync="always")
    for batch in range(2_000):
        mem.store_many({key: make_value(key, ver) for key, ver in many_batch(seed, round_no, batch).items()})
        sys.stdout.write(f"ACK {batch}\n")
        sys.stdout.flush()


def _crash_zygote(path: str, child: Callable[[str, int, int], None] = _crash_child) -> None:
    """Fork one storing child per ``run SEED ROUND`` line; report ``ready PID`` and ``reaped PID STATUS``.

    NOTE: forking a process that has already imported torch saves the ~3 s import per
    restart; the child is still a separate process, killed by a real SIGKILL.
    """
    warmup = os.path.join(os.path.dirname(path), "zygote-warmup")
    with kvmem.Memory(warmup, cpu_bytes="64KiB", disk_bytes="1MiB", fsync="always") as mem:
        mem.store("warmup", make_value("warmup", 0))  # first-use imports and caches, paid once
        mem.load("warmup")
    for line in sys.stdin:
        _, seed, round_no = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                sys.stdout.write(f"ready {os.getpid()}\n")
                sys.stdout.flush()
                child(path, int(seed), int(round_no))
            finally:
                os._exit(3)  # never reached unless the child failed: the test kills it
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(f"reaped {pid} {status}\n")
        sys.stdout.flush()


# -- concurrency ---------------------------------------------------------------------------------------

CHURN_KEYS = [f"churn-{i}" for i in range(6)]


def churn(mem: kvmem.Memory, seed: int, ops: int, writer_id: int) -> dict[str, int]:
    """Random store / load / delete / contains on ``CHURN_KEYS``; every loaded value is checked.

    Returns:
        How many of each op ran (``load_hits`` counts loads that found a value).
    """
    rng = random.Random(seed)
    done = {"store": 0, "load": 0, "load_hits": 0, "delete": 0, "contains": 0}
    for i in range(ops):
        key = rng.choice(CHURN_KEYS)
        op = rng.choices(["store", "load", "delete", "contains"], weights=[4, 5, 1, 1])[0]
        if op == "store":
            mem.store(key, make_value(key, writer_id * 1_000_000 + i))
        elif op == "load":
            value = mem.load(key)
            if value is not None:
                check_value(key, value)
                done["load_hits"] += 1
        elif op == "delete":
            mem.delete(key)
        else:
            mem.contains(key)
        done[op] += 1
    return done


def _start_together(path: str, seed: int, peers: int) -> None:
    """Wait (up to a minute) until ``peers`` churn processes on ``path`` are ready, so their ops overlap."""
    rendezvous = os.path.join(os.path.dirname(path), "churn-ready")
    os.makedirs(rendezvous, exist_ok=True)
    open(os.path.join(rendezvous, str(seed)), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(rendezvous)) < peers and time.monotonic() < deadline:
        time.sleep(0.01)


def _churn_process(path: str, seed: int, ops: int, threads: int, peers: int) -> None:
    errors: list[BaseException] = []
    mem = kvmem.Memory(path, cpu_bytes="32KiB", disk_bytes="40KiB", fsync="never")
    _start_together(path, seed, peers)

    def run(n: int) -> None:
        try:
            churn(mem, seed * 100 + n, ops, seed * 100 + n)
        except BaseException as exc:  # reported to the test through the exit status
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stats = mem.stats()
    mem.close()
    if errors:
        raise errors[0]
    print(
        f"OK demotions={stats.demotions} evictions={stats.evictions} crc={stats.crc_failures} hits={stats.hits}",
        flush=True,
    )


def main(argv: list[str]) -> None:
    cmd, path, *rest = argv
    if cmd == "persist-store":
        _persist_store(path, rest[0])
    elif cmd == "persist-load":
        _persist_load(path)
    elif cmd == "store-delete-abort":
        _store_delete_abort(path)
    elif cmd == "crash-zygote":
        _crash_zygote(path)
    elif cmd == "store-many-zygote":
        _crash_zygote(path, _store_many_child)
    elif cmd == "churn":
        _churn_process(path, *(int(arg) for arg in rest))
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
