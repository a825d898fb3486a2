"""Build a directory laid out as the released Kimi-K2-Instruct is: block-FP8 weights (F8_E4M3 + float32
`weight_scale_inv`), bf16 embeddings/norms/router, float32 router bias, stale `rotary_emb.inv_freq`
buffers, `config.json` with `model_type: kimi_k2`, `auto_map` and `quantization_config`, and the tiktoken
tokenizer files (`tiktoken.model` + `tokenizer_config.json` with a chat template, no `tokenizer.json`).

Dims are not multiples of 128 (hidden 192, kv_a rows 144 = one full block + 16, like Kimi's 576 rows
= 4.5 blocks) and one block is all zero. Nothing is downloaded: the tokenizer is the bundled BPE."""

from __future__ import annotations

import json
import os
import shutil
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "golden"))
import hf_golden  # noqa: E402

from k2jax.convert import fp8  # noqa: E402
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, K2_SPECIAL_OFFSETS, load_tokenizer  # noqa: E402

BF16 = ml_dtypes.bfloat16
BLOCK = (128, 128)
ZERO_KEY = "model.layers.1.mlp.experts.2.gate_proj.weight"  # its first block is all zero

CFG = dict(
  hf_golden._BASE,
  vocab_size=load_tokenizer(BUNDLED_TOKENIZER).vocab_size,
  hidden_size=192,
  intermediate_size=160,
  moe_intermediate_size=48,
  q_lora_rank=64,
  kv_lora_rank=136,
  num_hidden_layers=2,
  first_k_dense_replace=1,
  n_routed_experts=8,
  num_experts_per_tok=2,
  n_group=1,
  topk_group=1,
  n_shared_experts=1,
  routed_scaling_factor=2.827,
  rope_theta=50000.0,
  rope_interleave=True,
  rope_scaling=None,
)
KIMI_KEYS = dict(
  model_type="kimi_k2",
  auto_map={
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
  },
  quantization_config={
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
  },
  torch_dtype="bfloat16",
  transformers_version="4.48.3",
)
# Kimi's chat format (Unsloth's guide / tokenizer_config.json of the release), the system-less core of it.
CHAT_TEMPLATE = (
  "{%- for m in messages -%}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
  "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def quantized_state(cfg: dict, seed: int) -> dict[str, np.ndarray]:
  """The release's tensors for `cfg`: FP8 + scale for every projection, bf16 else, f32 router bias."""
  out = {}
  for key, w in hf_golden.random_hf_state(cfg, seed).items():
    if fp8.is_quantized_key(key):
      if key == ZERO_KEY:
        w[: BLOCK[0], : BLOCK[1]] = 0.0
      out[key], out[key + fp8.SCALE_SUFFIX] = fp8.quantize(w, BLOCK)
    elif key.endswith("e_score_correction_bias"):
      out[key] = w.astype(np.float32)
    else:
      out[key] = w.astype(BF16)
  for i in range(cfg["num_hidden_layers"]):  # the release stores this stale buffer in every layer
    rope = cfg["qk_rope_head_dim"]
    out[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = (
      1.0 / cfg["rope_theta"] ** (np.arange(0, rope, 2) / rope)
    ).astype(BF16)
  return out


def dequantized(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """float32 of every model tensor by the format's equation (repeat the scale grid, crop): the reference."""
  out = {}
  for key, t in state.items():
    if key.endswith(fp8.SCALE_SUFFIX) or key.endswith("inv_freq"):
      continue
    if t.dtype == fp8.E4M3:
      s = state[key + fp8.SCALE_SUFFIX]
      full = np.repeat(np.repeat(s, BLOCK[0], 0), BLOCK[1], 1)[: t.shape[0], : t.shape[1]]
      out[key] = t.astype(np.float32) * full
    else:
      out[key] = t.astype(np.float32)
  return out


def write_dir(path: str, cfg: dict, state: dict[str, np.ndarray], *, n_shards: int = 3, kimi: bool = True) -> str:
  """Shards in the release's naming (`model-1-of-N`, not zero-padded), scales in the shard after their
  weight (the index, not adjacency, says where a scale lives), config.json and the tokenizer files."""
  os.makedirs(path, exist_ok=True)
  keys = list(state)
  parts = np.array_split(np.arange(len(keys)), n_shards)
  wmap = {}
  for j, idx in enumerate(parts):
    name = f"model-{j + 1}-of-{n_shards}.safetensors"
    save_file({keys[i]: state[keys[i]] for i in idx}, os.path.join(path, name), metadata={"format": "pt"})
    wmap.update({keys[i]: name for i in idx})
  total = sum(t.nbytes for t in state.values())
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f)
  config = dict(cfg, **KIMI_KEYS) if kimi else dict(cfg)
  if not any(t.dtype == fp8.E4M3 for t in state.values()):
    config.pop("quantization_config", None)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  write_kimi_tokenizer(path)
  return path


def write_kimi_tokenizer(path: str) -> None:
  """`tiktoken.model` + the release's `tokenizer_config.json` layout (TikTokenTokenizer, remote code)."""
  shutil.copyfile(BUNDLED_TOKENIZER, os.path.join(path, "tiktoken.model"))
  n = load_tokenizer(BUNDLED_TOKENIZER).num_base_tokens
  names = {n + off: name for name, off in K2_SPECIAL_OFFSETS.items()}
  names.update({n + 254: "[PAD]", n + 255: "[UNK]"})
  decoder = {
    str(i): {
      "content": names.get(i, f"<|reserved_token_{i}|>"),
      "lstrip": False,
      "normalized": False,
      "rstrip": False,
      "single_word": False,
      "special": True,
    }
    for i in range(n, n + 256)
  }
  config = {
    "added_tokens_decoder": decoder,
    "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
    "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    "bos_token": "[BOS]",
    "chat_template": CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
    "eos_token": "[EOS]",
    "model_max_length": 1048576,
    "pad_token": "[PAD]",
    "tokenizer_class": "TikTokenTokenizer",
    "unk_token": "[UNK]",
  }
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)


def load_shard(file: str) -> dict[str, np.ndarray]:
  """Every tensor of a shard (safetensors.numpy cannot load F8_E4M3; k2jax's byte reader can)."""
  from k2jax.convert.safetensors_io import ShardFiles, read_block, read_header

  with ShardFiles() as files:
    return {k: read_block(files, t, tuple((0, d) for d in t.shape)) for k, t in read_header(file).items()}
