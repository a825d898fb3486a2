"""Random small Kimi-K2-layout checkpoints and Hugging Face reference logits for them.

Run `python tests/golden/hf_golden.py` (needs torch + transformers) to regenerate
`tests/golden/hf_logits.npz`. Weights are regenerated from numpy seeds in the tests, so only the
configs, inputs and logits are committed. Scales are chosen so routing is decisive (router logits spread
over several units, a random balancing bias of comparable size) and activations stay O(1).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "hf_logits.npz")

_BASE = dict(
  architectures=["DeepseekV3ForCausalLM"],
  model_type="deepseek_v3",
  vocab_size=256,
  hidden_size=64,
  intermediate_size=96,
  moe_intermediate_size=24,
  num_attention_heads=4,
  num_key_value_heads=4,
  q_lora_rank=32,
  kv_lora_rank=24,
  qk_nope_head_dim=16,
  qk_rope_head_dim=8,
  v_head_dim=12,
  hidden_act="silu",
  rms_norm_eps=1e-6,
  max_position_embeddings=512,
  tie_word_embeddings=False,
  attention_bias=False,
  scoring_func="sigmoid",
  topk_method="noaux_tc",
  norm_topk_prob=True,
  num_nextn_predict_layers=0,
  bos_token_id=0,
  eos_token_id=1,
  initializer_range=0.02,
)

CONFIGS = {
  # group-limited routing (4 groups, keep 2), YaRN with mscale_all_dim, two dense layers.
  "grouped_yarn": dict(
    _BASE,
    num_hidden_layers=4,
    first_k_dense_replace=2,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    rope_theta=10000.0,
    rope_interleave=True,
    rope_scaling=dict(
      type="yarn",
      factor=4.0,
      original_max_position_embeddings=32,
      beta_fast=32,
      beta_slow=1,
      mscale=1.0,
      mscale_all_dim=1.0,
    ),
  ),
  # Kimi-K2-like: no groups, K2's YaRN betas (hard step), K2's scaling factor, one dense layer.
  "k2_like": dict(
    _BASE,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=12,
    num_experts_per_tok=3,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.827,
    rope_theta=50000.0,
    rope_interleave=True,
    rope_scaling=dict(
      type="yarn",
      factor=32.0,
      original_max_position_embeddings=16,
      beta_fast=1.0,
      beta_slow=1.0,
      mscale=1.0,
      mscale_all_dim=1.0,
    ),
  ),
  # plain RoPE in half-split layout, two shared experts, every layer MoE, 2 groups keep 1.
  "plain_rope": dict(
    _BASE,
    num_hidden_layers=2,
    first_k_dense_replace=0,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=2,
    routed_scaling_factor=1.5,
    rope_theta=10000.0,
    rope_interleave=False,
    rope_scaling=None,
  ),
}
BATCH, SEQ = 2, 64


def random_hf_state(cfg: dict, seed: int) -> dict[str, np.ndarray]:
  """Per-expert HF keys ([out, in] weights) with O(1) activations and decisive routing."""
  rng = np.random.default_rng(seed)
  D, H = cfg["hidden_size"], cfg["num_attention_heads"]
  Kn, Kr, V = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
  Rq, Rkv, E = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["n_routed_experts"]
  F, Fm = cfg["intermediate_size"], cfg["moe_intermediate_size"]

  def lin(out, inp, gain=1.0):
    return (gain * rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

  def norm(n):
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  s = {"model.embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], D)).astype(np.float32)}
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    s[p + "input_layernorm.weight"] = norm(D)
    s[p + "post_attention_layernorm.weight"] = norm(D)
    s[p + "self_attn.q_a_proj.weight"] = lin(Rq, D)
    s[p + "self_attn.q_a_layernorm.weight"] = norm(Rq)
    s[p + "self_attn.q_b_proj.weight"] = lin(H * (Kn + Kr), Rq, 2.0)
    s[p + "self_attn.kv_a_proj_with_mqa.weight"] = lin(Rkv + Kr, D)
    s[p + "self_attn.kv_a_layernorm.weight"] = norm(Rkv)
    s[p + "self_attn.kv_b_proj.weight"] = lin(H * (Kn + V), Rkv, 2.0)
    s[p + "self_attn.o_proj.weight"] = lin(D, H * V)
    if i < cfg["first_k_dense_replace"]:
      for n, (o, k) in {"gate": (F, D), "up": (F, D), "down": (D, F)}.items():
        s[p + f"mlp.{n}_proj.weight"] = lin(o, k)
      continue
    s[p + "mlp.gate.weight"] = lin(E, D, 4.0)
    s[p + "mlp.gate.e_score_correction_bias"] = (0.3 * rng.standard_normal(E)).astype(np.float32)
    for e in range(E):
      for n, (o, k) in {"gate": (Fm, D), "up": (Fm, D), "down": (D, Fm)}.items():
        s[p + f"mlp.experts.{e}.{n}_proj.weight"] = lin(o, k)
    Fs = Fm * cfg["n_shared_experts"]
    for n, (o, k) in {"gate": (Fs, D), "up": (Fs, D), "down": (D, Fs)}.items():
      s[p + f"mlp.shared_experts.{n}_proj.weight"] = lin(o, k)
  s["model.norm.weight"] = norm(D)
  s["lm_head.weight"] = lin(cfg["vocab_size"], D)
  return s


def inputs(cfg: dict, seed: int) -> np.ndarray:
  return np.random.default_rng(1000 + seed).integers(0, cfg["vocab_size"], (BATCH, SEQ)).astype(np.int32)


def write_hf_dir(path: str, cfg: dict, state: dict[str, np.ndarray], n_shards: int = 2) -> None:
  """A sharded HF directory with an index, as published checkpoints are laid out."""
  os.makedirs(path, exist_ok=True)
  keys = list(state)
  chunks = np.array_split(np.arange(len(keys)), n_shards)
  wmap = {}
  for j, idx in enumerate(chunks):
    name = f"model-{j + 1:05d}-of-{n_shards:05d}.safetensors"
    save_file({keys[i]: state[keys[i]] for i in idx}, os.path.join(path, name), metadata={"format": "pt"})
    wmap.update({keys[i]: name for i in idx})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": wmap}, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)


def hf_logits(path: str, ids: np.ndarray) -> np.ndarray:
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
  model.eval()
  with torch.no_grad():
    return model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()


def main():
  import tempfile

  out = {}
  for seed, (name, cfg) in enumerate(CONFIGS.items()):
    with tempfile.TemporaryDirectory() as d:
      write_hf_dir(d, cfg, random_hf_state(cfg, seed))
      ids = inputs(cfg, seed)
      out[f"{name}/input_ids"] = ids
      out[f"{name}/logits"] = hf_logits(d, ids)
      print(name, "max|logit|", float(np.abs(out[f"{name}/logits"]).max()), file=sys.stderr)
  np.savez_compressed(GOLDEN, **out)
  print("wrote", GOLDEN)


if __name__ == "__main__":
  main()
