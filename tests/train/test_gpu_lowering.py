"""The whole train step as a GPU would compile it, lowered on this CPU host (`aot.lower_step_for_gpu`):
the GPU choices of every kernel are in the module, and no `ragged_dot` is left for XLA:GPU's dense
rewrite. (The TPU side compiles ahead of time in tests/train/test_aot.py.)"""

import re

import pytest

from configs import k2
from k2jax.train import aot
from tests.cross_lowering import NEEDS_GPU_MESH

TRITON = r"custom_call @__gpu\$xla\.gpu\.triton"


def _text(**model):
  c = k2.get_config("tiny")
  with c.unlocked():
    c.model.compute_dtype = "bfloat16"
    for key, v in model.items():
      c.model[key] = v
  return aot.lower_step_for_gpu(c).as_text()


@NEEDS_GPU_MESH
def test_gpu_train_step_has_the_grouped_gemm_kernels_and_no_ragged_dot():
  pytest.importorskip("tokamax")
  text = _text()
  assert text.count("chlo.ragged_dot") == 0
  kernels = len(re.findall(TRITON, text))
  # The grouped GEMMs of the scanned MoE layer body (gate, up, down; forward + dlhs + drhs each): 9 calls.
  reference = _text(moe_gemm="ragged_dot")
  assert reference.count("chlo.ragged_dot") > 0 and kernels - len(re.findall(TRITON, reference)) == 9
  # The rest are the fused attention's (forward and backward, dense layer and the scanned body): its plain-JAX
  # fallback has none.
  assert kernels > 9 and len(re.findall(TRITON, _text(attention="flash_xla"))) == 9
