"""The HTTP API: SGLang /generate fields, stop strings, weight updates, bad requests, the openai client,
and OpenAI tool calls produced by a model whose weights were set to emit one."""

import concurrent.futures
import dataclasses
import gc
import json
import os
import pathlib
import socket
import time

import numpy as np
import openai
import pytest
import requests
from flax import nnx

import k2jax
from k2jax.api import model_from_state
from k2jax.data import chat
from k2jax.model import K2Model

from .conftest import MAX_LEN


def _post(served, route, body, status=200):
  r = requests.post(f"{served.server.url}/{route}", json=body, timeout=120)
  assert r.status_code == status, r.text
  return r.json() if r.headers.get("Content-Type") == "application/json" else r.text


def _greedy(served, ids, n=12, **extra):
  return _post(
    served,
    "generate",
    {
      "input_ids": list(ids),
      "return_logprob": True,
      "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra},
    },
  )


def test_generate_meta_info_and_batch(served):
  out = _greedy(served, [5, 6, 7, 8], n=6)
  meta = out["meta_info"]
  assert meta["completion_tokens"] == len(out["output_ids"]) == len(meta["output_token_logprobs"]) == 6
  assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
  assert meta["prompt_tokens"] == 4 and meta["finish_reason"] == {"type": "length", "length": 6}
  assert isinstance(out["text"], str) and meta["weight_version"] == str(served.engine.weight_version)
  batch = _post(
    served,
    "generate",
    {
      "input_ids": [[5, 6, 7, 8], [9, 10]],
      "rid": ["b0", "b1"],
      "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    },
  )
  assert [b["meta_info"]["id"] for b in batch] == ["b0", "b1"]
  assert batch[0]["output_ids"] == out["output_ids"]
  text = _post(served, "generate", {"text": "Hello world", "sampling_params": {"max_new_tokens": 3}})
  assert text["meta_info"]["prompt_tokens"] == len(served.tok.encode("Hello world"))


def test_stop_string_trims_text(served):
  tok = served.tok
  ids = _greedy(served, [11, 12, 13])["output_ids"]
  k = next(i for i in range(1, len(ids)) if ids[i] < tok.num_base_tokens and len(tok.decode([ids[i]]).strip()) >= 2)
  stop = tok.decode([ids[k]]).strip()
  j = next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1]))
  out = _greedy(served, [11, 12, 13], stop=[stop, "never-generated"])
  assert out["output_ids"] == ids[: j + 1]
  assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
  text = tok.decode([t for t in ids[: j + 1] if t < tok.num_base_tokens])
  assert out["text"] == text[: text.index(stop)] and stop not in out["text"]


def test_update_weights_from_disk_changes_outputs_and_version(served, bigram_dir):
  before = _greedy(served, [3, 1, 4, 1, 5])
  res = _post(served, "update_weights_from_disk", {"model_path": bigram_dir, "weight_version": "5"})
  assert res["success"] is True
  try:
    after = _greedy(served, [3, 1, 4, 1, 5])
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "5"
    assert requests.get(f"{served.server.url}/get_model_info").json()["weight_version"] == "5"
  finally:
    res = _post(served, "update_weights_from_disk", {"model_path": served.hf_dir})
  assert res["success"] and res["weight_version"] == "6"  # no version given: incremented
  assert _greedy(served, [3, 1, 4, 1, 5])["output_ids"] == before["output_ids"]
  missing = os.path.join(served.weights_root, "not-there")
  bad = _post(served, "update_weights_from_disk", {"model_path": missing}, status=400)
  assert bad["success"] is False and missing in bad["message"]
  # Outside the weights root: refused before the path is touched (no existence oracle, no file reads).
  for path in ("/nonexistent/dir", "/etc", served.hf_dir + "/../../.."):
    bad = _post(served, "update_weights_from_disk", {"model_path": path}, status=403)
    assert bad["success"] is False and "weights root" in bad["message"]


