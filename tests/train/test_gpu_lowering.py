"""The whole train step as a GPU would compile it, lowered on this CPU host (`aot.lower_step_for_gpu`):
the GPU choices of every kernel are in the module, and no `ragged_dot` is left for XLA:GPU's dense
rewrite. (The TPU side compiles ahead of time in tests/train/test_aot.py.)"""

import re

import pytest

from configs import k2
from k2jax.train import aot

TRITON = r"custom_call @__gpu\$xla\.gpu\.triton"


def _text(**model):
  c = k2.get_config("tiny")
  with c.unlocked():
    c.model.compute_dtype = "bfloat16"
    for key, v in model.items():
      c.model[key] = v
  return aot.lower_step_for_gpu(c).as_text()


def test_gpu_train_step_has_the_grouped_gemm_kernels_and_no_ragged_dot():
  pytest.importorskip("tokamax")
  text = _text()
  assert text.count("chlo.ragged_dot") == 0
  # The scanned MoE layer body: gate, up and down, each forward + dlhs + drhs.
  assert len(re.findall(TRITON, text)) >= 9
  reference = _text(moe_gemm="ragged_dot")
  assert reference.count("chlo.ragged_dot") > 0
