"""Load an exported HF directory with `transformers`, check its logits against k2jax's on the prompt,
and greedy-generate (the demo's last step).

  python scripts/hf_generate.py W/hf "The Python language"
"""

import os
import sys

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, conversion_mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_hf_model(hf_dir: str) -> DeepseekV3ForCausalLM:
  """transformers' DeepseekV3ForCausalLM from a k2jax/Kimi-K2 export (model_type "kimi_k2").

  Moonshot publishes model_type "kimi_k2" (for its remote code); the architecture is the
  DeepseekV3ForCausalLM that transformers ships. transformers 5 maps per-expert checkpoint keys onto
  its fused expert tensors by model_type; without the deepseek_v3 mapping registered under "kimi_k2"
  the experts would silently stay randomly initialised.
  """
  if conversion_mapping.get_checkpoint_conversion_mapping("kimi_k2") is None:
    conversion_mapping.register_checkpoint_conversion_mapping(
      "kimi_k2", conversion_mapping.get_checkpoint_conversion_mapping("deepseek_v3")
    )
  config = DeepseekV3Config.from_pretrained(hf_dir)
  return DeepseekV3ForCausalLM.from_pretrained(hf_dir, config=config, dtype=torch.float32).eval()


def main(hf_dir: str, prompt: str, max_new_tokens: int = 40) -> None:
  import k2jax
  from k2jax.data.tokenizer import load_tokenizer

  tok = load_tokenizer()
  model = load_hf_model(hf_dir)
  ids = tok.encode(prompt)
  with torch.no_grad():
    hf_logits = model(torch.tensor([ids])).logits.numpy()
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
  ours = np.asarray(k2jax.load(hf_dir)(np.asarray([ids], np.int32)).logits)
  print(
    f"transformers loaded {type(model).__name__} from {hf_dir}; "
    f"max |logits - k2jax logits| = {np.max(np.abs(hf_logits - ours)):.2e}"
  )
  print("prompt:    ", prompt)
  print("generated: ", tok.decode(out[0, len(ids) :].tolist()))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "The Python language")
