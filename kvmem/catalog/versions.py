"""Pinned versions: a reader keeps the version of a key it pinned while writers move the key on.

Every store of a key makes its catalog row's ``version`` n+1 (:meth:`Catalog.upsert`);
the tiers hold the current version's blob only. :meth:`Versions.pin` records a pin
(key, version, holder, lease expiry) in ``kvmem_pins`` and keeps the pinned version's
blob in ``kvmem_versions``, both in the catalog database: shared by every node on
that catalog, transactional, and never evicted the way tier entries are.

NOTE: the copy is made when a version is first pinned (copy-on-pin), not when a
writer replaces it. A writer then never reads, waits for or even looks at pins:
a store stays one tier put and one catalog upsert, and a version no one pins
costs nothing. A reader pays one copy per pinned version (later pinners of the
same version only add a pin row).

Pins are leases: their holder renews them (a daemon thread, every third of the
lease) while it lives; a node that dies stops renewing, its pins expire, and
:meth:`Versions.collect` (``Memory.gc``) reclaims versions no live pin holds.
Releasing a pin reclaims its version at once when no other pin holds it.

Locking, on SQLite and PostgreSQL alike: every transaction that pins or reclaims a
version first *writes* its ``kvmem_versions`` row (a no-op UPDATE), which locks that
row (PostgreSQL) or the database (SQLite) until commit. The reclaimer counts live pins
only after taking that lock, in a new statement whose snapshot sees every pin
committed before, so a version is never deleted under a pin being made.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from kvmem import blob as blobfmt
from kvmem.catalog.catalog import Catalog, dialect_insert
from kvmem.catalog.schema import pins, versions
from kvmem.codecs.serialization import check_owner, decode_value
from kvmem.errors import ConfigError, IntegrityError, PinExpired, TierUnavailable, VersionConflict
from kvmem.stores.tiered import TieredStore

__all__ = ["Pin", "Versions"]

log = logging.getLogger(__name__)
_ATTEMPTS = 50  # reads of a key being rewritten before pin() gives up (a write lands between row and bytes)
_STALE_AFTER = 5  # mismatching reads after which upper-tier copies are taken for stale ones


class Pin:
    """One pinned version of a key: :meth:`load` returns that version until :meth:`release`.

    Made by :meth:`kvmem.Memory.pin`; a context manager that releases on exit.

    Attributes:
        key: the storage key.
        version: the catalog version pinned.
        crc: the CRC32C naming that version's blob.
    """

    def __init__(self, owner: Versions, pin_id: str, key: str, version: int, crc: int, lease: float) -> None:
        self._owner = owner
        self.id = pin_id
        self.lease = lease
        self.key = key
        self.version = version
        self.crc = crc
        self.released = False

    def load(self, device: torch.device | str | None = None) -> Any:
        """The pinned version's value (from the tiers while it is current, else from the kept copy).

        Raises:
            PinExpired: the pin was released, or its lease ran out and its version was reclaimed.
            IntegrityError: the kept copy is corrupt (it is never returned).
            TierUnavailable: the catalog cannot be reached and the version is no longer current.
        """
        if self.released:
            raise PinExpired(f"pin {self.id} of key {self.key} version {self.version} was released")
        return self._owner.load(self, device)

    def release(self) -> None:
        """Let go of the version (reclaimed now if no other pin holds it). Idempotent."""
        if not self.released:
            self.released = True
            self._owner.release(self)

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Pin(key={self.key[:16]}…, version={self.version}{', released' if self.released else ''})"


class Versions:
    """Pins and kept versions of one memory's keys, in its catalog database.

    Args:
        catalog: the catalog whose rows carry each key's current version and CRC.
        tiers: where current versions are read from.
        lease: seconds a pin lives without renewal (renewed every ``lease / 3`` while held).
    """

    def __init__(self, catalog: Catalog, tiers: TieredStore, lease: float) -> None:
        self.engine: Engine = catalog.engine
        self._catalog = catalog
        self._tiers = tiers
        self.lease = lease
        self.holder = f"{socket.gethostname()[:96]}:{os.getpid()}"
        self._held: dict[str, Pin] = {}
        self._lock = threading.Lock()
        self._nudge = threading.Event()  # set by a new pin (its lease may be the shortest) and by close
        self._closing = False
        self._renewer: threading.Thread | None = None
        self._insert = dialect_insert(self.engine.dialect.name)

    # -- pin / load / release ---------------------------------------------------------------------
    def pin(self, key: str, lease: float | None = None) -> Pin | None:
        """Pin the current version of ``key``; ``None`` if no tier holds it or the catalog has no row.

        Raises:
            ConfigError: ``lease`` is not a number of seconds > 0.
            TierUnavailable: the catalog cannot be reached.
            VersionConflict: the key was rewritten under every one of many attempts to read it.
        """
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float)) or lease <= 0):
            raise ConfigError(f"lease={lease!r}: accepted a number of seconds > 0")
        fetched, first = None, None
        for attempt in range(_ATTEMPTS):
            if fetched is None:  # NOTE: bytes first, then the row: a write puts its bytes, then upserts its row
                fetched, _ = self._tiers.get(key)
                if fetched is None:
                    return None
                crc, first = blobfmt.stored_crc(fetched.buf), None
            self._guard(self._catalog.flush_all)  # stores queue their rows (write-behind): see them first
            row = self._guard(self._catalog.get, key)
            if row is not None and row.crc == crc:
                return self._pinned(
                    Pin(self, uuid.uuid4().hex, key, row.version, crc, lease or self.lease), fetched.buf
                )
            # no match yet. The write of these bytes has not upserted its row (wait for it); or the
            # row moved on past them, two versions or more (read the bytes again); or they are a stale copy
            # this process's upper tiers kept while another process rewrote the key below (drop them).
            if row is not None and first is None:
                first = row.version
            if row is not None and first is not None and row.version >= first + 2:
                fetched = None
            elif attempt % _STALE_AFTER == _STALE_AFTER - 1:
                self._tiers.drop_upper_copies(key)
                fetched = None
            time.sleep(min(0.001 * (attempt + 1), 0.02))
        raise VersionConflict(
            f"key {key}: the catalog's version is not in any tier this memory reads (written by a "
            f"node whose tiers it does not share?) or it was rewritten during each of {_ATTEMPTS} "
            "attempts to pin it"
        )

    def _pinned(self, pin: Pin, buf: torch.Tensor) -> Pin:
        """Record ``pin`` (keeping ``buf``, its version's blob) and renew it while held."""
        self._guard(self._record, pin, buf)
        with self._lock:
            self._held[pin.id] = pin
        self._start_renewer()
        return pin

    def _record(self, pin: Pin, buf: torch.Tensor) -> None:
        """Keep ``pin``'s version (``buf``, unless kept already) and add the pin, in one transaction."""
        with self.engine.begin() as conn:
            while not _lock_version(conn, pin.key, pin.version):  # not kept yet: copy it, then lock it
                conn.execute(
                    self._insert(versions)
                    .values(
                        key=pin.key, version=pin.version, crc=pin.crc, created=time.time(), body=buf.numpy().tobytes()
                    )
                    .on_conflict_do_nothing()
                )
            conn.execute(
                pins.insert().values(
                    id=pin.id, key=pin.key, version=pin.version, holder=self.holder, expires=time.time() + pin.lease
                )
            )

    def load(self, pin: Pin, device: torch.device | str | None) -> Any:
        """``pin``'s value: the tiers' copy when its CRC is still the pinned one, else the kept copy."""
        fetched, _ = self._tiers.get(pin.key)
        if fetched is not None and blobfmt.stored_crc(fetched.buf) == pin.crc:
            value, header = decode_value(fetched.buf, device, fetched.head, copy=not fetched.owned)
            check_owner(header, pin.key)
            return value
        body = self._guard(self._kept, pin)
        if body is None:
            raise PinExpired(
                f"pin {pin.id} of key {pin.key} version {pin.version} expired and its version was "
                f"reclaimed (lease {pin.lease:g} s not renewed in time)"
            )
        buf = blobfmt.empty_buffer(len(body))
        buf.numpy()[:] = memoryview(body).cast("B")
        head = blobfmt.verify(buf)
        if blobfmt.stored_crc(buf) != pin.crc:
            raise IntegrityError(
                f"kept copy of key {pin.key} version {pin.version} names CRC "
                f"{blobfmt.stored_crc(buf):#010x}, the pin {pin.crc:#010x}"
            )
        value, header = decode_value(buf, device, head)
        check_owner(header, pin.key)
        return value

    def _kept(self, pin: Pin) -> bytes | None:
        with self.engine.connect() as conn:
            return conn.execute(
                select(versions.c.body)
                .join(pins, (pins.c.key == versions.c.key) & (pins.c.version == versions.c.version))
                .where(pins.c.id == pin.id)
            ).scalar()

    def release(self, pin: Pin) -> None:
        """Drop ``pin``'s row and reclaim its version if no pin holds it any more.

        A catalog outage only delays this: the pin's lease is no longer renewed,
        so it expires and a later :meth:`collect` reclaims the version.
        """
        with self._lock:
            self._held.pop(pin.id, None)
        try:
            with self.engine.begin() as conn:
                conn.execute(delete(pins).where(pins.c.id == pin.id))
            self._reclaim(pin.key, pin.version, time.time())
        except SQLAlchemyError as exc:  # see above: the unrenewed lease expires; collect() reclaims then
            log.warning("kvmem: releasing pin %s failed (%s); it expires with its lease", pin.id, exc)

    # -- leases and collection --------------------------------------------------------------------
    def renew(self) -> int:
        """Push the expiry of every pin this process holds one lease (its own) ahead; how many were renewed."""
        by_lease: dict[float, list[str]] = {}
        with self._lock:
            for pin in self._held.values():
                by_lease.setdefault(pin.lease, []).append(pin.id)
        renewed = 0
        with self.engine.begin() as conn:
            for lease, ids in by_lease.items():
                renewed += conn.execute(
                    update(pins).where(pins.c.id.in_(ids)).values(expires=time.time() + lease)
                ).rowcount
        return renewed

    def collect(self) -> int:
        """Reclaim kept versions no live pin holds (expired pins are dropped); how many were reclaimed."""
        now = time.time()
        live = (
            select(pins.c.id)
            .where((pins.c.key == versions.c.key) & (pins.c.version == versions.c.version) & (pins.c.expires > now))
            .exists()
        )
        with self.engine.connect() as conn:
            candidates = conn.execute(select(versions.c.key, versions.c.version).where(~live)).all()
        return sum(self._reclaim(key, version, now) for key, version in candidates)

    def _reclaim(self, key: str, version: int, now: float) -> bool:
        """Delete ``(key, version)``'s kept copy and expired pins if no live pin holds it; whether it did."""
        with self.engine.begin() as conn:
            if not _lock_version(conn, key, version):
                return False
            at = (pins.c.key == key) & (pins.c.version == version)
            conn.execute(delete(pins).where(at & (pins.c.expires <= now)))
            if conn.execute(select(func.count()).select_from(pins).where(at)).scalar_one():
                return False
            conn.execute(delete(versions).where((versions.c.key == key) & (versions.c.version == version)))
            return True

    def close(self) -> None:
        """Release every pin still held and stop renewing."""
        with self._lock:
            held = list(self._held.values())
        for pin in held:
            pin.release()
        with self._lock:
            self._closing = True
            renewer = self._renewer
        self._nudge.set()
        if renewer is not None:
            renewer.join()

    def _start_renewer(self) -> None:
        with self._lock:
            if self._renewer is not None and self._renewer.is_alive():
                self._nudge.set()
                return
            self._renewer = threading.Thread(target=self._renew_loop, name="kvmem-pin-renewer", daemon=True)
            self._renewer.start()

    def _renew_loop(self) -> None:
        """Renew held pins every third of the shortest lease; exits when none is held (restarted by the next pin)."""
        while True:
            with self._lock:
                if not self._held or self._closing:
                    self._renewer = None
                    return
                interval = min(pin.lease for pin in self._held.values()) / 3
            self._nudge.wait(interval)
            self._nudge.clear()
            try:
                self.renew()
            except SQLAlchemyError as exc:  # retried next round; a pin outliving its lease may be reclaimed
                log.warning("kvmem: renewing pins failed (%s); retrying in %.1f s", exc, interval)

    @staticmethod
    def _guard(fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a database failure raised as :class:`TierUnavailable`."""
        try:
            return fn(*args)
        except SQLAlchemyError as exc:
            raise TierUnavailable(
                f"pinned versions need the catalog, which failed: {type(exc).__name__}: {getattr(exc, 'orig', exc)}"
            ) from None


def _lock_version(conn: Connection, key: str, version: int) -> bool:
    """Lock ``(key, version)``'s kept row for this transaction (a write that changes nothing); whether it exists."""
    done = conn.execute(
        update(versions)
        .where((versions.c.key == key) & (versions.c.version == version))
        .values(created=versions.c.created)
    )
    return done.rowcount > 0
