"""Importing the scripts under ``examples/`` and ``benchmarks/`` (folders of scripts, not packages) into tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_example(filename: str) -> ModuleType:
    """``examples/<filename>`` imported as a module named after it."""
    return _load(EXAMPLES / filename)


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as ``name``; its sibling scripts import as modules too."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return _load(BENCHMARKS / f"{name}.py")


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
