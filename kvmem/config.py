"""Configuration: one frozen dataclass, read from defaults -> YAML -> env -> kwargs.

Only this module reads the environment. Every other part of kvmem receives a
:class:`Config` (or values taken from it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import platformdirs
import yaml

from kvmem.errors import ConfigError
from kvmem.redaction import HIDDEN, redact

__all__ = ["Config", "load_config", "parse_size", "format_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

FSYNC_MODES = ("always", "batch", "never")
WRITE_POLICIES = ("through", "back", "around")
EVICTIONS = ("lru", "arc")


def parse_size(value: int | float | str, name: str = "size") -> int:
    """Parse ``"4GiB"``, ``"512 MB"``, ``1024`` into a byte count.

    Raises:
        ConfigError: naming ``name`` and the accepted forms.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: expected a byte count such as 1048576 or '4GiB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{name}={value!r}: must be >= 0")
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{name}={value!r}: expected a byte count such as 1048576 or a size with a unit "
            f"({', '.join(u for u in ('KB', 'KiB', 'MB', 'MiB', 'GB', 'GiB', 'TB', 'TiB'))})"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Human form of a byte count: ``33554432 -> '32.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _default_path() -> str:
    return platformdirs.user_cache_dir("kvmem")


@dataclass(frozen=True)
class Config:
    """Every setting of a :class:`kvmem.Memory`. Sizes are bytes.

    ``sources`` records where each field's value came from (``default``, the YAML
    path, ``env KVMEM_X`` or ``argument``); ``kvmem config`` prints it.
    ``repr`` and ``kvmem config`` show values through :meth:`shown`: no password.
    """

    path: str = field(default_factory=_default_path)
    block_size: int = 256
    prefetch_depth: int = 3
    predictive_prefetch: bool = False
    predictive_prefetch_budget: int = 64 * 1024**2
    offload_threshold: float = 0.7
    eviction: str = "lru"
    compression: str = "fp16"
    gpu_bytes: int = 0
    cpu_bytes: int = 2 * 1024**3
    cpu_verify: bool = False
    disk_bytes: int = 20 * 1024**3
    fsync: str = "batch"
    write_policy: str = "through"
    write_back_queue: int = 64
    catalog_url: str | None = None
    remote_url: str | None = None
    remote_password: str | None = None
    tenant_salt: str = ""
    strict: bool = False
    tier_retry_seconds: float = 5.0
    semantic_hnsw_from: int = 20_000
    pin_lease_seconds: float = 60.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def resolved_catalog_url(self) -> str:
        """The catalog URL: ``catalog_url`` or a SQLite file under ``path``."""
        return self.catalog_url or f"sqlite:///{Path(self.path) / 'catalog.sqlite3'}"

    def shown(self, name: str) -> object:
        """The value of setting ``name`` as kvmem shows it: ``***`` for a set secret, a URL through
        :func:`kvmem.redaction.redact`, anything else as it is."""
        value = getattr(self, name)
        if name in _SECRET_FIELDS and value:
            return HIDDEN
        return redact(value) if name in _URL_FIELDS and isinstance(value, str) else value

    def __repr__(self) -> str:
        """``Config(path=..., ...)`` with every value as :meth:`shown` shows it."""
        settings = ", ".join(f"{f.name}={self.shown(f.name)!r}" for f in fields(self) if f.name != "sources")
        return f"Config({settings})"

    def replace(self, **changes: object) -> Config:
        """A copy with ``changes`` applied (validated, sources marked ``argument``)."""
        return _overridden({name: getattr(self, name) for name in _field_types()}, dict(self.sources), changes)


_SIZE_FIELDS = ("gpu_bytes", "cpu_bytes", "disk_bytes", "predictive_prefetch_budget")
_URL_FIELDS = ("catalog_url", "remote_url")  # NOTE: shown redacted: a URL may hold a password
_SECRET_FIELDS = ("remote_password", "tenant_salt")  # NOTE: shown as *** when set (whoever knows a tenant's
# salt can compute its storage keys)


