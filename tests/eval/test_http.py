"""The runner against a server URL (`launch/serve.py`'s `Server` on the tiny export): samples through
`/generate`, multiple choice scored by the server's prompt logprobs, equal to the model's forward pass."""

import numpy as np
import pytest

import k2jax
from k2jax.engine import EngineConfig
from k2jax.eval import EvalConfig, ForwardScorer, TaskSpec, run
from k2jax.serve import Server

from .conftest import GSM8K, MC, write_jsonl


@pytest.mark.slow
def test_a_server_url_runs_generation_and_likelihood_tasks(tmp_path, tiny_hf):
  server = Server(tiny_hf, engine_config=EngineConfig(max_slots=4, max_seq_len=128), port=0).start()
  try:
    tasks = (
      TaskSpec("gsm", write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), "gsm8k"),
      TaskSpec("mc", write_jsonl(tmp_path / "mc.jsonl", MC), "mc"),
    )
    config = EvalConfig(
      model=server.url, tasks=tasks, out=str(tmp_path / "out"), max_tokens=5, tokenizer=tiny_hf, progress=False
    )
    report = run(config)
  finally:
    server.close()
  gsm = report["tasks"]["gsm"]
  assert gsm["num_docs"] == 3 and all(0 < d["samples"][0]["completion_tokens"] <= 5 for d in gsm["docs"])
  tok = server.tokenizer
  pairs = [(tok.encode(f"Question: {r['question']}\nAnswer:"), tok.encode(f" {c}")) for r in MC for c in r["choices"]]
  got = [ll for d in report["tasks"]["mc"]["docs"] for ll in d["samples"][0]["loglikelihoods"]]
  np.testing.assert_allclose(got, ForwardScorer(k2jax.load(tiny_hf)).score_many(pairs), atol=1e-4)
