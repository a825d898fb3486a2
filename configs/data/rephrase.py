"""Knowledge rephrasing config (K2 §2.2).

  python launch/rephrase.py --config=configs/data/rephrase.py --input=docs.jsonl \
      --output=rephrased.jsonl --config.llm_url=http://localhost:30000/v1
"""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  c.llm_url = "http://localhost:30000/v1"
  c.model = "default"
  c.api_key = "EMPTY"
  c.num_rephrasings = 2
  c.max_rephrasings = 2
  c.chunk_tokens = 256
  c.max_output_tokens = 1024
  c.temperature = 0.7
  c.concurrency = 8
  c.max_retries = 4
  c.timeout_s = 120.0
  c.min_word_recall = 0.5
  c.length_ratio = (0.5, 2.5)
  c.llm_judge = False
  c.seed = 0
  c.tokenizer_path = ""  # Empty: the bundled tokenizer.
  c.text_field = "text"
  c.id_field = "id"
  c.lock()
  return c