def _validate(c: Config) -> None:
    from kvmem.codecs import parse_codec  # late import: codecs import config-free modules only

    def bad(name: str, accepted: str) -> ConfigError:
        return ConfigError(f"{name}={c.shown(name)!r}: accepted {accepted}")

    def number(value: object, kinds: tuple[type, ...] = (int,)) -> bool:
        return isinstance(value, kinds) and not isinstance(value, bool)

    if not (number(c.block_size) and 1 <= c.block_size <= 65536):
        raise bad("block_size", "an integer from 1 to 65536 (tokens per chunk)")
    if not (number(c.prefetch_depth) and 0 <= c.prefetch_depth <= 1024):
        raise bad("prefetch_depth", "an integer from 0 to 1024")
    if not isinstance(c.predictive_prefetch, bool):
        raise bad("predictive_prefetch", "true | false")
    if not (number(c.predictive_prefetch_budget) and c.predictive_prefetch_budget >= 1):
        raise bad("predictive_prefetch_budget", "a byte count >= 1 such as '64MiB' (most bytes warmed per request)")
    if not (number(c.offload_threshold, (int, float)) and 0.0 < c.offload_threshold <= 1.0):
        raise bad("offload_threshold", "a fraction in (0, 1]")
    if c.eviction not in EVICTIONS:
        raise bad("eviction", " | ".join(EVICTIONS) + " (the order the GPU and CPU tiers give entries up in)")
    if c.fsync not in FSYNC_MODES:
        raise bad("fsync", " | ".join(FSYNC_MODES))
    if c.write_policy not in WRITE_POLICIES:
        raise bad("write_policy", " | ".join(WRITE_POLICIES))
    if c.write_policy == "around" and not c.disk_bytes and not c.remote_url:
        raise bad(
            "write_policy",
            "through | back without a persistent tier (around stores into disk_bytes > 0 or a remote_url)",
        )
    if not (number(c.write_back_queue) and c.write_back_queue >= 1):
        raise bad("write_back_queue", "an integer >= 1")
    if not (number(c.semantic_hnsw_from) and c.semantic_hnsw_from >= 2):
        raise bad("semantic_hnsw_from", "an integer >= 2")
    if not (number(c.pin_lease_seconds, (int, float)) and c.pin_lease_seconds > 0):
        raise bad("pin_lease_seconds", "a number of seconds > 0")
    if not (number(c.tier_retry_seconds, (int, float)) and c.tier_retry_seconds >= 0):
        raise bad("tier_retry_seconds", "a number of seconds >= 0")
    for name in _SIZE_FIELDS:
        if not number(getattr(c, name)) or getattr(c, name) < 0:
            raise bad(name, "a byte count >= 0 such as '4GiB'")
    if not (isinstance(c.path, str) and c.path):
        raise bad("path", "a directory path")
    if not isinstance(c.strict, bool):
        raise bad("strict", "true | false")
    if not isinstance(c.cpu_verify, bool):
        raise bad("cpu_verify", "true | false")
    if c.metrics_port is not None and not (number(c.metrics_port) and 0 <= c.metrics_port <= 65535):
        raise bad("metrics_port", "a TCP port from 0 (any free one) to 65535, or nothing (no /metrics)")
    if not (isinstance(c.metrics_host, str) and c.metrics_host):
        raise bad("metrics_host", "an address to listen on, such as 127.0.0.1 or 0.0.0.0")
    if not isinstance(c.tenant_salt, str):
        raise bad("tenant_salt", "a string")
    for name in ("catalog_url", "remote_url"):
        if getattr(c, name) is not None and not isinstance(getattr(c, name), str):
            raise bad(name, "a URL string, or nothing")
    if c.remote_password is not None and not isinstance(c.remote_password, str):
        raise ConfigError(f"remote_password of type {type(c.remote_password).__name__}: accepted a string, or nothing")
    if c.cpu_bytes == 0 and c.disk_bytes == 0 and c.gpu_bytes == 0 and not c.remote_url:
        raise ConfigError(
            "gpu_bytes, cpu_bytes and disk_bytes are all 0 and no remote_url: at least one tier needs capacity"
        )
    parse_codec(c.compression, field_name="compression")


