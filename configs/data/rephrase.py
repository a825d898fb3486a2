"""Knowledge rephrasing config (K2 §2.2).

  python launch/rephrase.py --config=configs/data/rephrase.py --input=docs.jsonl \
      --output=rephrased.jsonl --config.llm_url=http://localhost:30000/v1
"""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  c.llm_url = "http://localhost:30000/v1"  # OpenAI-compatible base URL of the rewriting model
  c.model = "default"  # model name sent to the endpoint
  c.api_key = "EMPTY"  # Bearer key for the endpoint (EMPTY for a local server)
  c.num_rephrasings = 2  # rewrites written per document (1..max_rephrasings)
  c.max_rephrasings = 2  # per-corpus cap on rewrites (K2 §2.2: each corpus at most twice)
  c.chunk_tokens = 256  # pieces rewritten in turn, each with the previous rewrite as context
  c.max_output_tokens = 1024  # tokens the model may generate per piece
  c.temperature = 0.7  # sampling temperature of the rewrites
  c.concurrency = 8  # requests in flight
  c.max_retries = 4  # retries per request, with exponential backoff
  c.timeout_s = 120.0  # seconds per request
  c.min_word_recall = 0.5  # fidelity check: share of the source's content words a rewrite keeps
  c.length_ratio = (0.5, 2.5)  # fidelity check: rewrite length / source length must lie in this range
  c.llm_judge = False  # also ask the endpoint whether each rewrite is faithful
  c.seed = 0  # seed of the per-document style and perspective draws
  c.tokenizer_path = ""  # tokenizer that measures the pieces (empty: the bundled one)
  c.text_field = "text"  # the input record's text field
  c.id_field = "id"  # the input record's id field (else its line number)
  c.lock()
  return c
