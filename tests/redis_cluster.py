"""A throwaway 3-master Redis Cluster on free loopback ports, for the cluster tests.

Three ``redis-server --cluster-enabled yes`` (see :class:`tests.servers.RedisServer`)
joined by ``redis-cli --cluster create ... --cluster-replicas 0``. Missing binaries
fail the test under ``CI`` and skip it elsewhere, like the other servers.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tests.servers import RedisServer, free_port, missing

if TYPE_CHECKING:
    import redis

__all__ = ["RedisCluster"]


class RedisCluster:
    """Three masters covering all 16384 slots; :attr:`url` is a ``redis+cluster://`` URL naming all three."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.cli = shutil.which("redis-cli")
        if self.cli is None or shutil.which("redis-server") is None:
            missing("redis-server and redis-cli are not installed")
        self.servers: list[RedisServer] = []
        try:
            for i in range(masters):
                node = workdir / f"node-{i}"
                self.servers.append(
                    RedisServer(
                        node,
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(node / "nodes.conf"),
                        "--cluster-node-timeout",
                        "2000",
                        # NOTE: the bus port defaults to port + 10000, past 65535 for
                        # high free ports: pick one of its own
                        "--cluster-port",
                        str(free_port()),
                    )
                )
            self.cli_run("--cluster", "create", *self.addresses, "--cluster-replicas", "0", "--cluster-yes")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        self.url = "redis+cluster://" + ",".join(self.addresses) + "/"

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.servers]

    def cli_run(self, *args: str, port: int | None = None) -> str:
        """``redis-cli`` with ``args`` (against ``port``, or the first node); its stdout. Raises on failure."""
        argv = [str(self.cli), "-h", "127.0.0.1", "-p", str(port or self.servers[0].port), *args]
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(
                f"redis-cli {' '.join(args[:3])} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr).strip()[-2000:]}"
            )
        return done.stdout

    def wait_ok(self, seconds: float = 30.0) -> None:
        """Until every node's ``CLUSTER INFO`` says ``cluster_state:ok`` and all agree on the slots."""
        deadline = time.monotonic() + seconds
        while True:
            states = [self.cli_run("cluster", "info", port=s.port) for s in self.servers]
            if all("cluster_state:ok" in s and "cluster_slots_assigned:16384" in s for s in states):
                check = subprocess.run(
                    [str(self.cli), "--cluster", "check", self.addresses[0]],
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                if check.returncode == 0 and "[OK] All 16384 slots covered" in check.stdout:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster not ok after {seconds} s: {states}")
            time.sleep(0.1)

    def node_id(self, port: int) -> str:
        return self.cli_run("cluster", "myid", port=port).strip()

    def dbsize(self, port: int) -> int:
        return int(self.cli_run("dbsize", port=port).strip())

    def owner(self, slot: int) -> int:
        """The port of the master serving ``slot`` (as the first node sees it)."""
        found = self._owner_seen_by(self.servers[0].port, slot)
        if found is None:
            raise LookupError(f"slot {slot} is not served")
        return found

    def move_slot(self, slot: int, to_port: int) -> int:
        """Reshard ``slot`` with its keys to the master on ``to_port`` (IMPORTING/MIGRATING, MIGRATE, SETSLOT
        NODE on every master, as ``redis-cli --cluster reshard`` does); the number of keys moved."""
        if self.owner(slot) == to_port:
            return 0
        self.begin_migration(slot, to_port)
        return self.finish_migration(slot, to_port)

    def begin_migration(self, slot: int, to_port: int) -> int:
        """Open a live migration of ``slot`` to the master on ``to_port``: ``IMPORTING`` there, then ``MIGRATING``
        on the owner (which keeps the slot, answering ``ASK`` for the keys it no longer holds); the owner's port."""
        from_port = self.owner(slot)
        if from_port == to_port:
            raise ValueError(f"slot {slot} is already on {to_port}")
        with self.client(to_port) as target:
            target.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", self.node_id(from_port))
        with self.client(from_port) as source:
            source.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", self.node_id(to_port))
        return from_port

    def migrate_keys(self, slot: int, to_port: int, keys: Sequence[str | bytes] | None = None) -> int:
        """``MIGRATE ... KEYS`` of ``slot``'s owner to ``to_port`` (a migration begun): ``keys``, or every key the
        owner still holds in the slot; the number moved."""
        with self.client(self.owner(slot)) as source:
            if keys is not None:
                if keys:
                    source.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
                return len(keys)
            moved = 0
            while batch := source.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
                source.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *batch)
                moved += len(batch)
            return moved

    def keys_in_slot(self, slot: int, port: int) -> set[str]:
        """The keys the master on ``port`` itself holds in ``slot`` (``CLUSTER GETKEYSINSLOT``, no redirect)."""
        with self.client(port) as node:
            found = node.execute_command("CLUSTER GETKEYSINSLOT", slot, 1 << 20)
        return {k.decode() if isinstance(k, bytes) else k for k in found}

    def finish_migration(self, slot: int, to_port: int) -> int:
        """End a migration begun by :meth:`begin_migration`: move the keys left, then ``SETSLOT NODE`` on every
        master (the target first, then the source) and wait until all see the slot there; the number of keys moved."""
        from_port = self.owner(slot)
        moved = self.migrate_keys(slot, to_port)
        target_id = self.node_id(to_port)
        ports = [s.port for s in self.servers]
        for port in (to_port, from_port, *(p for p in ports if p not in (from_port, to_port))):
            with self.client(port) as node:
                node.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        deadline = time.monotonic() + 30
        while any(self._owner_seen_by(port, slot) != to_port for port in ports):
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {slot}: not every master sees it on {to_port}")
            time.sleep(0.05)
        return moved

    @staticmethod
    def client(port: int) -> redis.Redis:
        """A plain (non-cluster) client of the one node on ``port``: it sees ``MOVED``/``ASK`` as errors."""
        import redis

        return redis.Redis(port=port)

    def _owner_seen_by(self, port: int, slot: int) -> int | None:
        with self.client(port) as client:
            for start, stop, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= stop:
                    return int(master[1])
        return None

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
