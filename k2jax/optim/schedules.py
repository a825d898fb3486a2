"""WSD learning-rate schedule: warmup, stable (constant), cosine decay to a floor (K2 §2.5).

K2: 500 warmup steps to 2e-4, constant for 10T tokens, cosine decay to 2e-5 over 5.5T tokens, at a
global batch of 2^26 tokens (~149k stable and ~82k decay steps). Built from optax schedule pieces.
"""

import optax

K2_GLOBAL_BATCH_TOKENS = 2**26


def wsd_schedule(
  peak_lr: float, *, warmup_steps: int, stable_steps: int, decay_steps: int, final_lr: float, init_lr: float = 0.0
) -> optax.Schedule:
  """Linear warmup init_lr -> peak_lr, constant peak_lr, cosine peak_lr -> final_lr, then final_lr."""
  for name, v in (("warmup_steps", warmup_steps), ("stable_steps", stable_steps), ("decay_steps", decay_steps)):
    if v < 0:
      raise ValueError(f"wsd_schedule: {name} must be >= 0, got {v}")
  if peak_lr <= 0 or not 0 <= final_lr <= peak_lr:
    raise ValueError(
      f"wsd_schedule: need 0 <= final_lr <= peak_lr and peak_lr > 0, got peak_lr={peak_lr}, final_lr={final_lr}"
    )
  pieces = [
    optax.linear_schedule(init_lr, peak_lr, max(warmup_steps, 1)),
    optax.constant_schedule(peak_lr),
    optax.cosine_decay_schedule(peak_lr, max(decay_steps, 1), alpha=final_lr / peak_lr),
  ]
  return optax.join_schedules(pieces, [warmup_steps, warmup_steps + stable_steps])


def k2_schedule(
  *,
  global_batch_tokens: int = K2_GLOBAL_BATCH_TOKENS,
  peak_lr: float = 2e-4,
  final_lr: float = 2e-5,
  warmup_steps: int = 500,
  stable_tokens: float = 10e12,
  decay_tokens: float = 5.5e12,
) -> optax.Schedule:
  """The K2 pretraining WSD schedule with token budgets converted to steps."""
  return wsd_schedule(
    peak_lr,
    warmup_steps=warmup_steps,
    stable_steps=round(stable_tokens / global_batch_tokens) - warmup_steps,
    decay_steps=round(decay_tokens / global_batch_tokens),
    final_lr=final_lr,
  )