def _coerce(name: str, raw: object, kind: type | str) -> object:
    """Turn a YAML or environment value into the field's type."""
    if name in _SIZE_FIELDS:
        return parse_size(raw, name)  # type: ignore[arg-type]
    if raw is None or not isinstance(raw, str):
        return raw
    if kind in (bool, "bool"):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={raw!r}: accepted true|false")
    try:
        if kind in (int, "int"):
            return int(raw)
        if kind in (float, "float"):
            return float(raw)
    except ValueError:
        kind_name = kind if isinstance(kind, str) else kind.__name__
        raise ConfigError(f"{name}={raw!r}: expected {'an' if kind_name == 'int' else 'a'} {kind_name}") from None
    return raw


def _field_types() -> dict[str, str]:
    types = {}
    for f in fields(Config):
        if f.name == "sources":
            continue
        t = str(f.type).removesuffix(" | None")
        types[f.name] = "bool" if t == "bool" else "int" if t == "int" else "float" if t == "float" else "str"
    return types


def load_config(
    config_file: str | os.PathLike[str] | None = None,
    *,
    base: Config | None = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: object,
) -> Config:
    """Build a :class:`Config`: defaults (or ``base``) -> YAML -> ``KVMEM_*`` env -> ``kwargs``.

    Args:
        config_file: a YAML file; when ``None``, ``$KVMEM_CONFIG`` if set. Ignored when ``base`` is given.
        base: start from this config instead of defaults, YAML and environment.
        environ: the environment to read (``os.environ`` by default).
        **kwargs: field overrides; sizes may be strings like ``"4GiB"``.

    Raises:
        ConfigError: an unknown field, or a value outside its accepted range.
    """
    if base is not None:
        return base.replace(**kwargs)
    values, sources = _layered(config_file, os.environ if environ is None else environ)
    return _overridden(values, sources, kwargs)


def _layered(
    config_file: str | os.PathLike[str] | None, env: Mapping[str, str]
) -> tuple[dict[str, object], dict[str, str]]:
    """The values (and their sources) the YAML file and then the ``KVMEM_*`` environment set."""
    types = _field_types()
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    yaml_path = config_file if config_file is not None else env.get("KVMEM_CONFIG")
    if yaml_path:
        for name, raw in _read_yaml(Path(yaml_path), types).items():
            values[name] = _coerce(name, raw, types[name])
            sources[name] = str(yaml_path)
    for name in types:
        raw = env.get(f"KVMEM_{name.upper()}")
        if raw is not None:
            values[name] = _coerce(name, raw, types[name])
            sources[name] = f"env KVMEM_{name.upper()}"
    return values, sources


def _overridden(values: dict[str, object], sources: dict[str, str], changes: Mapping[str, object]) -> Config:
    """A validated :class:`Config` of ``values`` with ``changes`` (source ``argument``) on top."""
    types = _field_types()
    for name, raw in changes.items():
        if name not in types:
            raise ConfigError(f"unknown setting {name!r}: accepted {', '.join(sorted(types))}")
        values[name] = _coerce(name, raw, types[name])
        sources[name] = "argument"
    path = values.get("path")
    if isinstance(path, os.PathLike):
        values["path"] = os.fspath(path)
    for name in types:
        sources.setdefault(name, "default")
    try:
        return Config(**values, sources=sources)  # type: ignore[arg-type]
    except TypeError as exc:  # a value of the wrong type reached a comparison
        raise ConfigError(str(exc)) from None


def _read_yaml(path: Path, types: Mapping[str, str]) -> dict[str, object]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ConfigError(
            f"config file {str(path)!r}: unknown setting(s) {unknown}; accepted {', '.join(sorted(types))}"
        )
    return data


def describe(config: Config) -> list[tuple[str, object, str]]:
    """``(field, value, source)`` rows for ``kvmem config``, values as :meth:`Config.shown` shows them."""
    return [
        (f.name, config.shown(f.name), config.sources.get(f.name, "default"))
        for f in fields(config)
        if f.name != "sources"
    ]
