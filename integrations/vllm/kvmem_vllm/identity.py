"""What a kvmem-vllm key names, and the memory a connector opens.

A stored block is only ever loaded into the engine, and for the request, that could have computed it:
its keys live in a namespace naming the model (its config and a sample of its weight files), its
quantization, the model and KV-cache dtypes and the KV-cache scales of its checkpoint, the platform, the
attention backend and vLLM's KV block layout (spec, block size, heads, head size, layer names), the codec
and the chunk size; and a request's chunk hashes fold in its ``cache_salt`` and its LoRA adapter
(:func:`request_scope`). A CPU-layout block therefore never loads into a GPU backend, another model,
another block size, another tenant's request or another adapter's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem.errors import ConfigError
from kvmem_vllm.groups import group_windows
from kvmem_vllm.log import logger

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "ConnectorOptions",
    "attention_backend",
    "chunk_blocks",
    "keyed_tokens",
    "memory_settings",
    "namespace",
    "rank_key",
    "request_scope",
]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 4096
_IGNORED_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash", "architectures"})
# NOTE: the checkpoint tensors vLLM loads as KV-cache scales (weight_utils.maybe_remap_kv_scale_name's names)
_KV_SCALE_NAME = re.compile(r"(?:^|\.)(?:q|k|v|kv|prob)_(?:scale|zero_point)$|\.(?:q|k_cache|v_cache)\.scale$")
_ADAPTER_CONFIG = "adapter_config.json"


LOAD_ASYNC = ("remote", "always", "never")


@dataclasses.dataclass(frozen=True)
class ConnectorOptions:
    """The connector's own keys of ``kv_connector_extra_config`` (every other key is a kvmem Config field).

    Attributes:
        load_async: when a request's stored KV is loaded asynchronously: ``"remote"`` (default: when some of
            it is in no tier of this machine, only in Redis), ``"always"`` or ``"never"``. A request loaded
            asynchronously waits for its KV while others run; one loaded synchronously has it before the
            forward pass of the step that schedules it.
        handoff_wait_s: how long a decode instance waits for the KV a prefill instance said it stored for a
            request (its ``kv_transfer_params``; its saves may still be on their way) before computing the
            rest itself (default 10 s).
    """

    load_async: str = "remote"
    handoff_wait_s: float = 10.0

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any]) -> ConnectorOptions:
        """The options in ``extra_config``.

        Raises:
            ConfigError: a value out of range.
        """
        mode = extra_config.get("load_async", cls.load_async)
        if mode not in LOAD_ASYNC:
            raise ConfigError(f"load_async={mode!r}: expected one of {', '.join(map(repr, LOAD_ASYNC))}")
        wait = extra_config.get("handoff_wait_s", cls.handoff_wait_s)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 600:
            raise ConfigError(f"handoff_wait_s={wait!r}: expected a number of seconds from 0 to 600")
        return cls(str(mode), float(wait))


_CONNECTOR_KEYS = frozenset(f.name for f in dataclasses.fields(ConnectorOptions))


def memory_settings(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`kvmem.Memory` settings in ``kv_connector_extra_config``: every key but the connector's own
    (:class:`ConnectorOptions`) is a Config field.

    Raises:
        ConfigError: ``path`` is missing (a connector never writes to a default directory by surprise).
    """
    settings = {k: v for k, v in extra_config.items() if k not in _CONNECTOR_KEYS}
    if not settings.get("path"):
        raise ConfigError(
            'kv_connector_extra_config has no "path": expected {"path": DIR, ...} with any kvmem Config '
            "field beside it (cpu_bytes, disk_bytes, remote_url, catalog_url, block_size, compression, ...)"
        )
    return settings


def chunk_blocks(chunk_tokens: int, vllm_block_size: int) -> int:
    """vLLM blocks per kvmem chunk.

    Raises:
        ConfigError: ``chunk_tokens`` (kvmem's ``block_size``) is not a whole number of vLLM blocks.
    """
    if chunk_tokens % vllm_block_size:
        raise ConfigError(
            f"block_size={chunk_tokens}: kvmem's chunk must be a whole number of vLLM blocks of "
            f"{vllm_block_size} tokens (e.g. {vllm_block_size} or {2 * vllm_block_size})"
        )
    return chunk_tokens // vllm_block_size


