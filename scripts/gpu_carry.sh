#!/usr/bin/env bash
# The wheels bench/gpu.py needs on a GPU machine whose image already holds jax 0.11.2 + the CUDA 13 plugin,
# flax 0.12.10, torch and transformers but reaches no package registry (e.g. an H100/H200 image with Python 3.12,
# x86_64). Run where PyPI is reachable; it fills .gpu_wheels/ (git-ignored) with the packages that image lacks:
#
#   bash scripts/gpu_carry.sh                 # -> .gpu_wheels/*.whl
#
# then, on the GPU machine, from the repo root (the folder travels with the tree):
#
#   pip install -q --no-index --no-deps --target .gpu_deps .gpu_wheels/*.whl
#   PYTHONPATH=$PWD/.gpu_deps:$PWD python3 bench/gpu.py
#
# --no-deps: the image's own jax, flax, numpy, protobuf stay; nothing here replaces them. The list was checked
# by installing exactly these wheels into a Python 3.12 venv holding the image's versions of the rest (jax
# 0.11.2 CPU, flax 0.12.10, optax 0.2.8, orbax-checkpoint 0.12.8, ...) and running `bench/gpu.py --smoke
# --no_hf` and the GPU lowering tests there (docs/install.md, docs/results.md).
# ~40 MB, small enough to copy with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
OUT=${OUT:-.gpu_wheels}
mkdir -p "$OUT"
# k2jax's training path: data (grain, array_record), configs (ml_collections), metrics (tensorboardX); the
# GPU kernels: tokamax 0.0.14, the newest release with Pallas-Triton grouped GEMMs that runs on jax 0.11
# (0.0.12's kernels call `pl.dot`, gone from jax 0.11: AttributeError at trace; 0.0.15+ rewrote the Triton
# grouped GEMM on jax_triton, which the image lacks), and what it imports that the image lacks (xprof, 32 MB,
# imported by `import tokamax`; fire and termcolor for xprof; typeguard 2.13.3 pinned by tokamax).
PKGS=(
  'grain==0.2.18' 'array_record==0.8.6' 'portpicker==1.6.0' 'ml_collections==1.1.0' 'tensorboardX==2.6.5'
  'tokamax==0.0.14' 'typeguard==2.13.3' 'einshape==1.0' 'immutabledict==4.3.1' 'qwix==0.1.8'
  'pydantic==2.14.4' 'pydantic-core==2.50.5' 'annotated-types==0.8.0' 'typing-inspection==0.4.5'
  'xprof==2.24.2' 'fire==0.7.1' 'termcolor==3.3.0'
)
rm -f "$OUT"/*.whl
pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_28_x86_64 \
  -d "$OUT" "${PKGS[@]}"
ls -1 "$OUT"
