"""The published Kimi-K2 / DeepSeek-V3 Hugging Face key layout, as a table over k2jax parameter paths.

Each `Entry` maps one k2jax leaf (a path into the model's pure state dict) to the HF key(s) it stores:
`global` leaves map to one key; `layer` leaves (stacked [L, ...]) to one key per layer; `expert` leaves
(stacked [L, E, ...]) to one key per layer and expert. HF stores Linear weights [out, in]; k2jax stores
[in, out], so matrices are transposed on the way in and out.
"""

from __future__ import annotations

import dataclasses

from k2jax.model.config import K2Config


@dataclasses.dataclass(frozen=True)
class Entry:
  path: tuple[str, ...]  # into the model's pure state dict
  hf: str  # HF key template: {i} = global layer index, {e} = expert index
  kind: str  # 'global' | 'layer' | 'expert'
  transpose: bool

  def keys(self, cfg: K2Config) -> list[tuple[tuple[int, ...], str]]:
    """[(index into the leaf's leading axes, HF key)] in file order."""
    if self.kind == "global":
      return [((), self.hf)]
    first = 0 if self.path[0] == "dense_layers" else cfg.num_dense_layers
    n = cfg.num_dense_layers if self.path[0] == "dense_layers" else cfg.num_moe_layers
    if self.kind == "layer":
      return [((l,), self.hf.format(i=first + l)) for l in range(n)]
    return [((l, e), self.hf.format(i=first + l, e=e)) for l in range(n) for e in range(cfg.n_routed_experts)]


_ATTN = [
  (("attn_norm", "scale"), "input_layernorm.weight", False),
  (("mlp_norm", "scale"), "post_attention_layernorm.weight", False),
  (("attn", "w_q_a"), "self_attn.q_a_proj.weight", True),
  (("attn", "q_norm", "scale"), "self_attn.q_a_layernorm.weight", False),
  (("attn", "w_q_b"), "self_attn.q_b_proj.weight", True),
  (("attn", "w_kv_a"), "self_attn.kv_a_proj_with_mqa.weight", True),
  (("attn", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", False),
  (("attn", "w_kv_b"), "self_attn.kv_b_proj.weight", True),
  (("attn", "w_o"), "self_attn.o_proj.weight", True),
]
_DENSE = [((("mlp", f"w_{p}"), f"mlp.{p}_proj.weight", True)) for p in ("gate", "up", "down")]
_MOE = [
  (("moe", "router", "w"), "mlp.gate.weight", True),
  (("moe", "router", "bias"), "mlp.gate.e_score_correction_bias", False),
] + [(("moe", "shared", f"w_{p}"), f"mlp.shared_experts.{p}_proj.weight", True) for p in ("gate", "up", "down")]


def entries(cfg: K2Config) -> list[Entry]:
  """Every k2jax leaf with its HF key template, in the order HF names layers."""
  out = [Entry(("embed", "embedding"), "model.embed_tokens.weight", "global", False)]
  stacks = [("dense_layers", _ATTN + _DENSE, cfg.num_dense_layers), ("moe_layers", _ATTN + _MOE, cfg.num_moe_layers)]
  for stack, rows, n in stacks:
    if not n:
      continue
    out += [Entry((stack, *p), "model.layers.{i}." + k, "layer", t) for p, k, t in rows]
    if stack == "moe_layers" and cfg.n_shared_experts == 0:
      out = [e for e in out if "shared" not in e.path]
    if stack == "moe_layers":
      out += [
        Entry(
          (stack, "moe", "experts", f"w_{p}"), "model.layers.{i}.mlp.experts.{e}." + f"{p}_proj.weight", "expert", True
        )
        for p in ("gate", "up", "down")
      ]
  out += [
    Entry(("final_norm", "scale"), "model.norm.weight", "global", False),
    Entry(("lm_head", "w"), "lm_head.weight", "global", True),
  ]
  return out


def hf_shape(leaf_shape: tuple[int, ...], entry: Entry) -> tuple[int, ...]:
  """Shape of one HF tensor for a leaf of `leaf_shape`."""
  n_lead = {"global": 0, "layer": 1, "expert": 2}[entry.kind]
  shape = tuple(leaf_shape[n_lead:])
  return shape[::-1] if entry.transpose else shape
