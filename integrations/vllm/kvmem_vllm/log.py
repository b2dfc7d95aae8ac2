"""The connector's logger: a child of vLLM's, so vLLM's handler shows its lines beside the engine's."""

from __future__ import annotations

import logging

__all__ = ["logger"]

logger = logging.getLogger("vllm").getChild("kvmem")
