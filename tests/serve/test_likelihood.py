"""Likelihood support routes for lm-eval's `remote` tokenizer backend: /tokenize, /detokenize and
/tokenizer_info on the shared tiny served model, and their bad inputs answered with a 400 naming the field."""

import requests

from .test_server import _post


def test_tokenize_matches_the_servers_own_text_prompts(served):
  text = "Hello world, tokenizers<|im_end|> agree."
  got = _post(served, "tokenize", {"prompt": text})
  assert got["tokens"] == served.tok.encode_with_specials(text) and got["count"] == len(got["tokens"])
  # A text prompt to /generate becomes exactly these tokens (its prompt_tokens count and logprob ids agree).
  gen = _post(served, "generate", {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
  assert gen["meta_info"]["prompt_tokens"] == len(got["tokens"])
  plain = _post(served, "tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
  assert plain == served.tok.encode(text) and plain != got["tokens"]  # <|im_end|> stays text


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
