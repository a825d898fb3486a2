"""Shared by the tests that lower GPU programs on this CPU host (tests/model/test_moe_gemm.py,
tests/train/test_gpu_lowering.py)."""

import jax
import pytest

# jax >= 0.11 lowers a Pallas-Triton kernel for the GPU that the abstract mesh names (`sharding.target_platform`
# sets a one-GPU abstract mesh for that). Inside `shard_map` over a mesh of this host's CPU devices the abstract
# mesh is that mesh's ("No supported GPU devices found"), so a multi-device cross-lowering needs GPU devices;
# the real run has them. These cases are cross-lowered on jax 0.10 (CI's stack: Python 3.11, tokamax 0.0.12).
NEEDS_GPU_MESH = pytest.mark.skipif(
  jax.__version_info__ >= (0, 11) and jax.default_backend() != "gpu",
  reason="jax >= 0.11 cross-lowers Pallas-Triton inside shard_map only over GPU devices (tests/cross_lowering.py)",
)
