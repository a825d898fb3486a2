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
      model=server.url, tasks=tasks, out=str(tmp_path / "out"), max_tokens=5, progress=False
    )  # tokenizer "auto": the server's /get_model_info tokenizer_path
    report = run(config)
  finally:
    server.close()
  gsm = report["tasks"]["gsm"]
  assert gsm["num_docs"] == 3 and all(0 < d["samples"][0]["completion_tokens"] <= 5 for d in gsm["docs"])
  tok = server.tokenizer
  pairs = [(tok.encode(f"Question: {r['question']}\nAnswer:"), tok.encode(f" {c}")) for r in MC for c in r["choices"]]
  got = [ll for d in report["tasks"]["mc"]["docs"] for ll in d["samples"][0]["loglikelihoods"]]
  np.testing.assert_allclose(got, ForwardScorer(k2jax.load(tiny_hf)).score_many(pairs), atol=1e-4)


def _fake_server(info):
  """A server that is healthy and answers /get_model_info with `info` (None: 404)."""
  import http.server
  import json
  import threading

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
      body = b"" if self.path == "/health" else json.dumps(info).encode()
      self.send_response(404 if self.path != "/health" and info is None else 200)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=httpd.serve_forever, daemon=True).start()
  return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.mark.parametrize(
  "info, match",
  [
    ({"tokenizer_path": "/nonexistent/k2"}, "tokenizer_path '/nonexistent/k2' is not readable on this machine"),
    ({"model_path": "m"}, "names no tokenizer_path"),
    (None, "asks /get_model_info"),
  ],
)
def test_a_url_tokenizer_auto_that_cannot_resolve_names_why_and_writes_nothing(tmp_path, info, match):
  httpd, url = _fake_server(info)
  try:
    tasks = (TaskSpec("gsm", write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), "gsm8k"),)
    config = EvalConfig(model=url, tasks=tasks, out=str(tmp_path / "out"), progress=False)
    with pytest.raises(ValueError, match=match) as e:
      run(config)
    assert "pass --tokenizer" in str(e.value) and not (tmp_path / "out").exists()
  finally:
    httpd.shutdown()
