"""Configuration: defaults -> YAML -> KVMEM_* environment -> keyword arguments, and every refusal."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import kvmem
from kvmem.config import Config, describe, format_size, load_config, parse_size
from kvmem.errors import ConfigError

FIELDS = [f.name for f in dataclasses.fields(Config) if f.name != "sources"]


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# -- defaults ---------------------------------------------------------------------------------
def test_defaults() -> None:
    c = load_config(environ={})
    assert (c.block_size, c.prefetch_depth, c.offload_threshold, c.compression) == (256, 3, 0.7, "fp16")
    assert (c.gpu_bytes, c.cpu_bytes, c.disk_bytes) == (0, 2 * 1024**3, 20 * 1024**3)
    assert (c.fsync, c.write_policy, c.write_back_queue) == ("batch", "through", 64)
    assert (c.catalog_url, c.remote_url, c.tenant_salt, c.strict) == (None, None, "", False)
    assert c.path.endswith("kvmem")
    assert c.resolved_catalog_url == f"sqlite:///{Path(c.path) / 'catalog.sqlite3'}"
    assert dict(c.sources) == {name: "default" for name in FIELDS}
    assert c == Config()


def test_config_is_frozen() -> None:
    c = load_config(environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 128  # type: ignore[misc]


# -- sizes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 * 1024**3),
        ("4 GiB", 4 * 1024**3),
        ("4gib", 4 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("512MiB", 512 * 1024**2),
        ("1.5KiB", 1536),
        ("100", 100),
        ("100B", 100),
        ("2T", 2 * 1000**4),
        ("1TiB", 1024**4),
        (" 8 k ", 8000),
        (1024, 1024),
        (0, 0),
        (2.0, 2),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4XB", "-1", "-1GiB", "lots", "", "GiB", "4 Gi B", "1e3", True, -5, "1,000"])
def test_parse_size_refuses(text: object) -> None:
    with pytest.raises(ConfigError, match="cpu_bytes"):
        parse_size(text, "cpu_bytes")  # type: ignore[arg-type]


def test_format_size() -> None:
    assert format_size(100) == "100 B"
    assert format_size(32 * 1024**2) == "32.0 MiB"
    assert format_size(5 * 1024**5) == "5120.0 TiB"


def test_sizes_as_strings_in_kwargs() -> None:
    c = load_config(environ={}, cpu_bytes="4GiB", disk_bytes="100 GiB", gpu_bytes="512MiB")
    assert (c.cpu_bytes, c.disk_bytes, c.gpu_bytes) == (4 * 1024**3, 100 * 1024**3, 512 * 1024**2)


# -- sources, in order -------------------------------------------------------------------------------
def test_yaml_file(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "kvmem.yaml",
        "block_size: 128\ncpu_bytes: 1GiB\noffload_threshold: 0.5\ncompression: int8+lz4\nstrict: true\n",
    )
    c = load_config(path, environ={})
    assert (c.block_size, c.cpu_bytes, c.offload_threshold, c.compression, c.strict) == (
        128,
        1024**3,
        0.5,
        "int8+lz4",
        True,
    )
    assert c.sources["block_size"] == str(path) and c.sources["prefetch_depth"] == "default"


def test_yaml_from_kvmem_config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(tmp_path / "k.yaml", "prefetch_depth: 9\n")
    monkeypatch.setenv("KVMEM_CONFIG", str(path))
    assert load_config().prefetch_depth == 9
    assert load_config().sources["prefetch_depth"] == str(path)
    other = write_yaml(tmp_path / "other.yaml", "prefetch_depth: 1\n")
    assert load_config(other).prefetch_depth == 1, "an explicit file wins over KVMEM_CONFIG"


def test_empty_yaml_is_all_defaults(tmp_path: Path) -> None:
    assert load_config(write_yaml(tmp_path / "e.yaml", ""), environ={}) == load_config(environ={})


def test_precedence_yaml_env_kwargs(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "k.yaml", "block_size: 128\nprefetch_depth: 5\nfsync: always\n")
    env = {"KVMEM_BLOCK_SIZE": "64", "KVMEM_PREFETCH_DEPTH": "7", "KVMEM_CONFIG": str(path)}
    c = load_config(environ=env, block_size=32)
    assert (c.block_size, c.prefetch_depth, c.fsync) == (32, 7, "always")
    assert c.sources["block_size"] == "argument"
    assert c.sources["prefetch_depth"] == "env KVMEM_PREFETCH_DEPTH"
    assert c.sources["fsync"] == str(path)
    assert c.sources["compression"] == "default"


def test_environment_values_are_coerced() -> None:
    env = {
        "KVMEM_OFFLOAD_THRESHOLD": "0.5",
        "KVMEM_STRICT": "yes",
        "KVMEM_CPU_BYTES": "1GiB",
        "KVMEM_CATALOG_URL": "sqlite:////tmp/x.db",
        "KVMEM_TENANT_SALT": "acme",
        "KVMEM_PATH": "/tmp/kv",
        "KVMEM_WRITE_POLICY": "back",
        "KVMEM_TIER_RETRY_SECONDS": "2.5",
        "KVMEM_UNRELATED": "ignored",
    }
    c = load_config(environ=env)
    assert (
        c.offload_threshold,
        c.strict,
        c.cpu_bytes,
        c.catalog_url,
        c.tenant_salt,
        c.path,
        c.write_policy,
        c.tier_retry_seconds,
    ) == (0.5, True, 1024**3, "sqlite:////tmp/x.db", "acme", "/tmp/kv", "back", 2.5)
    assert load_config(environ={"KVMEM_STRICT": "off"}).strict is False


def test_real_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_BLOCK_SIZE", "512")
    assert load_config().block_size == 512
    assert load_config(environ={}).block_size == 256


def test_replace_validates_and_marks_arguments() -> None:
    c = load_config(environ={"KVMEM_BLOCK_SIZE": "64"})
    d = c.replace(prefetch_depth=8)
    assert (d.block_size, d.prefetch_depth) == (64, 8)
    assert d.sources["block_size"] == "env KVMEM_BLOCK_SIZE" and d.sources["prefetch_depth"] == "argument"
    with pytest.raises(ConfigError, match="prefetch_depth"):
        c.replace(prefetch_depth=-1)
    with pytest.raises(ConfigError, match="unknown setting 'config_file'"):  # load_config's, not a setting
        c.replace(config_file="other.yaml")


def test_describe_lists_every_field_with_its_source(tmp_path: Path) -> None:
    c = load_config(environ={"KVMEM_FSYNC": "never"}, block_size=16)
    rows = {name: (value, source) for name, value, source in describe(c)}
    assert set(rows) == set(FIELDS)
    assert rows["block_size"] == (16, "argument") and rows["fsync"] == ("never", "env KVMEM_FSYNC")


def test_the_remote_password_is_never_shown() -> None:
    c = load_config(environ={"KVMEM_REMOTE_PASSWORD": "s3cret-pw"})
    assert c.remote_password == "s3cret-pw"
    rows = {name: (value, source) for name, value, source in describe(c)}
    assert rows["remote_password"] == ("***", "env KVMEM_REMOTE_PASSWORD")
    assert "s3cret-pw" not in repr(c) and "s3cret-pw" not in str(describe(c))


def test_repr_describe_and_errors_show_no_password_in_urls_or_fields() -> None:
    c = load_config(
        environ={"KVMEM_REMOTE_PASSWORD": "PW-field"},
        tenant_salt="PW-salt",
        remote_url="redis://kvmem:PW-url@127.0.0.1:6399/0?password=PW-query",
        catalog_url="postgresql+psycopg://kvmem:PW-pg@db:5432/kvmem",
    )
    rows = {name: value for name, value, _ in describe(c)}
    assert rows["remote_url"] == "redis://kvmem:***@127.0.0.1:6399/0?password=***"
    assert rows["catalog_url"] == "postgresql+psycopg://kvmem:***@db:5432/kvmem"
    assert rows["remote_password"] == "***" and "remote_password='***'" in repr(c)
    assert rows["tenant_salt"] == "***"
    with pytest.raises(ConfigError) as refused:
        c.replace(block_size=0)  # any refusal of a config holding secrets
    for text in (repr(c), str(c), str(describe(c)), str(refused.value)):
        assert "PW-" not in text, text
    assert c.remote_url.endswith("PW-query") and c.remote_password == "PW-field"  # the tiers still get them


def test_memory_takes_config_file_and_settings(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "k.yaml", f"path: {tmp_path / 'data'}\ncpu_bytes: 1MiB\ndisk_bytes: 2MiB\n")
    with kvmem.Memory(config_file=str(path), fsync="never") as mem:
        assert (mem.config.cpu_bytes, mem.config.disk_bytes) == (1024**2, 2 * 1024**2)
        assert mem.config.path == str(tmp_path / "data")
        assert mem.config.sources["fsync"] == "argument"
        assert [t.capacity for t in mem._tiers.tiers] == [1024**2, 2 * 1024**2]
    assert (tmp_path / "data" / "catalog.sqlite3").exists()


def test_memory_from_config_object(tmp_path: Path) -> None:
    base = load_config(environ={}, path=str(tmp_path / "d"), cpu_bytes="1MiB", disk_bytes=0)
    with kvmem.Memory(config=base, prefetch_depth=0) as mem:
        assert mem.config.cpu_bytes == 1024**2 and mem.config.prefetch_depth == 0
        assert [t.name for t in mem._tiers.tiers] == ["cpu"]


# -- refusals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0),
        ("block_size", 65537),
        ("block_size", -1),
        ("block_size", 1.5),
        ("block_size", "abc"),
        ("block_size", True),
        ("prefetch_depth", -1),
        ("prefetch_depth", 2000),
        ("prefetch_depth", "x"),
        ("offload_threshold", 0),
        ("offload_threshold", 1.5),
        ("offload_threshold", -0.1),
        ("offload_threshold", "most"),
        ("compression", "gzip"),
        ("compression", "int8+int4"),
        ("compression", 8),
        ("fsync", "sometimes"),
        ("write_policy", "sideways"),
        ("write_back_queue", 0),
        ("tier_retry_seconds", -1),
        ("cpu_bytes", "lots"),
        ("disk_bytes", -1),
        ("gpu_bytes", "1XB"),
        ("strict", "maybe"),
        ("strict", 5),
        ("tenant_salt", 5),
        ("catalog_url", 5),
        ("remote_url", ["redis://x"]),
        ("path", 5),
        ("fsync", None),
        ("pin_lease_seconds", 0),
        ("pin_lease_seconds", "soon"),
        ("remote_password", 1234),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(environ={}, **{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", "0"),
        ("offload_threshold", "2"),
        ("strict", "maybe"),
        ("cpu_bytes", "4 gigs"),
        ("prefetch_depth", "three"),
    ],
)
def test_invalid_environment_values_name_the_field(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(environ={f"KVMEM_{field.upper()}": value})


@pytest.mark.parametrize(
    "text, match",
    [
        ("block_size: 0\n", "block_size"),
        ("fsync: maybe\n", "fsync"),
        ("block_size: [1, 2]\n", "block_size"),
        ("cpu_bytes: huge\n", "cpu_bytes"),
        ("blocksize: 128\n", "blocksize"),
        ("- a\n- b\n", "mapping"),
        ("block_size: [\n", "not valid YAML"),
    ],
)
def test_invalid_yaml_is_refused(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write_yaml(tmp_path / "bad.yaml", text), environ={})


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_unknown_keys_refused() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'blocksize'") as info:
        load_config(environ={}, blocksize=128)
    assert "block_size" in str(info.value), "the message lists the accepted settings"
    with pytest.raises(ConfigError, match="sources"):
        load_config(environ={}, sources={})


def test_all_tiers_empty_is_refused() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes"):
        load_config(environ={}, cpu_bytes=0, disk_bytes=0, gpu_bytes=0)


def test_bad_catalog_url_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="catalog_url"):
        kvmem.Memory(str(tmp_path), catalog_url="not a url at all")
    with pytest.raises(ConfigError, match="catalog_url"):
        kvmem.Memory(str(tmp_path), catalog_url="mysql://localhost/db")


def test_unknown_remote_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="remote_url"):
        kvmem.Memory(str(tmp_path), remote_url="ftp://example/kv")


@pytest.mark.parametrize(
    "setting, url, needle",
    [
        ("remote_url", "memcached://kvmem:PW-1@127.0.0.1:11211/0", "scheme 'memcached' is not supported"),
        ("remote_url", "redis://kvmem:PW-1@127.0.0.1:1/0?ttl=soon", "ttl"),
        ("catalog_url", "mysql://kvmem:PW-1@127.0.0.1/kvmem", "backend 'mysql' is not supported"),
        ("catalog_url", "postgresql+psycopg://kvmem:PW-1@127.0.0.1:port/kvmem", "cannot be parsed"),
        ("catalog_url", "postgresql+psycopg://kvmem:PW-1@PW-2@127.0.0.1:1/kvmem", "percent-encode an @"),
        ("catalog_url", "postgresql+psycopg://kvmem:PW-1@PW-2:PW-3@127.0.0.1/kvmem", "cannot be parsed"),
        ("catalog_url", "not a url, kvmem:PW-1@127.0.0.1", "cannot be parsed"),
    ],
)
def test_refused_urls_do_not_show_their_password(tmp_path: Path, setting: str, url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as refused:
        kvmem.Memory(str(tmp_path), **{setting: url}, remote_password="PW-field")
    assert f"{setting}=" in str(refused.value) and "kvmem:***@" in str(refused.value)
    assert "PW-" not in str(refused.value), refused.value
