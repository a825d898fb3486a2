"""Rephrasing end to end against a local OpenAI-compatible server started in the test."""

import http.server
import json
import threading

import pytest

from k2jax.data.rephrase import RephraseConfig, fidelity_problem, pick_styles, rephrase_corpus


class _FakeLLM(http.server.BaseHTTPRequestHandler):
  """`/v1/chat/completions`: a faithful 'rewrite' of the passage; every 4th request fails (503)."""

  calls, passages, contexts, lock = 0, [], [], threading.Lock()

  def do_POST(self):  # noqa: N802 (http.server API)
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    with _FakeLLM.lock:
      _FakeLLM.calls += 1
      fail = _FakeLLM.calls % 4 == 0
    if fail:
      self.send_response(503)
      self.end_headers()
      return
    prompt = body["messages"][-1]["content"]
    passage = prompt.split("Passage:\n", 1)[1]
    with _FakeLLM.lock:
      _FakeLLM.passages.append(passage)
      _FakeLLM.contexts.append("preceding part" in prompt)
    text = "Put differently: " + passage if "HALLUCINATE" not in passage else "Cats are great pets."
    out = json.dumps(
      {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": body["model"],
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
      }
    ).encode()
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(out)))
    self.end_headers()
    self.wfile.write(out)

  def log_message(self, *args):
    pass


@pytest.fixture()
def server():
  srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeLLM)
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  _FakeLLM.calls, _FakeLLM.passages, _FakeLLM.contexts = 0, [], []
  yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
  srv.shutdown()


def _docs():
  long_doc = " ".join(f"Sentence number {i} explains the interpreter loop in detail." for i in range(60))
  return [
    {"id": "long", "text": long_doc},
    {"id": "short", "text": "Python 3.11 added tomllib."},
    {"id": "bad", "text": "HALLUCINATE about the year 1991."},
    {"id": "empty", "text": "  "},
  ]


def test_rephrase_end_to_end_and_resume(server, tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_text("\n".join(json.dumps(d) for d in _docs()) + "\n{broken\n")
  cfg = RephraseConfig(llm_url=server, chunk_tokens=64, concurrency=3, max_retries=3)
  stats = rephrase_corpus(cfg, str(inp), str(out))
  assert stats["written"] == 3 and stats["empty"] == 1 and stats["malformed_json"] == 1
  records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
  long = records["long"]
  assert long["num_chunks"] > 4 and len(long["rephrasings"]) == 2
  assert {(r["style"], r["perspective"]) for r in long["rephrasings"]} == set(pick_styles(0, "long", 2))
  for i in range(60):  # Every sentence of the source survives, in order, across chunks.
    assert f"Sentence number {i} " in long["rephrasings"][0]["text"]
  assert sum(_FakeLLM.contexts) == 2 * (long["num_chunks"] - 1)  # Chunk i sees rewrite of i-1.
  assert len(records["bad"]["rephrasings"]) == 0 and "numbers lost" in records["bad"]["rejected"][0]["reason"]
  assert _FakeLLM.calls > len(_FakeLLM.passages)  # Some 503s happened and were retried.

  # Resume: lose one finished document and tear the last line; only that document is redone.
  lines = out.read_text().splitlines()
  kept = [l for l in lines if json.loads(l)["id"] != "short"]
  out.write_text("\n".join(kept) + "\n" + '{"id": "sh')
  _FakeLLM.passages = []
  stats = rephrase_corpus(cfg, str(inp), str(out))
  assert stats["skipped_finished"] == 2 and stats["written"] == 1
  assert all("tomllib" in p for p in _FakeLLM.passages)
  ids = [json.loads(l)["id"] for l in out.read_text().splitlines() if l.startswith('{"id": "') and l.endswith("}")]
  assert sorted(ids) == ["bad", "long", "short"]


def test_cap_and_fidelity_rules(tmp_path):
  with pytest.raises(ValueError, match="cap"):
    rephrase_corpus(RephraseConfig(llm_url="http://127.0.0.1:9/v1", num_rephrasings=3), "x", "y")
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    rephrase_corpus(RephraseConfig(llm_url="http://127.0.0.1:9/v1"), str(tmp_path / "missing.jsonl"), "y")
  src = "Guido van Rossum released Python in 1991 at CWI in Amsterdam."
  assert fidelity_problem(src, "In 1991 Guido van Rossum released Python at CWI, Amsterdam.", 0.5, (0.5, 2.5)) is None
  assert "numbers" in fidelity_problem(src, "Guido van Rossum released Python at CWI in Amsterdam.", 0.5, (0.5, 2.5))
  assert "recall" in fidelity_problem(src, "In 1991 something happened somewhere to someone else.", 0.5, (0.5, 2.5))
