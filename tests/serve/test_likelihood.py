"""Likelihoods through the server: `/generate` prompt logprobs (logprob_start_len) against the full
forward pass, the routes of lm-eval's `remote` tokenizer backend (/tokenize, /detokenize, /tokenizer_info),
and their bad inputs answered with a 400 naming the field."""

import numpy as np
import requests

from .test_server import _post


def test_tokenize_matches_the_servers_own_text_prompts(served):
  text = "Hello world, tokenizers<|im_end|> agree."
  got = _post(served, "tokenize", {"prompt": text})
  assert got["tokens"] == served.tok.encode_with_specials(text) and got["count"] == len(got["tokens"])
  # A text prompt to /generate becomes exactly these tokens (its prompt_tokens count and logprob ids agree).
  gen = _post(served, "generate", {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
  assert gen["meta_info"]["prompt_tokens"] == len(got["tokens"])
  # add_special_tokens: false (lm-eval's remote backend) gives the same ids: K2 adds no BOS, and special-token
  # text is its id, as the export's HF tokenizer encodes it (lm-eval reads eos_token_id from these ids).
  plain = _post(served, "tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
  assert plain == got["tokens"] and served.tok.special_ids["<|im_end|>"] in plain
  assert _post(served, "tokenize", {"prompt": "[EOS]", "add_special_tokens": False})["tokens"] == [served.tok.eos_id]


def test_detokenize_round_trips(served):
  text = "round trip: ünïcode and digits 12345"
  ids = _post(served, "tokenize", {"prompt": text})["tokens"]
  out = _post(served, "detokenize", {"tokens": ids})
  assert out["text"] == text == out["prompt"]


def test_tokenizer_info_names_the_special_tokens(served):
  r = requests.get(f"{served.server.url}/tokenizer_info", timeout=30)
  assert r.status_code == 200, r.text
  info, tok = r.json(), served.tok
  assert info["eos_token"] == "[EOS]" and info["eos_token_id"] == tok.eos_id
  assert info["bos_token"] == "[BOS]" and info["bos_token_id"] == tok.bos_id
  assert info["vocab_size"] == tok.vocab_size and info["max_model_len"] == served.engine.config.max_seq_len
  assert _post(served, "detokenize", {"tokens": [info["eos_token_id"]]})["text"] == info["eos_token"]


def test_bad_tokenize_requests_name_the_field(served):
  cases = [
    ("tokenize", {}, "prompt"),
    ("tokenize", {"prompt": 3}, "prompt"),
    ("tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("tokenize", {"prompt": "x", "extra": 1}, "extra"),
    ("detokenize", {"tokens": [1, served.tok.vocab_size]}, "tokens"),
    ("detokenize", {"tokens": [-1]}, "tokens"),
    ("detokenize", {"tokens": "abc"}, "tokens"),
  ]
  for route, body, field in cases:
    err = _post(served, route, body, status=400)["error"]
    assert err["param"] == field and field in err["message"], (route, body, err)


PROMPT = [5, 17, 3, 99, 42, 7, 7, 120, 64, 1, 250, 33]


def test_generate_input_token_logprobs_equal_the_forward(served):
  ref = np.asarray(served.forward_logprobs(PROMPT))
  want = [ref[p - 1, PROMPT[p]] for p in range(1, len(PROMPT))]
  for start in (0, 4):
    body = {
      "input_ids": PROMPT,
      "return_logprob": True,
      "logprob_start_len": start,
      "top_logprobs_num": 3,
      "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
    }
    meta = _post(served, "generate", body)["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == PROMPT[start:] and len(meta["input_top_logprobs"]) == len(PROMPT) - start
    if start == 0:
      assert got[0][0] is None and meta["input_top_logprobs"][0] is None
    lps = [lp for lp, _, _ in got if lp is not None]
    np.testing.assert_allclose(lps, want[max(start - 1, 0) :], atol=1e-5)
    p = len(PROMPT) - 1  # the last prompt token's top logprobs: the forward's top 3 at position p - 1
    top = meta["input_top_logprobs"][-1]
    assert [t for _, t, _ in top] == list(np.argsort(-ref[p - 1])[:3])
    np.testing.assert_allclose([lp for lp, _, _ in top], np.sort(ref[p - 1])[::-1][:3], atol=1e-5)
    # The greedy continuation is the forward's argmax after the prompt (the same pass sampled it).
    assert meta["output_token_logprobs"][0][1] == int(np.argmax(ref[-1]))
  # Scoring only (max_new_tokens 0): the prefill runs, nothing is sampled; the prompt's row is cached
  # after, and a later scored request of the same prompt still computes every position.
  for _ in range(2):
    body = {
      "input_ids": PROMPT,
      "return_logprob": True,
      "logprob_start_len": 1,
      "sampling_params": {"max_new_tokens": 0},
    }
    out = _post(served, "generate", body)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    np.testing.assert_allclose([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]], want, atol=1e-5)
  # Without return_logprob nothing is scored (SGLang).
  meta = _post(
    served, "generate", {"input_ids": PROMPT, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}}
  )
  assert "input_token_logprobs" not in meta["meta_info"]


def test_bad_logprob_start_len_names_the_field(served):
  for start in (len(PROMPT), -2):
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start}
    err = _post(served, "generate", body, status=400)["error"]
    assert err["param"] == "logprob_start_len" and "logprob_start_len" in err["message"], err


def _lm_eval_parse(out, ctxlens):
  """lm-eval 0.4's `LocalCompletionsAPI.parse_logprobs`: the continuation's summed logprob and is_greedy."""
  res = []
  for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    res.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
  return res


def test_completions_echo_scores_like_lm_eval(served):
  # (context, continuation) pairs; the second continuation is the model's own greedy one (is_greedy).
  ctx_a, ctx_b = PROMPT[:7], [9, 8, 7, 6]
  ref_b = np.asarray(served.forward_logprobs(ctx_b))
  greedy = [int(np.argmax(ref_b[-1]))]
  pairs = [(ctx_a, PROMPT[7:]), (ctx_b, greedy)]
  body = {
    "model": "m",
    "prompt": [c + x for c, x in pairs],
    "max_tokens": 1,
    "logprobs": 1,
    "echo": True,
    "temperature": 0,
    "seed": 1234,
  }
  out = _post(served, "v1/completions", body)
  assert [c["index"] for c in out["choices"]] == [0, 1]
  for (ctx, cont), (total, is_greedy), choice in zip(
    pairs, _lm_eval_parse(out, [len(c) for c, _ in pairs]), out["choices"]
  ):
    ids = ctx + cont
    ref = np.asarray(served.forward_logprobs(ids))
    want = [ref[p - 1, ids[p]] for p in range(len(ctx), len(ids))]
    np.testing.assert_allclose(total, sum(want), atol=1e-4)
    assert is_greedy == all(ids[p] == int(np.argmax(ref[p - 1])) for p in range(len(ctx), len(ids)))
    lp = choice["logprobs"]
    assert (
      len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    )
    assert lp["tokens"][: len(ids)] == [served.tok.token_name(t) for t in ids]
    assert all(isinstance(top, dict) and len(top) == 1 for top in lp["top_logprobs"][1:])
  assert _lm_eval_parse(out, [len(c) for c, _ in pairs])[1][1]  # the greedy continuation is greedy


def test_completions_echo_without_generation_and_text_prompts(served):
  ref = np.asarray(served.forward_logprobs(PROMPT))
  want = [ref[p - 1, PROMPT[p]] for p in range(1, len(PROMPT))]
  out = _post(served, "v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2})
  (choice,) = out["choices"]
  assert choice["text"] == served.tok.decode(PROMPT) and out["usage"]["completion_tokens"] == 0
  assert choice["logprobs"]["token_logprobs"][0] is None
  np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], want, atol=1e-5)
  assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
  text = "The quick brown fox"
  ids = served.tok.encode_with_specials(text)
  ref = np.asarray(served.forward_logprobs(ids))
  body = {"model": "m", "prompt": text, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
  (choice,) = _post(served, "v1/completions", body)["choices"]
  assert choice["text"].startswith(text) and len(choice["logprobs"]["tokens"]) == len(ids) + 2
  np.testing.assert_allclose(
    choice["logprobs"]["token_logprobs"][1 : len(ids)], [ref[p - 1, ids[p]] for p in range(1, len(ids))], atol=1e-5
  )
  # echo without logprobs: the prompt's text, then the output's.
  plain = _post(served, "v1/completions", {"model": "m", "prompt": text, "max_tokens": 0, "echo": True})
  assert plain["choices"][0]["text"] == text and plain["choices"][0]["logprobs"] is None


def test_hostile_echo_requests_are_400s(served):
  too_long = {"model": "m", "prompt": [1] * 200, "max_tokens": 1, "echo": True, "logprobs": 1}
  err = _post(served, "v1/completions", too_long, status=400)["error"]
  assert err["param"] == "prompt" and "too long" in err["message"]
  stream = {"model": "m", "prompt": [1, 2], "echo": True, "stream": True}
  assert _post(served, "v1/completions", stream, status=400)["error"]["param"] == "echo"
  err = _post(served, "v1/completions", {"model": "m", "prompt": [1, 2], "echo": "yes"}, status=400)["error"]
  assert err["param"] == "echo"


def test_a_batch_of_echo_prompts_is_scored_in_one_program(served, monkeypatch):
  """The prompts of one `/v1/completions` request reach the engine together (`FairQueue` submits them
  with `submit_many`): one scored prefill holds them all, not the first alone and the rest after it."""
  runner = served.server.engine._runner
  calls = []
  scored = runner.prefill_scored

  def counting(slots, prompts, sampling, **kw):
    calls.append(len(slots))
    return scored(slots, prompts, sampling, **kw)

  monkeypatch.setattr(runner, "prefill_scored", counting)
  prompts = [PROMPT, PROMPT[:7], [9, 8, 7, 6, 5]]  # 3: the per-request share of the server's 4 slots
  body = {"model": "m", "prompt": prompts, "max_tokens": 0, "logprobs": 1, "echo": True}
  out = _post(served, "v1/completions", body)
  assert calls == [3]
  for ids, choice in zip(prompts, sorted(out["choices"], key=lambda c: c["index"])):
    ref = np.asarray(served.forward_logprobs(ids))
    want = [ref[p - 1, ids[p]] for p in range(1, len(ids))]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], want, atol=1e-5)
