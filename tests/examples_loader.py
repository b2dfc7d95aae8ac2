"""Importing the scripts under ``examples/`` (not a package) into tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(filename: str) -> ModuleType:
    """``examples/<filename>`` imported as a module named after it."""
    spec = importlib.util.spec_from_file_location(Path(filename).stem, EXAMPLES / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
