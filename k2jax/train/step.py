"""The pure train step: `train_step(state, batch) -> (state, metrics)`.

One step = forward/backward over `num_microbatches` microbatches (grads summed, max logits maxed,
expert counts summed), the loss normalised by the loss tokens of the whole global batch (so k
microbatches equal one big batch), one MuonClip update with this step's global max logits, and the
aux-loss-free balancing-bias update from the global expert counts (DeepSeek-V3 §2.1.2):
  b_i += u * sign(mean_j load_j - load_i)        (overloaded experts get a lower bias)
A non-finite loss or gradient skips the whole update (params, optimizer state, bias) and counts it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k2jax.model.layers import RouterBias
from k2jax.model.pipeline import PipelineSpec
from k2jax.model.transformer import K2Model

MODEL_INPUTS = ("input_ids", "segment_ids", "positions")
BATCH_KEYS = ("input_ids", "targets", "segment_ids", "positions", "loss_mask")


class TrainState(NamedTuple):
  step: jax.Array  # int32 []: optimizer steps taken (skipped ones included)
  params: dict  # pure dict of the model's nnx.Param leaves
  bias: dict  # pure dict of RouterBias leaves (never seen by the optimizer)
  opt_state: Any  # muonclip state over `params`
  # int32 []: steps whose update was not applied (non-finite loss/grads, or no signal: the RL metrics count the
  # two apart as `nonfinite` and `dropped`); step - skipped_steps is the optimizer's own count of updates
  skipped_steps: jax.Array


class ModelDef(NamedTuple):
  """Static model structure: the graphdef plus abstract Param / RouterBias states to bind dicts into."""

  graphdef: Any
  params: nnx.State
  bias: nnx.State

  @classmethod
  def from_model(cls, model: K2Model) -> "ModelDef":
    graphdef, params, bias = nnx.split(model, nnx.Param, RouterBias)
    to_abs = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    return cls(graphdef, jax.tree.map(to_abs, params), jax.tree.map(to_abs, bias))

  def bind(self, params: dict, bias: dict) -> K2Model:
    """A model whose variables are `params` / `bias` (traceable: used inside jit)."""
    p, b = jax.tree.map(lambda x: x, self.params), jax.tree.map(lambda x: x, self.bias)
    nnx.replace_by_pure_dict(p, params)
    nnx.replace_by_pure_dict(b, bias)
    return nnx.merge(self.graphdef, p, b)


def init_state(model: K2Model, optimizer: optax.GradientTransformation) -> TrainState:
  """TrainState of a freshly built model (call under jit with out_shardings to init sharded)."""
  _, params, bias = nnx.split(model, nnx.Param, RouterBias)
  params, bias = nnx.to_pure_dict(params), nnx.to_pure_dict(bias)
  zero = jnp.zeros([], jnp.int32)
  return TrainState(zero, params, bias, optimizer.init(params), zero)


def make_train_step(
  mdef: ModelDef,
  optimizer: optax.GradientTransformationExtraArgs,
  schedule: optax.Schedule,
  *,
  num_microbatches: int,
  bias_update_rate: float,
  qk_clip_tau: float | None,
  pipeline: PipelineSpec | None = None,
) -> Callable:
  """The (unjitted) pure step function; the loop jits it with shardings and donation. `pipeline`: each
  (gradient-accumulation) microbatch's forward and backward run as a pipeline (k2jax.model.pipeline)."""

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    grads, loss, aux = accumulate_grads(mdef, state.params, state.bias, batch, num_microbatches, pipeline=pipeline)
    return apply_update(
      state, grads, loss, aux, optimizer, schedule, bias_update_rate=bias_update_rate, qk_clip_tau=qk_clip_tau
    )

  return train_step


