"""A throwaway ``redis-server`` on a free loopback port: what the benchmarks and the tests start.

Plain Python, no pytest: the benchmarks import it as ``servers`` (their directory is on ``sys.path``), the
tests as ``benchmarks.servers`` (``tests/servers.py`` adds what only tests need: skipping or failing when a
binary is missing, TLS certificates, ACL users, PostgreSQL).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

__all__ = ["RedisServer", "free_port", "stop_group", "wait_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen[bytes], seconds: float = 60.0) -> None:
    """Stop a server started in a process group of its own (``start_new_session=True``): SIGINT to the group
    (a server's clean shutdown), SIGKILL after ``seconds``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_port(port: int, seconds: float = 20.0, alive: Callable[[], bool] = lambda: True) -> None:
    """Until something listens on ``port``; ``RuntimeError`` as soon as ``alive()`` says the server is gone."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


class RedisServer:
    """A ``redis-server`` on a free port with no persistence, started at once; :meth:`stop` and :meth:`start`.

    Args:
        workdir: the server's directory (and its log, ``redis.log``).
        extra: more ``redis-server`` arguments.
        tls: ``redis-server`` arguments naming its certificates (``--tls-cert-file`` ...): when given, the
            server speaks TLS only, on :attr:`port`.
        binary: the ``redis-server`` to run (default: the one on ``PATH``).
        cpus: the cores it runs on (``taskset``; default: wherever the kernel puts it).

    Raises:
        FileNotFoundError: no ``redis-server`` was given or found.

    :attr:`url` names the server without credentials or certificate options (``rediss://`` with ``tls``).
    """

    def __init__(
        self,
        workdir: Path,
        *extra: str,
        tls: Sequence[str] = (),
        binary: str | None = None,
        cpus: Collection[int] = (),
    ) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("redis-server is not installed")
        self.binary, self.workdir, self.extra = found, workdir, list(extra)
        self.port = free_port()
        self.tls = bool(tls)
        if self.tls:
            self.extra += ["--tls-port", str(self.port), *tls]
        self.url = f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"
        self.pin = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start the server; wait until it listens.

        Raises:
            RuntimeError: the server exited (a bad argument...), with the end of its log.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = ["--port", "0"] if self.tls else ["--port", str(self.port)]
        log = self.workdir / "redis.log"
        self._proc = subprocess.Popen(
            [
                *self.pin,
                self.binary,
                *port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--logfile",
                str(log),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_port(self.port, alive=lambda: self._proc is not None and self._proc.poll() is None)
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"redis-server on port {self.port} did not start ({exc}): {tail}") from exc

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None
