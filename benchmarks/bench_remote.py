"""kvmem's Redis tier side by side with the machine's limit on the same server and the same bytes.

Not a test: a measurement. On a throwaway ``redis-server`` (loopback, no persistence)
started for the run:

=========================  ===============================================  ======
operation                  reference                                        target
=========================  ===============================================  ======
redis store                redis-py ``client.set(key, blob_bytes)``         >= 0.8
redis load                 raw ``GET`` into a preallocated buffer           >= 0.8
redis load into out=       raw ``GET`` into a preallocated buffer           >= 0.8
=========================  ===============================================  ======

The raw ``GET`` is the most a load can get from this server: the command sent on a plain socket of its own,
the reply received with ``recv_into`` into a buffer allocated and touched once, nothing parsed but the length
line, no CRC. kvmem does more: ``read_verified`` receives the value into a new buffer the caller owns (its
pages are touched for the first time) and CRC32C-checks it as it arrives (header JSON parsed, every
segment's CRC); ``Memory.load(key, out=t)`` reads the header, then receives the tensor's bytes straight into
``t``, checked likewise, through the catalog and the tiered store. ``put`` frames the blob from its parts
(sent from where they lie, without joining them; a cluster client joins them once).

Workload: KV chunks of the Llama-3-8B layout (see bench_store.py: 33.5 MB
blobs, encoded by kvmem's lossless codec), then 64 KiB items (per-op µs).

Then the two-node reuse TTFT: node A prefills a 2048-token prompt through
``PrefixCache`` with this Redis as its remote tier; node B (another ``Memory``,
another directory, a CPU tier too small to keep a chunk, so every chunk comes
from Redis) answers requests that share A's prefix with new 256-token
suffixes. Its time to first token is set beside a plain forward pass of the
whole prompt, and its logits are compared with that pass's.

Usage (from the repository root)::

    python benchmarks/bench_remote.py                 # 8 chunks, 200 small items, median of 5
    python benchmarks/bench_remote.py --quick
    python benchmarks/bench_remote.py --no-ttft        # the tier rows only
    python benchmarks/bench_remote.py --url redis://host:6379/0   # an existing server (keys under bench:)
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import records
import redis
import torch
from bench_store import Row, figures, make_chunk, make_small, side_by_side
from bench_ttft import BLOCK, SUFFIX, Forward, Tokens, build_model
from redis.connection import parse_url
from servers import RedisServer

import kvmem
from kvmem import content_hash
from kvmem.codecs import parse_codec
from kvmem.codecs.serialization import encode_value
from kvmem.kv import PrefixCache
from kvmem.stores.redis import RedisTier

TARGET = 0.8
RAW_GET = "raw GET into a preallocated buffer"


class RawGet:
    """The machine's limit for a load: ``GET`` sent on a plain socket of its own, the reply received with
    ``recv_into`` into a buffer allocated and touched once (nothing parsed but the length line, no CRC).

    Raises:
        SystemExit: a TLS URL (``rediss://``): the reference speaks plain TCP.
    """

    def __init__(self, url: str, largest: int) -> None:
        if url.startswith("rediss"):
            raise SystemExit("the raw GET reference needs a redis:// URL (no TLS)")
        opts = parse_url(url)
        self.sock = socket.create_connection((opts.get("host", "127.0.0.1"), int(opts.get("port", 6379))))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = np.ones(largest + 64, dtype=np.uint8)  # NOTE: touched: no page faults in the timed reads
        self.view = memoryview(self.buf.data)
        if opts.get("password"):
            self._call("AUTH", *[x for x in (opts.get("username"), opts["password"]) if x])
        if opts.get("db"):
            self._call("SELECT", str(opts["db"]))

    def _call(self, *args: str) -> None:
        self.sock.sendall(b"".join([b"*%d\r\n" % len(args), *(b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in args)]))
        if not self.sock.recv(256).startswith(b"+"):
            raise SystemExit(f"the raw GET reference: {args[0]} refused")

    def get(self, key: str) -> int:
        """``key``'s value into the buffer: its length."""
        self.sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key.encode()))
        got = self.sock.recv_into(self.view, 64)
        line_end = bytes(self.view[:got]).index(b"\r\n")
        n = int(bytes(self.view[1:line_end]))
        want = line_end + 2 + n + 2
        while got < want:
            got += self.sock.recv_into(self.view[got:want])
        return n

    def close(self) -> None:
        self.sock.close()


