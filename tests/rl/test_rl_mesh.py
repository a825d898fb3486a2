"""The RL update on 8 fake CPU devices under every rules preset equals the 1-device update.

One jitted `rl_step` per case (K2 objective with PTX, MuonClip with QK-Clip firing, balancing-bias update); loss,
metrics, updated params, bias and optimizer state of the sharded run match the single-device run to 1e-5 (relative
to each leaf's largest entry). The optimizer state after this first step holds every gradient leaf (Muon's momentum
is the gradient, AdamW's first moment 0.1 x it: checked once, residual 1.2e-7), so the gradients are compared too,
without compiling a second forward and backward beside the step's (that cost ~16 CPU-s a preset).
"""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from k2jax import sharding
from k2jax.model import K2Model, presets
from k2jax.optim import QKClipSpec, muonclip
from k2jax.rl import rl_step
from k2jax.rl.algo import K2LossConfig
from k2jax.train.partition import state_shardings
from k2jax.train.step import ModelDef, init_state

RTOL = 1e-5
ROWS, SEQ, GROUPS, PTX_ROWS = 16, 16, 4, 8
pytestmark = pytest.mark.slow  # one fwd+bwd+Muon compile per preset


@functools.cache
def _setup():
  cfg = presets.get("tiny", num_hidden_layers=2)  # one dense + one MoE layer
  sched = optax.constant_schedule(0.01)
  # Tiny tau: QK-Clip fires. adam_eps 1e-2: AdamW divides by sqrt(v), so an element whose gradient is ~0 would
  # turn float32 summation-order noise (sharded vs not) into a full-size update difference.
  opt = muonclip(sched, qk_clip_tau=1e-3, adam_eps=1e-2, qk_clip_spec=QKClipSpec.from_config(cfg))
  make = lambda: K2Model(cfg, rngs=nnx.Rngs(3))
  state = jax.device_get(init_state(make(), opt))
  mdef = ModelDef.from_model(nnx.eval_shape(make))
  loss_cfg = K2LossConfig(tau=1.0, ptx_coef=0.1, old_logprobs="trainer")
  step = rl_step.make_rl_step(mdef, opt, sched, loss_cfg, num_groups=GROUPS, bias_update_rate=0.01, qk_clip_tau=1e-3)

  rng = np.random.default_rng(0)
  lengths = rng.integers(6, SEQ + 1, ROWS)
  seg = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
  batch = {
    "tokens_BT": (rng.integers(1, cfg.vocab_size, (ROWS, SEQ)) * seg).astype(np.int32),
    "segment_ids_BT": seg,
    "loss_mask_BT": (seg * (np.arange(SEQ)[None] >= 4)).astype(np.float32),
    "rewards_B": rng.integers(0, 2, ROWS).astype(np.float32),
    "group_ids_B": np.repeat(np.arange(GROUPS), ROWS // GROUPS).astype(np.int32),
    "sample_mask_B": np.ones(ROWS, np.float32),
    "engine_logprobs_BT": np.zeros((ROWS, SEQ), np.float32),
  }
  old_BT = jax.device_get(jax.jit(rl_step.make_logprobs_fn(mdef))(state.params, state.bias, batch["tokens_BT"], seg))
  ptx = {
    "tokens_BT": rng.integers(1, cfg.vocab_size, (PTX_ROWS, SEQ)).astype(np.int32),
    "segment_ids_BT": np.ones((PTX_ROWS, SEQ), np.int32),
    "loss_mask_BT": np.ones((PTX_ROWS, SEQ), np.float32),
  }
  ref = jax.device_get(jax.jit(step)(state, batch, old_BT, ptx))
  return cfg, opt, make, state, step, (batch, old_BT, ptx), ref


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) if b.size else 0.0


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
  "preset,shape",
  [
    ("fsdp", {"fsdp": 8}),
    ("fsdp_ep", {"fsdp": 2, "expert": 4}),
    ("fsdp_ep_tp", {"fsdp": 2, "expert": 2, "tensor": 2}),
  ],
)
def test_sharded_rl_step_equals_one_device(preset, shape):
  cfg, opt, make, state, step, (batch, old_BT, ptx), ref = _setup()
  mesh = sharding.make_mesh(shape)
  abstract_state = jax.eval_shape(lambda: init_state(make(), opt))
  sh = state_shardings(nnx.eval_shape(make), abstract_state, mesh, preset)
  put = lambda tree: {k: jax.device_put(v, sharding.batch_sharding(mesh, preset, v.ndim)) for k, v in tree.items()}
  with sharding.use(mesh, preset):
    sharded_state = jax.device_put(state, sh)
    out = jax.jit(step, out_shardings=(sh, None))(
      sharded_state, put(batch), jax.device_put(old_BT, sharding.batch_sharding(mesh, preset)), put(ptx)
    )
  # The state really is sharded: expert weights split as the preset says.
  w = out[0].params["moe_layers"]["moe"]["experts"]["w_gate"]
  assert len({str(s.index) for s in w.addressable_shards}) > 1
  new, metrics = jax.device_get(out)
  new0, metrics0 = ref
  loss, loss0 = metrics["loss"], metrics0["loss"]
  assert _rel(loss, loss0) <= RTOL
  assert int(metrics["qk_clipped_heads"]) == int(metrics0["qk_clipped_heads"]) > 0
  assert bool(metrics["finite"])
  flat = jax.tree_util.tree_flatten_with_path(new)[0]
  flat0 = dict(jax.tree_util.tree_flatten_with_path(new0)[0])
  assert len(flat) == len(flat0)
  for path, x in flat:  # params, bias, optimizer state (the gradients: the module docstring)
    assert _rel(x, flat0[path]) <= RTOL, (jax.tree_util.keystr(path), _rel(x, flat0[path]))
  # The update moved the params and the bias (the comparison above is not of two unchanged states).
  assert _rel(new0.params["lm_head"]["w"], state.params["lm_head"]["w"]) > 1e-4
  assert np.any(np.asarray(new0.bias["moe_layers"]["moe"]["router"]["bias"]) != 0)
