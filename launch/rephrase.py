"""Rephrase a jsonl knowledge corpus with an OpenAI-compatible LLM endpoint (resumable).

  python launch/rephrase.py --config=configs/data/rephrase.py --input=docs.jsonl \
      --output=rephrased.jsonl [--config.llm_url=URL --config.num_rephrasings=2 ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from k2jax.data.rephrase import RephraseConfig, rephrase_corpus  # noqa: E402
from k2jax.data.tokenizer import BUNDLED_TOKENIZER  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/data/rephrase.py")
_INPUT = flags.DEFINE_string("input", None, "Input jsonl (one document per line).", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Output jsonl (appended; reruns resume).", required=True)


def main(argv):
  del argv
  fields = dict(_CONFIG.value)
  fields["length_ratio"] = tuple(fields["length_ratio"])
  fields["tokenizer_path"] = fields["tokenizer_path"] or BUNDLED_TOKENIZER
  stats = rephrase_corpus(RephraseConfig(**fields), _INPUT.value, _OUTPUT.value)
  for key, value in stats.items():
    print(f"{key}={value}")


if __name__ == "__main__":
  app.run(main)
