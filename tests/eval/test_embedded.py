"""One real run: a tiny model exported to an HF dir, evaluated through the embedded engine end to end, and its
multiple-choice log-likelihoods checked against the model's own unbatched forward pass and the engine's
prompt logprobs."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k2jax
from k2jax.eval import EngineScorer, EvalConfig, TaskSpec, open_model, run

from .conftest import GSM8K, MC, write_jsonl


def _forward_scores(model, pairs):
  """Summed continuation logprobs from one plain forward over the pairs right-padded with token 0 (no segment
  ids: causal attention keeps the padding out of every real position)."""
  seqs = [list(c) + list(x) for c, x in pairs]
  T = max(len(s) for s in seqs)
  ids_BT = jnp.asarray([s + [0] * (T - len(s)) for s in seqs], jnp.int32)
  logp_BTS = np.asarray(jax.nn.log_softmax(model(ids_BT).logits, axis=-1), np.float64)
  return [
    sum(logp_BTS[b, p - 1, s[p]] for p in range(len(c), len(s))) for b, ((c, _), s) in enumerate(zip(pairs, seqs))
  ]


@pytest.mark.slow
def test_embedded_engine_end_to_end(tmp_path, tiny_hf):
  hf_dir = tiny_hf
  tasks = (
    TaskSpec("gsm", write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), "gsm8k"),
    TaskSpec("mc", write_jsonl(tmp_path / "mc.jsonl", MC), "mc"),
  )
  config = EvalConfig(
    model=hf_dir, tasks=tasks, out=str(tmp_path / "out"), max_tokens=6, max_seq_len=128, progress=False
  )
  model = open_model(config)
  try:
    report = run(config, model)
    # Greedy: a second run (fresh output dir, same engine) samples the same texts.
    again = run(EvalConfig(**{**config.__dict__, "out": str(tmp_path / "out2")}), model)
    gsm = report["tasks"]["gsm"]
    samples = [d["samples"][0] for d in gsm["docs"]]
    assert gsm["num_docs"] == 3 and all(0 < s["completion_tokens"] <= 6 for s in samples)
    assert [s["text"] for s in samples] == [d["samples"][0]["text"] for d in again["tasks"]["gsm"]["docs"]]
    assert set(gsm["metrics"]) == {"pass@1", "maj@1", "mean@1"} and 0.0 <= gsm["metrics"]["pass@1"] <= 1.0
    mc = report["tasks"]["mc"]
    assert set(mc["metrics"]) == {"acc", "acc_norm"}
    assert os.path.isfile(os.path.join(config.out, "report.md"))
    assert json.load(open(os.path.join(config.out, "report.json")))["config"]["model"] == hf_dir
    # The scores are the forward pass's, and the engine's prompt logprobs agree (the way to score on an engine).
    ref_model = k2jax.load(hf_dir)
    tok = model.tokenizer
    pairs = [(tok.encode(f"Question: {r['question']}\nAnswer:"), tok.encode(f" {c}")) for r in MC for c in r["choices"]]
    got = [ll for d in mc["docs"] for ll in d["samples"][0]["loglikelihoods"]]
    want = _forward_scores(ref_model, pairs)
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_allclose(EngineScorer(model.engine).score_many(pairs), want, atol=1e-4)
    for d, lls in zip(mc["docs"], np.split(np.asarray(want), [3])):
      assert d["metrics"]["acc"] == float(int(np.argmax(lls)) == d["samples"][0]["gold"])
  finally:
    model.engine.close()
