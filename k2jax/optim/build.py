"""`muonclip`: Muon + AdamW partitioned by one label function, then QK-Clip, as one optax transform.

  updates, state = opt.update(grads, state, params, max_logits=max_logits_LH)
  params = optax.apply_updates(params, updates)     # == clipped new weights (qk_clip.clip_updates)
  metrics: muonclip_metrics(state) -> {'qk_clipped_heads', 'optim_skipped_steps'}

Branches (labels.py): 'muon' and 'muon_expert' -> scale_by_muon -> add_decayed_weights(wd) ->
scale_by_learning_rate(lr), i.e. W -= lr * (U + wd * W) with decay times the (scheduled) base LR
(ML §2.2); 'adamw' -> optax.adamw with the same LR and decay (Moonlight's betas 0.9/0.95, eps 1e-8).
Why not `optax.contrib.muon` as a whole: besides the momentum/layout differences named in muon.py,
its Adam branch is built with `nesterov=True` (NAdamW, not Moonlight's AdamW) and it labels by ndim
(stacked [L, D] norm gains would go to Muon, [L, D, F] layer stacks to Adam).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from k2jax.optim import labels as labels_lib
from k2jax.optim import muon as muon_lib
from k2jax.optim import qk_clip as qk_lib

_NONFINITE_MODES = ("skip", "error")


class MuonClipState(NamedTuple):
  inner: Any  # optax.partition state of the three branches
  qk_clipped_heads: jax.Array  # int32 [], heads clipped at the last update
  skipped_steps: jax.Array  # int32 [], total steps skipped for non-finite inputs


def muonclip(
  learning_rate: optax.ScalarOrSchedule,
  *,
  weight_decay=0.1,
  momentum=0.95,
  nesterov=True,
  ns_steps=5,
  ns_coeffs=muon_lib.DEFAULT_NS_COEFFS,
  ns_eps=1e-7,
  ns_dtype=None,
  rms_scale=0.2,
  rms_mode="shape",
  mu_dtype=None,
  adam_b1=0.9,
  adam_b2=0.95,
  adam_eps=1e-8,
  qk_clip_tau: float | None = 100.0,
  qk_clip_spec: qk_lib.QKClipSpec | None = None,
  owners: muon_lib.OwnerSharding | None = None,
  on_nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
  """MuonClip (K2 Algorithm 1) for a k2jax param tree (`nnx.state(model, nnx.Param)` or dicts).

  Args:
    learning_rate: float or schedule (e.g. `schedules.wsd_schedule`), shared by Muon and AdamW.
    weight_decay: decoupled decay lambda for both branches, multiplied by the learning rate.
    momentum, nesterov, ns_*, rms_scale, rms_mode, mu_dtype: see `muon.scale_by_muon`.
    adam_b1, adam_b2, adam_eps: AdamW settings for embed, lm_head and norm gains.
    qk_clip_tau: QK-Clip threshold; None disables QK-Clip (plain Muon + AdamW).
    qk_clip_spec: MLA geometry (`QKClipSpec.from_config(cfg)`), required when qk_clip_tau is set.
    owners: distribute whole per-layer matrices over mesh axes for NS (expert matrices always stay
      where they live; see `muon.OwnerSharding`).
    on_nonfinite: a non-finite gradient or max logit 'skip's the step (zero update, state kept,
      `skipped_steps` counted) or raises an 'error' naming the tensors.

  `update(grads, state, params, max_logits=...)` needs params (decay and QK-Clip) and, with QK-Clip,
  max_logits float32 [num_hidden_layers, H] from this step's forward pass (global-batch max).
  """
  if on_nonfinite not in _NONFINITE_MODES:
    raise ValueError(f"on_nonfinite must be one of {_NONFINITE_MODES}, got {on_nonfinite!r}")
  if qk_clip_tau is not None and qk_clip_spec is None:
    raise ValueError(
      "muonclip: qk_clip_tau is set but qk_clip_spec is None; pass QKClipSpec.from_config(cfg) or qk_clip_tau=None"
    )
  muon_kw = dict(
    momentum=momentum,
    nesterov=nesterov,
    ns_steps=ns_steps,
    ns_coeffs=ns_coeffs,
    ns_eps=ns_eps,
    ns_dtype=ns_dtype,
    rms_scale=rms_scale,
    rms_mode=rms_mode,
    mu_dtype=mu_dtype,
  )

  def muon_branch(branch_owners):
    return optax.chain(
      muon_lib.scale_by_muon(owners=branch_owners, layout=True, **muon_kw),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
    )

  inner = optax.partition(
    {
      labels_lib.MUON: muon_branch(owners),
      labels_lib.MUON_EXPERT: muon_branch(None),
      labels_lib.ADAMW: optax.adamw(
        learning_rate, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=weight_decay, mu_dtype=mu_dtype
      ),
    },
    labels_lib.label_params,
  )

  def init_fn(params):
    zero = jnp.zeros([], jnp.int32)
    return MuonClipState(inner=inner.init(params), qk_clipped_heads=zero, skipped_steps=zero)

  def update_fn(grads, state, params=None, *, max_logits=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("muonclip.update needs params (weight decay and QK-Clip act on them)")
    if qk_clip_tau is not None and max_logits is None:
      raise ValueError(
        "muonclip.update needs max_logits=[num_hidden_layers, heads] from the "
        "forward pass when QK-Clip is on (qk_clip_tau is set)"
      )
    finite = _all_finite(grads, max_logits, on_nonfinite)
    updates, inner_state = inner.update(grads, state.inner, params)
    n_clipped = jnp.zeros([], jnp.int32)
    if qk_clip_tau is not None:
      updates = qk_lib.clip_updates(updates, params, max_logits, qk_clip_spec, tau=qk_clip_tau)
      n_clipped = qk_lib.clipped_heads(max_logits, qk_clip_tau)
    # Skipping keeps every buffer as it was; where() (not cond) keeps one traced program.
    keep = lambda new, old: jnp.where(finite, new, old)
    updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
    inner_state = jax.tree.map(keep, inner_state, state.inner)
    return updates, MuonClipState(
      inner=inner_state,
      qk_clipped_heads=jnp.where(finite, n_clipped, 0),
      skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def muonclip_metrics(state: MuonClipState) -> dict:
  """Scalars for the trainer's metrics: qk_clipped_heads and optim_skipped_steps."""
  return {"qk_clipped_heads": state.qk_clipped_heads, "optim_skipped_steps": state.skipped_steps}


def _all_finite(grads, max_logits, mode):
  """Scalar bool: every gradient (and max logit) finite. In 'error' mode, raise naming the tensors."""
  named = [(labels_lib.path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(grads)[0]]
  if max_logits is not None:
    named.append(("max_logits", max_logits))
  flags = jnp.stack([jnp.all(jnp.isfinite(x)) for _, x in named])
  if mode == "error":
    jax.debug.callback(_raise_nonfinite, flags, names=tuple(n for n, _ in named))
  return jnp.all(flags)


def _raise_nonfinite(flags, *, names):
  bad = [n for n, ok in zip(names, flags.tolist()) if not ok]
  if bad:
    raise FloatingPointError(
      f"muonclip: non-finite values in {', '.join(bad)} (on_nonfinite='error'; use 'skip' to drop such steps)"
    )
