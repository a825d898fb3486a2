"""Load an exported HF directory with `transformers` and greedy-generate from a prompt (demo check).

  python scripts/hf_generate.py W/hf "The Python language"
"""
import sys

import torch
from transformers import DeepseekV3ForCausalLM

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from k2jax.data.tokenizer import load_tokenizer  # noqa: E402


def main(hf_dir: str, prompt: str, max_new_tokens: int = 40) -> None:
  tok = load_tokenizer()
  # config.json says model_type "kimi_k2" (as Moonshot publishes it, normally with remote code);
  # the architecture is DeepseekV3ForCausalLM, which transformers ships.
  model = DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  model.eval()
  ids = torch.tensor([tok.encode(prompt)])
  with torch.no_grad():
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
  print(f"transformers loaded {type(model).__name__} from {hf_dir}")
  print("prompt:    ", prompt)
  print("generated: ", tok.decode(out[0, ids.shape[1]:].tolist()))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "The Python language")
