"""The step both sides of test_multislice.py run: a tiny model, MuonClip, one fixed batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k2jax.data import PretrainDataConfig, make_pretrain_iter
from k2jax.model import K2Model, presets
from k2jax.optim import QKClipSpec, muonclip
from k2jax.train.step import init_state, make_train_step

CFG = presets.get("tiny", num_hidden_layers=2)


def reference_inputs():
  opt = muonclip(1e-2, qk_clip_tau=0.05, qk_clip_spec=QKClipSpec.from_config(CFG), adam_eps=1e-4)
  state = jax.tree.map(np.asarray, init_state(K2Model(CFG, rngs=nnx.Rngs(0)), opt))
  it = make_pretrain_iter(PretrainDataConfig(seq_len=16, batch_size=8, seed=7))
  return CFG, opt, state, {k: np.asarray(v) for k, v in next(it).items()}


def step_fn(mdef, opt):
  return make_train_step(
    mdef, opt, optax.constant_schedule(1e-2), num_microbatches=1, bias_update_rate=1e-3, qk_clip_tau=0.05
  )


def summarize(new, metrics, replicated=None) -> dict:
  """Loss, gradient norm, clipped heads and a per-leaf sum of the new params, as host numbers (`replicated`:
  a replicated sharding of the mesh the step ran on, so every process can read them)."""
  picked = {"params": new.params, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
  picked["clipped"] = metrics["qk_clipped_heads"]
  sums = jax.jit(lambda t: jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32)), t), out_shardings=replicated)(picked)
  sums = jax.tree.map(lambda x: float(np.asarray(x)), sums)
  return {
    "loss": sums["loss"],
    "grad_norm": sums["grad_norm"],
    "qk_clipped_heads": int(sums["clipped"]),
    "param_sums": {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(sums["params"])[0]},
  }
