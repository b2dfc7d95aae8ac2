#!/usr/bin/env bash
# The wheels that the lent GPU machine's image lacks for kvmem (it has torch, numpy, safetensors, PyYAML, tqdm,
# filelock, prometheus-client, pytest, hypothesis; nothing can be installed from a registry there).
# Run here, where pip reaches an index: downloads CPython 3.12 x86-64 wheels (the image's python3) into
# .gpu-wheels/ (git-ignored), which a device run carries and installs with
#   python3 -m pip install -q --no-deps --no-index .gpu-wheels/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e .
# transformers: the kv layer needs >= 5.19; the image has 5.17.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .gpu-wheels \
    lz4 crc32c "sqlalchemy>=2.0" alembic mako platformdirs "transformers>=5.19,<5.20"
ls .gpu-wheels
