"""Storage tiers and the registry that builds them from a :class:`~kvmem.config.Config`.

Local tiers are built in order (gpu, cpu, disk) from their capacities; the
remote tier is chosen by the scheme of ``remote_url`` from schemes registered
with :func:`register_remote` (the Redis tier registers ``redis://`` and friends).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import torch

from kvmem.config import Config
from kvmem.errors import ConfigError
from kvmem.recovery import OnRecovered
from kvmem.redaction import redact
from kvmem.stores import base
from kvmem.stores.base import *  # noqa: F403  (the tier protocol and its capabilities)
from kvmem.stores.base import StorageTier
from kvmem.stores.cpu import CpuTier
from kvmem.stores.disk import DiskTier
from kvmem.stores.memory import GpuTier
from kvmem.stores.tiered import Fetched, Stored, TieredStore

__all__ = [
    *base.__all__,
    "CpuTier",
    "GpuTier",
    "DiskTier",
    "TieredStore",
    "Fetched",
    "Stored",
    "register_remote",
    "build_tiers",
]

log = logging.getLogger(__name__)

RemoteFactory = Callable[[str, Config], StorageTier]
_REMOTES: dict[str, RemoteFactory] = {}


def register_remote(scheme: str, factory: RemoteFactory) -> None:
    """Make ``remote_url``\\ s of ``scheme`` build their tier with ``factory(url, config)``."""
    _REMOTES[scheme] = factory


def _redis(url: str, config: Config) -> StorageTier:
    try:
        from kvmem.stores.redis import RedisTier  # late import: redis-py is the optional extra kvmem[redis]
    except ImportError as exc:
        raise ConfigError(f"remote_url={redact(url)!r} needs redis-py: pip install 'kvmem[redis]'") from exc
    return RedisTier.from_url(url, config)


register_remote("redis", _redis)
register_remote("rediss", _redis)
register_remote("redis+cluster", _redis)
register_remote("rediss+cluster", _redis)


def _gpu(config: Config) -> StorageTier | None:
    if not config.gpu_bytes:
        return None
    if not torch.cuda.is_available():
        log.warning("kvmem: gpu_bytes=%d but no CUDA device is present; running without a GPU tier", config.gpu_bytes)
        return None
    return GpuTier(config.gpu_bytes, eviction=config.eviction)


def _cpu(config: Config) -> StorageTier | None:
    return CpuTier(config.cpu_bytes, verify=config.cpu_verify, eviction=config.eviction) if config.cpu_bytes else None


def _disk(config: Config, on_recovered: OnRecovered | None = None) -> StorageTier | None:
    if not config.disk_bytes:
        return None
    return DiskTier(Path(config.path) / "disk", config.disk_bytes, config.fsync, on_recovered)


def build_tiers(config: Config, on_recovered: OnRecovered | None = None) -> list[StorageTier]:
    """The tiers ``config`` asks for, fastest first.

    Args:
        config: capacities, paths and ``remote_url``.
        on_recovered: told the label of each damaged metadata file a tier set aside and rebuilt
            (``"areas"``: the disk tier's ``areas.json``; see :mod:`kvmem.recovery`).

    Raises:
        ConfigError: ``remote_url`` has a scheme no tier is registered for.
    """
    tiers = [t for t in (_gpu(config), _cpu(config), _disk(config, on_recovered)) if t is not None]
    if config.remote_url:
        scheme = urlsplit(config.remote_url).scheme
        if scheme not in _REMOTES:
            known = ", ".join(f"{s}://" for s in sorted(_REMOTES)) or "none (install kvmem[redis])"
            raise ConfigError(
                f"remote_url={redact(config.remote_url)!r}: scheme {scheme!r} is not supported; accepted {known}"
            )
        tiers.append(_REMOTES[scheme](config.remote_url, config))
    return tiers
