"""Named model sizes: `1t` is Kimi K2 exactly; `small` fits one GPU; `tiny` trains on 2 CPU cores;
`tiny128` is `tiny` with 128-wide attention heads, the head size real engines' CPU paths accept."""

from __future__ import annotations

from k2jax.model.config import K2Config

_YARN_K2 = (
  ("beta_fast", 1.0),
  ("beta_slow", 1.0),
  ("factor", 32.0),
  ("mscale", 1.0),
  ("mscale_all_dim", 1.0),
  ("original_max_position_embeddings", 4096),
  ("type", "yarn"),
)

PRESETS: dict[str, dict] = {
  # Kimi K2 (arXiv 2507.20534 Table 2; HF config of moonshotai/Kimi-K2-Instruct).
  "1t": dict(),
  # ~1.1B total / ~0.25B activated: the K2 shape scaled down (same routing sparsity 48:1 -> 64/8 here).
  "small": dict(
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=64,
    num_experts_per_tok=8,
    max_position_embeddings=4096,
    rope_scaling=None,
    bos_token_id=None,
    eos_token_id=None,
  ),
  # A few hundred thousand params: seconds per step on CPU. Vocab fits the bundled BPE.
  "tiny": dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=192,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    rope_scaling=None,
    bos_token_id=None,
    eos_token_id=None,
  ),
}
# sglang-jax's native CPU attention loads only 128-wide heads (`tiny`'s 24/16 fail with an o_proj shape
# mismatch, reference §2.6): qk_nope + qk_rope = v = 128, the rope part a quarter of the query head.
PRESETS["tiny128"] = dict(PRESETS["tiny"], qk_nope_head_dim=96, qk_rope_head_dim=32, v_head_dim=128)


def get(name: str, **overrides) -> K2Config:
  """The preset `name` with field overrides (e.g. get('tiny', compute_dtype='bfloat16'))."""
  if name not in PRESETS:
    raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return K2Config(**{**PRESETS[name], **overrides})