def apply_update(
  state: TrainState,
  grads: dict,
  loss: jax.Array,
  aux: dict,
  optimizer: optax.GradientTransformationExtraArgs,
  schedule: optax.Schedule,
  *,
  bias_update_rate: float,
  qk_clip_tau: float | None,
  signal: jax.Array | None = None,
) -> tuple[TrainState, dict]:
  """The one guarded update every loop (pretraining, SFT, RL) ends its step with.

  `aux` carries this step's forward side outputs: `max_logits` (QK-Clip inside MuonClip), `expert_counts`
  (balancing bias) and `tokens`. A non-finite loss or gradient keeps the old params, optimizer state and
  bias, and counts the step in `skipped_steps`. `signal=False` (the caller has proved the objective's gradient
  at the old policy zero: RL's flat batch against the trainer's own pi_old) keeps params and optimizer state
  too, counted in `skipped_steps` and in the metric `dropped`; the balancing bias still moves (it learns the
  forward's expert load, not the objective). Applying such an update would not be a no-op: Muon's update has
  a fixed RMS whatever the gradient's size, so it would step along the orthogonalised stale momentum (or
  rounding noise) once per update of the batch (measured: 24 such updates took a tiny judge's held-out
  agreement from 1.0 to 0.5, bench/critic_loop.py). A step not applied advances neither the optimizer's
  schedule count nor its weight decay (both live in the kept optimizer state). Metrics: `finite`, `signal`,
  `dropped`.

  The optimizer runs inside a `lax.cond` on that finite check (a skipped step applies a zero update and
  keeps the old state; one branch runs, not both and a select). An optimizer state held in host memory
  (`core.layout(offload_opt_state=True)`) is copied to device memory inside the taken branch, so XLA
  cannot start the copy before the gradients exist: outside a branch its scheduler prefetched the state at
  the top of the step and held it through the forward and backward passes (1t on v5p-1024: no HBM saved).
  The new state goes back to host memory.
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  ok = finite if signal is None else finite & signal
  offloaded = _in_host_memory(state.opt_state)

  def update(opt_state, grads):
    if offloaded:
      opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
    updates, new = optimizer.update(grads, opt_state, state.params, max_logits=aux["max_logits"])
    # The state keeps the dtypes optax gave it at init (its moments follow `model.param_dtype`): float32
    # gradients of bfloat16 params (normalised by a float32 token count) would otherwise promote them, and
    # the two branches of the cond, and a donated state, must agree on dtypes.
    opt_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new, opt_state)
    return updates, jax.device_put(opt_state, jax.memory.Space.Host) if offloaded else opt_state

  def skip(opt_state, grads):
    return jax.tree.map(jnp.zeros_like, grads), opt_state

  updates, opt_state = jax.lax.cond(ok, update, skip, state.opt_state, grads)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  params = optax.apply_updates(state.params, updates)
  bias = update_bias(state.bias, aux["expert_counts"], bias_update_rate)
  new_state = TrainState(
    step=state.step + 1,
    params=keep(params, state.params),
    bias=jax.tree.map(lambda n, o: jnp.where(finite, n, o), bias, state.bias),
    opt_state=opt_state,
    skipped_steps=state.skipped_steps + (~ok).astype(jnp.int32),
  )
  metrics = step_metrics(
    aux,
    loss=loss,
    grad_norm=grad_norm,
    updates=updates,
    ok=ok,
    finite=finite,
    params=new_state.params,
    qk_clip_tau=qk_clip_tau,
    lr=schedule(state.step - state.skipped_steps),
    skipped=new_state.skipped_steps,
  )
  if signal is not None:
    metrics["signal"] = jnp.asarray(signal, jnp.int32)
    metrics["dropped"] = (finite & ~signal).astype(jnp.int32)
  return new_state, metrics


def _in_host_memory(tree) -> bool:
  """Whether the (traced) arrays of `tree` live in host memory (all or none: `partition.state_shardings`)."""
  host = [getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host for x in jax.tree.leaves(tree)]
  return bool(host) and all(host)


def accumulate_grads(
  mdef: ModelDef, params: dict, bias: dict, batch: dict, num_microbatches: int, *, pipeline: PipelineSpec | None = None
):
  """(grads, loss, aux) of the token-mean cross entropy over the whole batch.

  Microbatch m takes rows m, m+M, m+2M, ...: each device's contiguous rows split evenly over the
  microbatches, so a batch sharded on rows stays sharded the same way inside every microbatch.
  """
  loss_sum = lambda mdef, params, bias, batch: _loss_sum(mdef, params, bias, batch, pipeline=pipeline)  # noqa: E731
  grad_fn = jax.grad(loss_sum, argnums=1, has_aux=True)
  if num_microbatches == 1:
    grads, aux = grad_fn(mdef, params, bias, batch)
  else:
    micro = jax.tree.map(lambda x: _split_rows(x, num_microbatches), batch)

    def body(carry, mb):
      g, a = grad_fn(mdef, params, bias, mb)
      g_acc, a_acc = carry
      a_new = {
        "loss_sum": a_acc["loss_sum"] + a["loss_sum"],
        "tokens": a_acc["tokens"] + a["tokens"],
        "max_logits": jnp.maximum(a_acc["max_logits"], a["max_logits"]),
        "expert_counts": a_acc["expert_counts"] + a["expert_counts"],
      }
      return (jax.tree.map(jnp.add, g_acc, g), a_new), None

    g0 = jax.tree.map(jnp.zeros_like, params)
    a0 = jax.eval_shape(lambda: grad_fn(mdef, params, bias, jax.tree.map(lambda x: x[0], micro))[1])
    a0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), a0)
    a0["max_logits"] = jnp.full(a0["max_logits"].shape, -jnp.inf, jnp.float32)
    (grads, aux), _ = jax.lax.scan(body, (g0, a0), micro)
  denom = jnp.maximum(aux["tokens"], 1.0)
  grads = jax.tree.map(lambda g: g / denom, grads)
  return grads, aux["loss_sum"] / denom, aux


def _split_rows(x_BT, m: int):
  """[B, ...] -> [m, B/m, ...] with microbatch i = rows i, i+m, i+2m, ..."""
  b = x_BT.shape[0]
  return jnp.swapaxes(x_BT.reshape(b // m, m, *x_BT.shape[1:]), 0, 1)


def _loss_sum(mdef: ModelDef, params: dict, bias: dict, batch: dict, *, pipeline: PipelineSpec | None = None):
  """Sum of next-token cross entropy over loss_mask (float32), plus forward-pass side outputs."""
  model = mdef.bind(params, bias)
  out = model(*(batch[k] for k in MODEL_INPUTS), pipeline=pipeline)
  ce_BT = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["targets"])
  mask_BT = batch["loss_mask"].astype(jnp.float32)
  aux = {
    "loss_sum": jnp.sum(ce_BT * mask_BT),
    "tokens": jnp.sum(mask_BT),
    "max_logits": out.max_logits,
    "expert_counts": out.expert_counts,
  }
  return aux["loss_sum"], aux


def update_bias(bias: dict, counts_LE: jax.Array, rate: float) -> dict:
  """b_i += rate * sign(mean load - load_i) per MoE layer, from global token counts [L_moe, E]."""
  if rate == 0.0 or not jax.tree.leaves(bias):
    return bias
  load_LE = counts_LE.astype(jnp.float32)
  delta_LE = rate * jnp.sign(jnp.mean(load_LE, axis=-1, keepdims=True) - load_LE)
  return jax.tree.map(lambda b: (b + delta_LE).astype(b.dtype), bias)


def step_metrics(aux, *, loss, grad_norm, updates, ok, finite, params, qk_clip_tau, lr, skipped) -> dict:
  """Scalars (and per-layer vectors) the loop logs; all float32/int32 arrays, fetched lazily. `ok`: the
  update was applied; `finite`: loss and gradients were finite (they differ on a no-signal step)."""
  counts_LE = aux["expert_counts"].astype(jnp.float32)
  if counts_LE.size:
    load_LE = counts_LE / jnp.maximum(jnp.mean(counts_LE, axis=-1, keepdims=True), 1.0)
    load_min, load_max = jnp.min(load_LE), jnp.max(load_LE)
  else:  # A model without MoE layers: balance is trivially perfect.
    load_min = load_max = jnp.ones([], jnp.float32)
  max_L = jnp.max(aux["max_logits"], axis=-1)
  clipped = jnp.sum(aux["max_logits"] > qk_clip_tau).astype(jnp.int32) if qk_clip_tau else jnp.zeros([], jnp.int32)
  return {
    "loss": loss,
    "lr": jnp.asarray(lr, jnp.float32),
    "grad_norm": grad_norm,
    "param_norm": optax.tree.norm(params),
    "update_norm": optax.tree.norm(updates),
    "max_attn_logit": jnp.max(max_L),
    "max_attn_logit_per_layer": max_L,
    "qk_clipped_heads": jnp.where(ok, clipped, 0),
    "expert_load_min": load_min,
    "expert_load_max": load_max,
    "skipped_steps": skipped,
    "tokens": aux["tokens"],
    "finite": finite,
  }
