"""Who a client is and what it may do: with an API key every route but /health needs it, several keys are
several clients, an empty key is refused at start, and one client's flood of requests cannot delay another
client's request (clients take turns in the engine: `k2jax.serve.fair`)."""

import concurrent.futures
import dataclasses
import http.client
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import requests
from fastapi.routing import APIRoute

from k2jax.httpservice import HttpLimits
from k2jax.serve.server import OPEN_ROUTES

from .conftest import MAX_LEN

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A body each route accepts (the key check comes first, so an invalid body would do too, but a valid one
# shows that the right key gets through to the route itself).
_BODIES = {
  "/generate": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
  "/v1/completions": {"prompt": [1, 2], "max_tokens": 1},
  "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
  "/abort_request": {"abort_all": True},
  "/tokenize": {"prompt": "hi"},
  "/detokenize": {"tokens": [1, 2]},
  "/update_weights_from_disk": {"model_path": "/nonexistent/weights"},
}


@pytest.fixture
def keyed(served):
  """The shared server with two API keys for the test's duration."""
  app = served.server.app
  limits = app.state.limits
  app.state.limits = dataclasses.replace(limits, api_key=("k-one", "k-two"))
  yield served
  app.state.limits = limits


def _call(url: str, method: str, path: str, key: str | None):
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  if method == "GET":
    return requests.get(url + path, headers=headers, timeout=120)
  return requests.post(url + path, json=_BODIES.get(path), headers=headers, timeout=120)


def test_every_route_but_health_needs_the_key(keyed):
  url = keyed.server.url
  routes = [(m, r.path) for r in keyed.server.app.routes if isinstance(r, APIRoute) for m in sorted(r.methods)]
  guarded = [(m, p) for m, p in routes if p not in OPEN_ROUTES]
  assert {p for _, p in guarded} >= {"/generate", "/get_model_info", "/get_server_info", "/v1/models", "/tokenize"}
  for method, path in guarded:
    for key in (None, "wrong", "k-one" + "x"):
      r = _call(url, method, path, key)
      assert r.status_code == 401, (method, path, key, r.text)
      assert "API key" in r.json()["error"]["message"] and keyed.hf_dir not in r.text  # no path leaks
    for key in ("k-one", "k-two"):
      assert _call(url, method, path, key).status_code != 401, (method, path, key)
  for path in OPEN_ROUTES:
    assert requests.get(url + path, timeout=120).status_code == 200, path
  info = _call(url, "GET", "/get_model_info", "k-two").json()
  assert info["model_path"] == keyed.hf_dir  # the key holder still gets it


def test_an_empty_key_is_refused():
  for bad in ("", ("k", "")):
    with pytest.raises(ValueError, match="empty key"):
      HttpLimits(api_key=bad)
  with pytest.raises(ValueError, match="twice"):
    HttpLimits(api_key=("k", "k"))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  cmd = [sys.executable, str(ROOT / "launch" / "serve.py"), "--model=/nonexistent/model", "--api_key="]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode != 0 and "--api_key is empty" in out.stderr, out.stderr[-2000:]


def _post_from(served, source: str, path: str, body: dict, key: str | None = None) -> dict:
  """A request from the loopback address `source` (127.0.0.0/8 is all this host): another peer."""
  host, port = served.server.url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=300, source_address=(source, 0))
  headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
  try:
    conn.request("POST", path, json.dumps(body), headers)
    r = conn.getresponse()
    assert r.status == 200, r.read()
    return json.loads(r.read())
  finally:
    conn.close()


def _flood_then_innocent(served, flood_client: str, post_flood, post_innocent, key: str | None = None) -> None:
  """12 requests of MAX_LEN - 8 tokens from one client fill its share of the engine; another client's
  4-token request must then finish before any of the 12 has (each needs ~15x its decode steps)."""
  n, slots = 12, served.engine.config.max_slots
  per_client = served.server.caps.slots_per_client(slots)
  body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": MAX_LEN - 8, "ignore_eos": True}}
  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    flood = [pool.submit(post_flood, {**body, "input_ids": [1, 2, 3, 4 + i]}) for i in range(n)]
    deadline = time.monotonic() + 120
    while served.server.fair.client_load(flood_client) != (n, per_client) and time.monotonic() < deadline:
      time.sleep(0.005)
    assert served.server.fair.client_load(flood_client) == (n, per_client)  # the flood holds its share
    out = post_innocent({"input_ids": [9, 8, 7, 6], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 4
    assert not any(f.done() for f in flood) and served.server.fair.client_load(flood_client)[0] == n
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = requests.post(f"{served.server.url}/abort_request", json={"abort_all": True}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert all(f.result()["meta_info"]["finish_reason"]["type"] == "abort" for f in flood)
  assert served.server.num_running() == 0


def test_a_flood_from_one_peer_does_not_delay_another_peers_request(served):
  _flood_then_innocent(
    served,
    "peer:127.0.0.1",
    lambda b: _post_from(served, "127.0.0.1", "/generate", b),
    lambda b: _post_from(served, "127.0.0.2", "/generate", b),
  )


def test_two_keys_are_two_clients_on_one_host(keyed):
  _flood_then_innocent(
    keyed,
    "key:0",
    lambda b: _post_from(keyed, "127.0.0.1", "/generate", b, key="k-one"),
    lambda b: _post_from(keyed, "127.0.0.1", "/generate", b, key="k-two"),
    key="k-one",
  )