def rows_for(tier: RedisTier, url: str, values: list[torch.Tensor], label: str, repeat: int) -> list[Row]:
    """Store and load rows for ``values`` (each one tensor), kvmem beside raw redis-py ``SET`` and the raw ``GET``
    limit: the tier's ``put`` and ``read_verified``, and a load into a tensor of the value's shape and dtype
    (``Memory.load(out=)``, over the same server)."""
    blobs = [encode_value(v, parse_codec("none"))[0] for v in values]
    raw = [b.to_tensor().numpy().tobytes() for b in blobs]
    keys = [content_hash(f"bench-{label}-{i}") for i in range(len(values))]
    client = tier.client
    limit = RawGet(url, max(len(r) for r in raw))
    remote = url + ("&" if "?" in url else "?") + "prefix=bench-mem:"
    mem = kvmem.Memory(tempfile.mkdtemp(prefix="kvmem-bench-remote-"), cpu_bytes=0, disk_bytes=0, remote_url=remote)
    outs = [torch.empty_like(v) for v in values]
    for k, v in zip(keys, values):
        mem.store(k, v, compression="none")

    def kv_put() -> None:
        for k, b in zip(keys, blobs):
            tier.put(k, b)

    def raw_put() -> None:
        for k, b in zip(keys, raw):
            client.set("raw:" + k, b)

    def kv_get() -> None:
        for k in keys:
            assert tier.read_verified(k) is not None

    def kv_load_out() -> None:
        for k, out in zip(keys, outs):
            assert mem.load(k, out=out) is out

    def raw_get() -> None:
        for k in keys:
            assert limit.get("raw:" + k)

    size, n = len(raw[0]), len(values)
    try:
        put = side_by_side(kv_put, raw_put, repeat)
        get = side_by_side(kv_get, raw_get, repeat)
        into = side_by_side(kv_load_out, raw_get, repeat)
        assert all(torch.equal(out, v) for out, v in zip(outs, values))
    finally:
        client.delete(*["raw:" + k for k in keys], *[tier.prefix + k for k in keys])
        for k in keys:
            mem.delete(k)
        mem.close()
        limit.close()
    return [
        Row(f"redis store {label}", "redis-py SET", size, n, *put, TARGET),
        Row(f"redis load {label}", RAW_GET, size, n, *get, TARGET),
        Row(f"redis load {label} into out=", RAW_GET, size, n, *into, TARGET),
    ]


def report(rows: list[Row]) -> None:
    print(f"{'operation':<30} {'size':>10} {'kvmem':>12} {'reference':>12} {'ratio':>6} {'best':>6}  target  reference")
    for r in rows:
        if r.size >= 1 << 20:
            kv, base = f"{r.gbps(r.kvmem_s):.2f} GB/s", f"{r.gbps(r.baseline_s):.2f} GB/s"
        else:
            kv, base = f"{r.us_per_op(r.kvmem_s):.0f} us/op", f"{r.us_per_op(r.baseline_s):.0f} us/op"
        print(
            f"{r.operation:<30} {r.size:>10} {kv:>12} {base:>12} {r.ratio:>6.2f} {r.best_ratio:>6.2f}  "
            f">= {r.target} {r.verdict}  {r.baseline}"
        )


