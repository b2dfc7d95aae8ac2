"""Model identity for KV keys: config plus a cheap hash of sampled weight bytes.

Two models with the same config but different weights (a fine-tune and its
base) get different fingerprints, so they never share KV chunks.
"""

from __future__ import annotations

import hashlib
import json

import torch

__all__ = ["model_fingerprint"]

_SAMPLES_PER_TENSOR = 256
_IGNORED_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "_commit_hash",
        "torch_dtype",
        "dtype",
        "architectures",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_attn_implementation_autoset",
    }
)


def _config_json(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is None:
        return type(model).__name__
    data = {k: v for k, v in config.to_dict().items() if k not in _IGNORED_CONFIG_KEYS}
    return json.dumps({"class": type(model).__name__, "config": data}, sort_keys=True, default=str)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hex digest naming ``model``'s architecture, config and weights.

    Reads ``_SAMPLES_PER_TENSOR`` evenly spaced elements of every parameter and
    buffer (in name order), so it costs milliseconds even for billions of weights,
    yet any fine-tune that moves the weights changes it.
    """
    h = hashlib.sha256(b"kvmem/model/v1")
    h.update(_config_json(model).encode())
    with torch.no_grad():
        for name, tensor in sorted(
            list(model.named_parameters()) + list(model.named_buffers()), key=lambda item: item[0]
        ):
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32)
            h.update(name.encode())
            h.update(str(tuple(tensor.shape)).encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()
