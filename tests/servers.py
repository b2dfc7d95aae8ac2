"""Throwaway Redis and PostgreSQL servers on free loopback ports, for tests that need a real engine.

``KVMEM_TEST_REDIS_URL`` / ``KVMEM_TEST_POSTGRES_URL`` point the tests at servers
that already run instead (nothing is started then, and nothing is stopped). A
test that needs a server and finds neither the URL nor the binaries fails when
``CI`` is set (CI must not lose an area silently) and is skipped otherwise.
PostgreSQL refuses to run as root: as root, the server runs as the ``postgres``
user through ``runuser``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["PostgresServer", "RedisServer", "missing", "postgres_binary", "scratch_database"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing(what: str) -> None:
    """Fail under CI, skip elsewhere: ``what`` is not available on this machine."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI must run every area: .ci/run installs and starts it)")
    pytest.skip(what)


def _wait_port(port: int, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


class RedisServer:
    """A ``redis-server`` on a free port with no persistence; :meth:`stop` and :meth:`start` for fault tests."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            missing("redis-server is not installed")
        self.binary, self.workdir, self.extra = binary, workdir, extra
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None


def postgres_binary(name: str) -> str | None:
    """``name`` (``initdb``, ``pg_ctl``) on ``PATH``, else from the newest Debian ``/usr/lib/postgresql/*/bin``."""
    found = shutil.which(name)
    if found is not None:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
                      key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    return str(versions[-1]) if versions else None


@contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    """A fresh, empty database on the server of ``admin_url`` for one test; its URL. Dropped after."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"kvmem_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


class PostgresServer:
    """A PostgreSQL cluster made by ``initdb`` in ``workdir``, trust auth, on a free port."""

    def __init__(self, workdir: Path) -> None:
        initdb, pg_ctl = postgres_binary("initdb"), postgres_binary("pg_ctl")
        if initdb is None or pg_ctl is None:
            missing("PostgreSQL (initdb, pg_ctl) is not installed")
        self._as_owner = os.geteuid() == 0
        if self._as_owner:  # NOTE: pytest's tmp dirs are root-only (0700): the server needs one it can enter
            workdir = Path(tempfile.mkdtemp(prefix="kvmem-pg-"))
            shutil.chown(workdir, "postgres")
        self.workdir = workdir
        self.pg_ctl, self.data, self.port = pg_ctl, workdir / "pgdata", free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.running = False
        workdir.mkdir(parents=True, exist_ok=True)
        self._run([initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
        self.start()

    def _run(self, argv: list[str]) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_owner else []
        done = subprocess.run(prefix + argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data} -c fsync=off"
        self._run([self.pg_ctl, "-D", str(self.data), "-o", options, "-w", "-l", str(self.data / "log"), "start"])
        _wait_port(self.port)
        self.running = True

    def stop(self) -> None:
        """Stop the server now (``-m immediate``: connections drop as in a crash; a restart recovers)."""
        if self.running:
            self._run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"])
            self.running = False

    def remove(self) -> None:
        """Stop the server and delete its cluster."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
