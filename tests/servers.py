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
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import servers
from benchmarks.servers import free_port, wait_port

__all__ = [
    "Certificates",
    "PostgresServer",
    "RedisServer",
    "free_port",
    "missing",
    "postgres_binary",
    "scratch_database",
]


def missing(what: str) -> None:
    """Fail under CI, skip elsewhere: ``what`` is not available on this machine."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI must run every area: .ci/run installs and starts it)")
    pytest.skip(what)


@dataclass(frozen=True)
class Certificates:
    """A test CA and, signed by it, a server and a client certificate (EC P-256, for 127.0.0.1 and localhost)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, directory: Path) -> Certificates:
        """Certificates made by ``openssl`` in ``directory`` (fails under CI, skips elsewhere, without it)."""
        openssl = shutil.which("openssl")
        if openssl is None:
            missing("openssl is not installed (needed to make TLS test certificates)")
        directory.mkdir(parents=True, exist_ok=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        ca, ca_key = directory / "ca.crt", directory / "ca.key"
        _openssl(
            openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=kvmem test CA"
        )
        (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for name in ("server", "client"):
            csr = directory / f"{name}.csr"
            _openssl(
                openssl,
                "req",
                *ec,
                "-keyout",
                directory / f"{name}.key",
                "-out",
                csr,
                "-subj",
                f"/CN=kvmem test {name}",
            )
            _openssl(
                openssl,
                "x509",
                "-req",
                "-in",
                csr,
                "-CA",
                ca,
                "-CAkey",
                ca_key,
                "-CAcreateserial",
                "-out",
                directory / f"{name}.crt",
                "-days",
                "2",
                "-extfile",
                directory / "san.cnf",
            )
        return cls(
            ca, directory / "server.crt", directory / "server.key", directory / "client.crt", directory / "client.key"
        )


def _openssl(binary: str, *args: str | Path) -> None:
    done = subprocess.run([binary, *map(str, args)], check=False, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"openssl {args[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


class RedisServer(servers.RedisServer):
    """The benchmarks' throwaway ``redis-server``, with what tests add: ACL users, TLS, and skipping (failing
    under CI) where the binary is missing; :meth:`stop` and :meth:`start` for fault tests.

    Args:
        workdir: the server's directory (and its log, ``redis.log``).
        extra: more ``redis-server`` arguments.
        users: ACL users, each a rule list as in ``redis.conf`` (``"kvmem on >secret ~kvmem:* +@all"``); when
            given, the ``default`` user is off, so a client must log in as one of them.
        tls: serve TLS only, on :attr:`port`, with :attr:`certificates` made under ``workdir/tls``.
        client_certs: with ``tls``, refuse clients without a certificate signed by the test CA.

    :attr:`url` names the server without credentials or certificate options (``rediss://`` with ``tls``).
    """

    def __init__(
        self, workdir: Path, *extra: str, users: Sequence[str] = (), tls: bool = False, client_certs: bool = False
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            missing("redis-server is not installed")
        self.certificates = Certificates.make(workdir / "tls") if tls else None
        args = list(extra)
        if users:
            args += ["--user", "default", "off"]
            for rules in users:
                args += ["--user", *rules.split()]  # NOTE: one argument per rule, as redis.conf splits them
        tls_args: list[str] = []
        if self.certificates is not None:
            c = self.certificates
            tls_args = [
                "--tls-cert-file",
                str(c.server_cert),
                "--tls-key-file",
                str(c.server_key),
                "--tls-ca-cert-file",
                str(c.ca),
                "--tls-auth-clients",
                "yes" if client_certs else "no",
            ]
        super().__init__(workdir, *args, tls=tls_args, binary=binary)


def postgres_binary(name: str) -> str | None:
    """``name`` (``initdb``, ``pg_ctl``) on ``PATH``, else from the newest Debian ``/usr/lib/postgresql/*/bin``."""
    found = shutil.which(name)
    if found is not None:
        return found
    versions = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
        key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0,
    )
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
        done = subprocess.run(prefix + argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data} -c fsync=off"
        self._run([self.pg_ctl, "-D", str(self.data), "-o", options, "-w", "-l", str(self.data / "log"), "start"])
        wait_port(self.port)
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
