"""Forward throughput of the tiny and small presets, and MoE-vs-dense cost at equal activated FLOPs.

    python bench/forward.py [--small_seq=256] [--iters=5]

Prints key=value lines: `<preset>_tokens_per_sec=`, and `moe_over_dense=` = time of one MoE layer
(router + dropless dispatch + ragged_dot experts + shared expert) divided by the time of a dense SwiGLU
whose width equals the activated expert width ((top_k + n_shared) * moe_intermediate_size), both measured
here in the same process on the same tokens.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from k2jax.model import K2Model, presets
from k2jax.model.block import MoE
from k2jax.model.layers import SwiGLU

FLAGS = flags.DEFINE_integer("iters", 5, "timed iterations per measurement")
SMALL_SEQ = flags.DEFINE_integer("small_seq", 256, "sequence length for the small preset")


def _time(fn, *args, iters: int) -> float:
  jax.block_until_ready(fn(*args))  # compile + warm up
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def forward_tokens_per_sec(preset: str, batch: int, seq: int, iters: int) -> float:
  cfg = presets.get(preset)
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids).logits)
  ids = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size)
  return batch * seq / _time(fwd, state, ids, iters=iters)


def moe_over_dense(preset: str, tokens: int, iters: int) -> tuple[float, float, float]:
  cfg = presets.get(preset)
  moe = MoE(cfg, stack=None, rngs=nnx.Rngs(0))
  width = (cfg.num_experts_per_tok + cfg.n_shared_experts) * cfg.moe_intermediate_size
  dense = SwiGLU(
    cfg.hidden_size, width, "mlp", stack=None, std=cfg.initializer_range, dtype=jnp.float32, rngs=nnx.Rngs(1)
  )
  x = jax.random.normal(jax.random.key(0), (1, tokens, cfg.hidden_size))
  valid = jnp.ones((1, tokens), bool)
  g_moe, s_moe = nnx.split(moe)
  g_dense, s_dense = nnx.split(dense)
  t_moe = _time(jax.jit(lambda s, x: nnx.merge(g_moe, s)(x, valid)[0]), s_moe, x, iters=iters)
  t_dense = _time(jax.jit(lambda s, x: nnx.merge(g_dense, s)(x)), s_dense, x, iters=iters)
  return t_moe / t_dense, t_moe, t_dense


def main(_):
  iters = FLAGS.value
  print(f"devices={jax.devices()[0].platform}x{jax.device_count()}")
  print(f"tiny_tokens_per_sec={forward_tokens_per_sec('tiny', 8, 256, iters):.1f}")
  print(f"small_tokens_per_sec={forward_tokens_per_sec('small', 1, SMALL_SEQ.value, max(1, iters // 2)):.1f}")
  for preset, tokens in (("tiny", 2048), ("small", 2048)):
    ratio, t_moe, t_dense = moe_over_dense(preset, tokens, iters)
    print(f"{preset}_moe_layer_ms={t_moe * 1e3:.2f}")
    print(f"{preset}_dense_equiv_ms={t_dense * 1e3:.2f}")
    print(f"{preset}_moe_over_dense={ratio:.3f}")
  print(f"moe_over_dense={ratio:.3f}")


if __name__ == "__main__":
  app.run(main)