def attention_backend(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """The name of the attention backend of the engine's layers (it decides the layout of a KV block).

    The worker's process has the layers and names their backend; the scheduler's has none and names the
    backend vLLM selects from the config, which the layers have unless one asks for another (then the two
    sides name different keys: nothing is reused, and the worker warns).

    Raises:
        ConfigError: the layers use more than one backend, or the engine is unsupported (see :func:`namespace`).
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    layers = [name for group in kv_cache_config.kv_cache_groups for name in group.layer_names]
    names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config, layers)})
    if len(names) != 1:
        raise ConfigError(f"attention backends {names}: kvmem-vllm supports layers of one attention backend so far")
    selected = get_current_attn_backends(vllm_config, [])[0].get_name()  # NOTE: no layer: vLLM's selection
    if names[0] != selected:
        logger.warning(
            "kvmem: the layers use attention backend %s, the scheduler names %s: no KV is reused", names[0], selected
        )
    return names[0]


def namespace(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, codec: str, chunk_tokens: int, backend: str
) -> str:
    """The namespace of every key this engine stores or loads (the same in the scheduler and the worker).

    Args:
        vllm_config: the engine's config.
        kv_cache_config: its KV cache layout.
        codec: the codec of the stored blocks.
        chunk_tokens: kvmem's chunk, in tokens.
        backend: the attention backend's name (:func:`attention_backend`).

    The tensor-parallel size is part of it (each rank stores its own shard of a block, under the block's key
    and its rank: :func:`rank_key`): a block stored by an engine of one size never loads into another's. So
    are the KV cache groups (:mod:`kvmem_vllm.groups`): their kinds, windows and layers decide a chunk's rows.

    Raises:
        ConfigError: the engine runs pipeline parallel (not supported yet).
        UnsupportedLayout: a KV cache group kvmem-vllm does not store (:func:`kvmem_vllm.groups.group_windows`).
    """
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}: kvmem-vllm supports tensor parallelism "
            "(any tensor_parallel_size), not pipeline parallelism, so far: expected pipeline_parallel_size=1"
        )
    windows = group_windows(kv_cache_config)
    groups = []
    for group, kept in zip(kv_cache_config.kv_cache_groups, windows):
        spec = group.kv_cache_spec
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": spec.block_size,
                "num_kv_heads": getattr(spec, "num_kv_heads", None),
                "head_size": getattr(spec, "head_size", None),
                "head_size_v": getattr(spec, "head_size_v", None),
                "kv_dtype": str(getattr(spec, "dtype", None)),
                "kept": kept,
                "layers": list(group.layer_names),
            }
        )
    layout = {
        "platform": current_platform.device_type,
        "attention_backend": backend,
        "groups": groups,
        "cache_dtype": vllm_config.cache_config.cache_dtype,
        "cache_dtype_skip_layers": list(vllm_config.cache_config.kv_cache_dtype_skip_layers),
        "tensor_parallel_size": parallel.tensor_parallel_size,
    }
    model = vllm_config.model_config
    parts = {
        "model": _model_fingerprint(model.model, model.revision, model.hf_config.to_dict()),
        "quantization": _quantization(model),
        "kv_scales": _kv_scales_fingerprint(model.model),
        "dtype": str(model.dtype),
        "layout": layout,
        "codec": codec,
        "chunk_tokens": chunk_tokens,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return f"vllm/{digest}"


def keyed_tokens(tokens: Sequence[int], mm_features: Sequence[MultiModalFeatureSpec] | None) -> list[int]:
    """A prompt's token ids as its chunk hashes see them: each multimodal input's placeholder tokens (the same
    ids for every image) replaced by values drawn from the input's content hash and position, so the chunks
    from the first placeholder on name the image, the chunks before it are those of the text alone, and a
    different image never shares a chunk's key.

    The values are negative (``-1 - h``, ``h`` 63 bits of ``sha256(modality, hash, index)``): never a token id.
    """
    keyed = list(tokens)
    for feature in mm_features or ():
        digest = feature.mm_hash or feature.identifier
        place = feature.mm_position
        for i in range(place.offset, min(place.offset + place.length, len(keyed))):
            h = hashlib.sha256(f"{feature.modality}/{digest}/{i - place.offset}".encode()).digest()
            keyed[i] = -1 - (int.from_bytes(h[:8], "little") >> 1)
    return keyed


def rank_key(key: str, rank: int) -> str:
    """The key of tensor-parallel rank ``rank``'s shard of the block (or chunk) stored under ``key``."""
    return f"{key}/r{rank}"


def request_scope(cache_salt: str | None, lora: LoRARequest | None) -> str:
    """What a request's KV depends on beyond its tokens and the engine: its cache salt and its LoRA adapter.

    The scheduler folds it into the request's chunk hashes, so two tenants vLLM isolates (different
    ``cache_salt``) or two adapters never share a block; the salt itself is never stored or logged, only
    this digest of it.

    Returns:
        ``""`` for a request with neither (the engine's namespace alone), else a hex digest.
    """
    parts: dict[str, str] = {}
    if cache_salt:
        parts["cache_salt"] = cache_salt
    if lora is not None:
        parts["lora"] = _adapter_fingerprint(lora.lora_name, lora.lora_path)
    if not parts:
        return ""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _quantization(model: ModelConfig) -> dict[str, Any]:
    """The model's quantization: the method vLLM resolved and the user's quantization config (the
    checkpoint's own ``quantization_config`` is part of the model's config)."""
    config = model.quantization_config
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return {"method": model.quantization, "config": config}


def _kv_scales_fingerprint(name: str) -> str:
    """A digest of every KV-cache scale tensor in a local model's safetensors files (``""`` for none).

    NOTE: the weights fingerprint only samples the weight files, and an fp8 KV cache's scales are a few
    bytes among them: these are hashed whole, so blocks quantized with other scales never share a key.
    """
    root = Path(name)
    if not root.is_dir():
        return ""
    h = hashlib.sha256(b"kvmem-vllm/kv-scales/v1")
    found = False
    for path in sorted(root.rglob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            for tensor, meta in sorted(header.items()):
                if tensor == "__metadata__" or not _KV_SCALE_NAME.search(tensor):
                    continue
                start, end = meta["data_offsets"]
                f.seek(8 + size + start)
                h.update(json.dumps([tensor, meta["dtype"], meta["shape"]]).encode() + f.read(end - start))
                found = True
    return h.hexdigest() if found else ""


@functools.lru_cache(maxsize=256)
def _adapter_fingerprint(name: str, path: str) -> str:
    """A digest of a LoRA adapter: its name, its config file and a sample of its weight files.

    NOTE: cached per process: vLLM loads an adapter once and keeps it, so the KV an engine computes with
    it matches the files as they were then.
    """
    root = Path(path)
    config = root / _ADAPTER_CONFIG
    extra = config.read_text() if config.is_file() else ""
    return _model_fingerprint(path, None, {"lora_name": name, _ADAPTER_CONFIG: extra})


def _model_fingerprint(name: str, revision: str | None, hf_config: dict[str, Any]) -> str:
    """A digest of the model's name, revision, config and, for a local directory, a sample of its weight files.

    NOTE: the weights are sampled (``_SAMPLES_PER_FILE`` reads of ``_SAMPLE_BYTES`` evenly spaced in every
    weight file, plus its size), so it costs milliseconds for any model, yet a fine-tune saved over the
    same directory changes it. A hub id is named by id and revision (vLLM resolves its files itself).
    """
    h = hashlib.sha256(b"kvmem-vllm/model/v1")
    config = {k: v for k, v in hf_config.items() if k not in _IGNORED_CONFIG_KEYS}
    h.update(json.dumps({"revision": revision, "config": config}, sort_keys=True, default=str).encode())
    root = Path(name)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES) if root.is_dir() else []
    if not files:
        h.update(name.encode())
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.relative_to(root)}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(_SAMPLES_PER_FILE):
                f.seek(max(0, size - _SAMPLE_BYTES) * i // max(1, _SAMPLES_PER_FILE - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()
