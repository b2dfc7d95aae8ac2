"""A throwaway 3-master Redis Cluster on free loopback ports, for the cluster tests.

Three ``redis-server --cluster-enabled yes`` (see :class:`tests.servers.RedisServer`)
joined by ``redis-cli --cluster create ... --cluster-replicas 0``. Missing binaries
fail the test under ``CI`` and skip it elsewhere, like the other servers.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from tests.servers import RedisServer, free_port, missing

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
                self.servers.append(RedisServer(node, "--cluster-enabled", "yes", "--cluster-config-file",
                                                str(node / "nodes.conf"), "--cluster-node-timeout", "2000",
                                                # NOTE: the bus port defaults to port + 10000, past 65535 for
                                                # high free ports: pick one of its own
                                                "--cluster-port", str(free_port())))
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
            raise RuntimeError(f"redis-cli {' '.join(args[:3])} failed ({done.returncode}): "
                               f"{(done.stdout + done.stderr).strip()[-2000:]}")
        return done.stdout

    def wait_ok(self, seconds: float = 30.0) -> None:
        """Until every node's ``CLUSTER INFO`` says ``cluster_state:ok`` and all agree on the slots."""
        deadline = time.monotonic() + seconds
        while True:
            states = [self.cli_run("cluster", "info", port=s.port) for s in self.servers]
            if all("cluster_state:ok" in s and "cluster_slots_assigned:16384" in s for s in states):
                check = subprocess.run([str(self.cli), "--cluster", "check", self.addresses[0]],
                                       check=False, capture_output=True, text=True, timeout=60)
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
        import redis

        from_port = self.owner(slot)
        if from_port == to_port:
            return 0
        clients = {s.port: redis.Redis(port=s.port) for s in self.servers}
        try:
            source, target = clients[from_port], clients[to_port]
            source_id, target_id = self.node_id(from_port), self.node_id(to_port)
            target.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
            source.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
            moved = 0
            while keys := source.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
                source.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
            for port in (to_port, from_port, *(p for p in clients if p not in (from_port, to_port))):
                clients[port].execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        finally:
            for client in clients.values():
                client.close()
        deadline = time.monotonic() + 30
        while any(self._owner_seen_by(port, slot) != to_port for port in clients):
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {slot}: not every master sees it on {to_port}")
            time.sleep(0.05)
        return moved

    def _owner_seen_by(self, port: int, slot: int) -> int | None:
        import redis

        with redis.Redis(port=port) as client:
            for start, stop, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= stop:
                    return int(master[1])
        return None

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