def two_node_ttft(url: str, prefix_len: int, repeat: int) -> dict[str, object]:
    """Node B's TTFT on prompts sharing node A's prefix (chunks from Redis) vs a plain forward pass."""
    model = build_model("55m", torch.float32, prefix_len + SUFFIX)
    tokens, forward = Tokens(7), Forward(model)
    prefix = tokens(prefix_len)
    remote = url + ("&" if "?" in url else "?") + f"prefix=bench-ttft-{time.monotonic_ns()}:"
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-nodes-") as tmp:
        node = {"remote_url": remote, "disk_bytes": 0, "fsync": "never"}
        with kvmem.Memory(f"{tmp}/a", cpu_bytes="1GiB", **node) as mem_a:
            pc = PrefixCache(model, mem_a, block_size=BLOCK, compression="none")
            pc.prefill(torch.cat([prefix, tokens(SUFFIX)], 1), logits_to_keep=1)
            pc.close()
        with kvmem.Memory(f"{tmp}/b", cpu_bytes="1MiB", **node) as mem_b:  # NOTE: no chunk fits: all from Redis
            pc = PrefixCache(model, mem_b, block_size=BLOCK, compression="none")
            plain, mine, worst = [], [], 0.0
            for _ in range(repeat):
                ids = torch.cat([prefix, tokens(SUFFIX)], 1)
                start = time.perf_counter()
                want = forward(ids)
                plain.append(time.perf_counter() - start)
                start = time.perf_counter()
                got = pc.prefill(ids, logits_to_keep=1)
                mine.append(time.perf_counter() - start)
                if got.reused_tokens != prefix_len:
                    raise SystemExit(f"node B reused {got.reused_tokens} tokens, expected {prefix_len}")
                worst = max(worst, (got.logits[0, -1].float() - want).abs().max().item())
            pc.close()
    a, b = statistics.median(plain), statistics.median(mine)
    print(
        f"two-node reuse TTFT ({prefix_len}-token prefix from node A via Redis + {SUFFIX} new tokens, 55m fp32, "
        f"median of {repeat}): plain forward {a * 1e3:.0f} ms, node B with kvmem {b * 1e3:.0f} ms, "
        f"{a / b:.2f}x faster; logits max |diff| {worst:.1e}"
    )
    return records.figure(
        "two-node-ttft",
        f"TTFT on node B, {prefix_len}-token prefix from node A via Redis + {SUFFIX} new tokens",
        "ms",
        b * 1e3,
        records.ref("plain forward", a * 1e3, a / b),
        ratio="plain time / kvmem time",
        group="two-node reuse (55m Llama, fp32)",
    )


def main() -> None:
    run = records.start("bench_remote")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing Redis (default: a throwaway redis-server)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 chunks, 50 small items, 3 repeats")
    parser.add_argument("--no-ttft", action="store_true", help="skip the two-node reuse TTFT")
    args = parser.parse_args()
    if args.quick:
        args.chunks, args.small, args.repeat = 2, 50, 3
    server = None if args.url else RedisServer(Path(tempfile.mkdtemp(prefix="kvmem-bench-redis-")))
    url = args.url or server.url  # type: ignore[union-attr]
    tier = RedisTier.from_url(url + ("&" if "?" in url else "?") + "prefix=bench:")
    try:
        chunks = [torch.stack(list(make_chunk(i).values())) for i in range(args.chunks)]  # NOTE: one tensor (out=)
        rows = rows_for(tier, url, chunks, "33.5MB", args.repeat)
        rows += rows_for(tier, url, [make_small(i) for i in range(args.small)], "64KiB", args.repeat)
        print(
            f"redis-server {tier.client.info('server')['redis_version']} at {tier.url}, "
            f"redis-py {redis.__version__}, median of {args.repeat}"
        )
        report(rows)
        figs = figures(rows[:3], "33.5 MB KV chunks", small=False) + figures(rows[3:], "64 KiB items", small=True)
        if not args.no_ttft:
            figs.append(two_node_ttft(url, 1024 if args.quick else 2048, args.repeat))
    finally:
        tier.close()
        if server is not None:
            server.stop()
    version = redis.__version__
    records.write(
        run,
        figs,
        headline=[figs[1]["id"], figs[2]["id"], *[f["id"] for f in figs if f["id"] == "two-node-ttft"]],
        machine={"redis-py": version, "redis": "external" if args.url else "throwaway redis-server on loopback"},
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