BAD = [
  ("generate", {}, "input_ids"),
  ("generate", {"input_ids": "abc"}, "input_ids"),
  ("generate", {"input_ids": [1, 2], "text": "x"}, "input_ids"),
  ("generate", {"input_ids": [99999]}, "input_ids"),
  ("generate", {"input_ids": [1] * 200}, "input_ids"),
  ("generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1000}}, "sampling_params.max_new_tokens"),
  ("generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
  ("generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
  (
    "generate",
    {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}},
    "sampling_params.frequency_penalty",
  ),
  ("generate", {"input_ids": [1, 2], "sampling_params": {"colour": 1}}, "sampling_params.colour"),
  ("generate", {"input_ids": [1, 2], "rid": 5}, "rid"),
  ("generate", {"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
  ("generate", {"input_ids": [[1, 2], [3]], "stream": True}, "stream"),
  (
    "generate",
    {"input_ids": [1, 2], "sampling_params": {"top_k": 2**40, "max_new_tokens": 4}},
    "sampling_params.top_k",
  ),
  (
    "generate",
    {"input_ids": [1, 2], "sampling_params": {"temperature": 1e300, "max_new_tokens": 4}},
    "sampling_params.temperature",
  ),
  ("generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens"),
  (
    "generate",
    {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [-1], "max_new_tokens": 4}},
    "sampling_params.stop_token_ids[0]",
  ),
  ("v1/completions", {"model": "m", "prompt": "hi", "top_k": 2**40}, "top_k"),
  ("v1/completions", {"model": "m", "prompt": "hi", "n": 10**6}, "n"),
  ("generate", {"input_ids": [1, 2], "bogus": 1}, "bogus"),
  ("update_weights_from_disk", {}, "model_path"),
  ("abort_request", {}, "rid"),
  ("v1/completions", {"model": "m"}, "prompt"),
  ("v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
  ("v1/completions", {"model": "m", "prompt": [1] * 200}, "prompt"),
  ("v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
  (
    "v1/chat/completions",
    {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
    "tool_choice",
  ),
]


@pytest.mark.parametrize("route,body,field", BAD, ids=[f"{r}:{f}" for r, _, f in BAD])
def test_bad_requests_get_400_naming_the_field(served, route, body, field):
  err = _post(served, route, body, status=400)["error"]
  assert err["param"] == field and field in err["message"]


def test_invalid_json_body(served):
  r = requests.post(f"{served.server.url}/generate", data=b"{not json", timeout=30)
  assert r.status_code == 400 and r.json()["error"]["param"] == "body"


@pytest.mark.parametrize(
  "raw,field",
  [
    (b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "body"),
    (b'{"input_ids": [1, 2], "sampling_params": {"top_p": Infinity}}', "body"),
    (b"[" * 100_000 + b"]" * 100_000, "body"),
  ],
  ids=["nan", "infinity", "deep"],
)
def test_non_finite_and_deep_json_are_400(served, raw, field):
  r = requests.post(f"{served.server.url}/generate", data=raw, timeout=30)
  assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def _raw_http(served, head: bytes, body: bytes = b"", wait_s: float = 10.0) -> bytes:
  host, port = served.server.url.removeprefix("http://").split(":")
  with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
    sock.sendall(head + body)
    return sock.recv(4096)


def test_malformed_http_framing_and_limits(served):
  limits = served.server.app.state.limits
  status = lambda reply: int(reply.split(b" ", 2)[1])  # noqa: E731
  assert status(_raw_http(served, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")) == 400
  big = limits.max_body_bytes + 1
  head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {big}\r\n\r\n"
  assert status(_raw_http(served, head.encode(), b"{")) == 413
  # A half-sent body: 408 after the read timeout, and meanwhile other requests are served.
  t0 = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    slow = pool.submit(_raw_http, served, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", b"{")
    assert _greedy(served, [1, 2, 3], n=2)["meta_info"]["completion_tokens"] == 2
    assert status(slow.result()) == 408
  assert time.monotonic() - t0 >= limits.read_timeout_s * 0.9


def test_bad_request_never_affects_others(served):
  """Requests that would break an engine step are refused at the door; the good ones beside them finish."""
  ref = _greedy(served, [7, 8, 9], n=8)["output_ids"]
  bad_bodies = [
    {"input_ids": [1, 2], "sampling_params": {"top_k": 2**40, "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"top_k": served.model.cfg.vocab_size + 1}},
    {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
  ]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    good = [pool.submit(_greedy, served, [7, 8, 9], 8) for _ in range(4)]
    bad = [pool.submit(requests.post, f"{served.server.url}/generate", json=b, timeout=60) for b in bad_bodies]
    assert all(r.result().status_code == 400 for r in bad)
    assert all(g.result()["output_ids"] == ref for g in good)


def test_api_key_guards_state_changing_routes_and_generation(served):
  server = served.server
  limits = server.app.state.limits
  server.app.state.limits = dataclasses.replace(limits, api_key="s3cret")
  try:
    for route, body in (("flush_cache", None), ("abort_request", {"abort_all": True})):
      r = requests.post(f"{server.url}/{route}", json=body, timeout=30)
      assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
      r = requests.post(f"{server.url}/{route}", json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
      assert r.status_code == 401
      r = requests.post(f"{server.url}/{route}", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=30)
      assert r.status_code == 200, r.text
    r = requests.post(f"{server.url}/update_weights_from_disk", json={"model_path": served.hf_dir}, timeout=60)
    assert r.status_code == 401
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    assert requests.post(f"{server.url}/generate", json=body, timeout=60).status_code == 401  # generation too
    r = requests.post(f"{server.url}/generate", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
  finally:
    server.app.state.limits = limits


def _sse_events(response) -> list:
  events = []
  for line in response.iter_lines():
    if line.startswith(b"data: "):
      payload = line[len(b"data: ") :]
      events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
  return events


def test_generate_streams_server_sent_events(served):
  ref = _greedy(served, [4, 5, 6], n=10)
  body = {
    "input_ids": [4, 5, 6],
    "stream": True,
    "return_logprob": True,
    "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
  }
  with requests.post(f"{served.server.url}/generate", json=body, stream=True, timeout=120) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r)
  assert events[-1] == "[DONE]"
  chunks = events[:-1]
  assert len(chunks) >= 2  # more than one event: tokens arrive as they are sampled
  lengths = [len(c["output_ids"]) for c in chunks]
  assert lengths == sorted(lengths) and lengths[-1] == 10
  assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
  assert chunks[-1]["output_ids"] == ref["output_ids"]
  assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_openai_client_streams_chat_token_by_token(served):
  client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="unused")
  messages = [{"role": "user", "content": "Say something"}]
  args = dict(model="tiny", messages=messages, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
  whole = client.chat.completions.create(**args)
  deltas, finish = [], None
  for chunk in client.chat.completions.create(stream=True, **args):
    deltas.append(chunk.choices[0].delta.content or "")
    finish = chunk.choices[0].finish_reason or finish
  assert "".join(deltas) == whole.choices[0].message.content
  assert sum(1 for d in deltas if d) >= 2 and finish == "length"


def test_disconnected_clients_free_their_slots(served):
  """64 clients that go away mid-generation (4 decoding, 60 queued): all aborted, slots free in < 4 requests' time."""
  url = served.server.url
  max_new = MAX_LEN - 8
  socks = []
  for i in range(64):
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps(
      {"input_ids": [1, 2, 3, i + 4], "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    )
    sock.sendall(
      f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    socks.append(sock)
  deadline = time.monotonic() + 60
  while served.server.num_running() < 64 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert served.server.num_running() == 64
  for sock in socks:
    sock.close()
  t0 = time.monotonic()
  while (served.server.num_running() or served.engine.num_running()) and time.monotonic() - t0 < 60:
    time.sleep(0.01)
  drained_s = time.monotonic() - t0
  assert served.server.num_running() == served.engine.num_running() == 0, "aborted requests still hold slots"
  # Served to the end, the 64 would take 16 rounds of 4 full-length requests: the drain is measured against
  # one full-length request on this machine now, not against a wall-clock constant that a loaded host breaks.
  t1 = time.monotonic()
  assert _greedy(served, [1, 2], n=max_new)["meta_info"]["completion_tokens"] == max_new
  assert drained_s < 4 * (time.monotonic() - t1) + 0.5, drained_s


def test_many_concurrent_generates_without_errors(served):
  def one(i):
    body = {"input_ids": [1 + i % 50, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    return requests.post(f"{served.server.url}/generate", json=body, timeout=300)

  rss_mb = []
  for _ in range(2):  # the second burst must not grow memory past the first (nothing kept per request)
    with concurrent.futures.ThreadPoolExecutor(256) as pool:
      replies = list(pool.map(one, range(256)))
    assert [r.status_code for r in replies] == [200] * 256
    assert all(r.json()["meta_info"]["completion_tokens"] == 2 for r in replies)
    assert served.engine.num_running() == 0
    gc.collect()
    rss_mb.append(_rss_mb())
  assert rss_mb[1] - rss_mb[0] < 64, f"RSS grew from {rss_mb[0]:.0f} MB to {rss_mb[1]:.0f} MB between bursts"


def _rss_mb() -> float:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_openai_client_completions_and_chat(served):
  client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="unused")
  ids = [21, 22, 23, 24]
  ref = _greedy(served, ids, n=6)
  comp = client.completions.create(
    model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
  )
  choice = comp.choices[0]
  assert choice.text == ref["text"] and choice.finish_reason == "length"
  np.testing.assert_allclose(
    choice.logprobs.token_logprobs, [e[0] for e in ref["meta_info"]["output_token_logprobs"]], atol=1e-5
  )
  assert all(len(t) == 3 for t in choice.logprobs.top_logprobs)
  assert comp.usage.prompt_tokens == 4 and comp.usage.completion_tokens == 6
  two = client.completions.create(model="tiny", prompt="Once", max_tokens=4, n=2, seed=1)
  assert len(two.choices) == 2
  messages = [{"role": "user", "content": "Say hi"}]
  resp = client.chat.completions.create(
    model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
  )
  prompt_ids, _ = chat.render_chat(messages, tokenizer=served.tok, add_generation_prompt=True)
  raw = _post(
    served,
    "generate",
    {"input_ids": prompt_ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
  )
  assert [c.logprob for c in resp.choices[0].logprobs.content] == pytest.approx(
    [e[0] for e in raw["meta_info"]["output_token_logprobs"]], abs=1e-5
  )
  assert resp.usage.prompt_tokens == len(prompt_ids)


TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "get_weather",
      "description": "Weather for a city",
      "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
    },
  }
]


def test_openai_chat_tool_call_from_model_output(served, bigram_dir, bigram_args):
  """The served weights are set to greedily emit a K2 tool-call section (see `bigram_dir`); the server
  must parse the generated tokens into OpenAI `tool_calls`."""
  _post(served, "update_weights_from_disk", {"model_path": bigram_dir})
  try:
    client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="unused")
    resp = client.chat.completions.create(
      model="tiny", messages=[{"role": "user", "content": "Paris, 3 days?"}], tools=TOOLS, temperature=0, max_tokens=30
    )
  finally:
    _post(served, "update_weights_from_disk", {"model_path": served.hf_dir})
  choice = resp.choices[0]
  assert choice.finish_reason == "tool_calls"
  (call,) = choice.message.tool_calls
  assert call.id == "functions.get_weather:0" and call.function.name == "get_weather"
  assert json.loads(call.function.arguments) == json.loads(bigram_args)


@pytest.fixture(scope="module")
def bigram_args(served):
  # Arguments whose tokens do not repeat (each token of the chain needs a single successor); a string
  # value would repeat the `"` token, so the argument is a number.
  for args in ('{"days": 3}', '{"days":3}', '{"q": 1}'):
    if len(set(_chain(served.tok, args))) == len(_chain(served.tok, args)):
      return args
  pytest.fail("no argument string with distinct tokens under this tokenizer")


def _chain(tok, args):
  sp = tok.special_ids
  return (
    [sp["<|im_middle|>"], sp["<|tool_calls_section_begin|>"], sp["<|tool_call_begin|>"]]
    + tok.encode("functions.get_weather:0")
    + [sp["<|tool_call_argument_begin|>"]]
    + tok.encode(args)
    + [sp["<|tool_call_end|>"], sp["<|tool_calls_section_end|>"]]
  )


@pytest.fixture(scope="module")
def bigram_dir(served, bigram_args, tmp_path_factory):
  """HF dir of a model whose greedy continuation of `<|im_middle|>` is a fixed tool call.

  Attention outputs (w_o) and every MLP/expert down projection are zero, so the final hidden state is
  the current token's embedding: the model is a bigram table. Chain token i embeds as basis vector e_i
  and the LM head maps e_i to chain token i+1 with a large logit, ending in <|im_end|>.
  """
  cfg = served.model.cfg
  state = nnx.to_pure_dict(nnx.state(K2Model(cfg, rngs=nnx.Rngs(1))))
  state = __import__("jax").tree.map(np.array, state)
  for stack, paths in (
    ("dense_layers", (("attn", "w_o"), ("mlp", "w_down"))),
    ("moe_layers", (("attn", "w_o"), ("moe", "experts", "w_down"), ("moe", "shared", "w_down"))),
  ):
    for path in paths:
      leaf = state[stack]
      for key in path[:-1]:
        leaf = leaf[key]
      leaf[path[-1]][...] = 0
  chain = _chain(served.tok, bigram_args) + [served.tok.special_ids["<|im_end|>"]]
  emb, head = state["embed"]["embedding"], state["lm_head"]["w"]
  assert len(chain) - 1 <= cfg.hidden_size
  for i, (a, b) in enumerate(zip(chain, chain[1:])):
    emb[a] = 0
    emb[a, i] = 1.0
    head[i, b] += 10.0
  path = os.path.join(served.weights_root, "bigram_hf")
  k2jax.save_hf(model_from_state(cfg, state), path)
  return path


def test_k2jax_rl_http_client_accepts_our_answers(served):
  """The RL side's SGLang client (which validates every field) talks to this server unchanged."""
  from k2jax.engine.base import GenerateRequest, SamplingParams
  from k2jax.engine.http import HttpEngine, HttpEngineConfig

  client = HttpEngine(HttpEngineConfig(url=served.server.url))
  assert client.health() and client.model_info()["model_path"]
  res = client.generate(GenerateRequest("rl-0", (7, 8, 9), SamplingParams(max_new_tokens=5, seed=3)))
  assert res.completion_tokens == len(res.output_ids) == 5 and res.finish_reason in ("stop", "length")
  client.update_weights(served.hf_dir, 41)
  again = client.generate(GenerateRequest("rl-1", (7, 8, 9), SamplingParams(max_new_tokens=5, seed=3)))
  assert again.weight_versions == (41,) * 5 and again.output_ids == res.output_ids  # same weights, same seed
  client.flush_cache()


def test_update_weights_from_a_weight_sync_delta(served):
  """RL weight sync writes only changed tensors (no config.json): the server overlays them."""
  from safetensors.numpy import save_file

  before = _greedy(served, [3, 1, 4, 1, 5])
  tmp_path = pathlib.Path(served.weights_root)
  delta = tmp_path / "delta"
  delta.mkdir()
  lm = np.asarray(served.model.lm_head.w[...]).T.copy()  # HF [S, D]
  lm[:, :] = 0.0
  lm[7] = 1.0  # every hidden state now prefers token 7 or -7
  save_file({"lm_head.weight": lm}, str(delta / "model-00001-of-00001.safetensors"))
  (delta / "model.safetensors.index.json").write_text(
    json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}})
  )
  try:
    res = _post(served, "update_weights_from_disk", {"model_path": str(delta), "weight_version": "11"})
    assert res["success"] is True and res["weight_version"] == "11"
    after = _greedy(served, [3, 1, 4, 1, 5])
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "11"
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"lm_head.weight": lm[:, :3].copy()}, str(bad / "m.safetensors"))
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "m.safetensors"}}))
    err = _post(served, "update_weights_from_disk", {"model_path": str(bad)}, status=400)
    assert "lm_head.weight" in err["message"] and "shape" in err["message"]
    assert _greedy(served, [3, 1, 4, 1, 5])["output_ids"] == after["output_ids"]  # failed update changed nothing
  finally:
    res = _post(served, "update_weights_from_disk", {"model_path": served.hf_dir})
  assert _greedy(served, [3, 1, 4, 1, 5])["output_ids"] == before["output_ids"]
