"""Synthetic k2jax param trees (same path names and layout as k2jax.model) for optimizer tests."""

import numpy as np
import pytest

from k2jax.optim import QKClipSpec

SPEC = QKClipSpec(n_heads=2, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, n_dense_layers=1, n_layers=3)


def synthetic_params(seed=0, *, S=32, D=16, Rq=8, Rkv=6, F=12, E=4, Fe=8, Fs=8):
  """Nested dict with the k2jax.model param paths: 1 dense layer, 2 MoE layers."""
  rng = np.random.default_rng(seed)
  s = SPEC
  H, Kn, Kr, V = s.n_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
  w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(np.float32)
  g = lambda *shape: (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)

  def attn(L):
    return {
      "w_q_a": w(L, D, Rq),
      "q_norm": {"scale": g(L, Rq)},
      "w_q_b": w(L, Rq, H * (Kn + Kr)),
      "w_kv_a": w(L, D, Rkv + Kr),
      "kv_norm": {"scale": g(L, Rkv)},
      "w_kv_b": w(L, Rkv, H * (Kn + V)),
      "w_o": w(L, H * V, D),
    }

  dense = {
    "attn_norm": {"scale": g(1, D)},
    "mlp_norm": {"scale": g(1, D)},
    "attn": attn(1),
    "mlp": {"w_gate": w(1, D, F), "w_up": w(1, D, F), "w_down": w(1, F, D)},
  }
  moe = {
    "attn_norm": {"scale": g(2, D)},
    "mlp_norm": {"scale": g(2, D)},
    "attn": attn(2),
    "moe": {
      "router": {"w": w(2, D, E)},
      "experts": {"w_gate": w(2, E, D, Fe), "w_up": w(2, E, D, Fe), "w_down": w(2, E, Fe, D)},
      "shared": {"w_gate": w(2, D, Fs), "w_up": w(2, D, Fs), "w_down": w(2, Fs, D)},
    },
  }
  return {
    "embed": {"embedding": w(S, D)},
    "dense_layers": dense,
    "moe_layers": moe,
    "final_norm": {"scale": g(D)},
    "lm_head": {"w": w(D, S)},
  }


@pytest.fixture
def params():
  return synthetic_params(0)
