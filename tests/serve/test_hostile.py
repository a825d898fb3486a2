"""The server without a key cannot be starved: per-request caps, fair interleaving of a
full batch, header timeouts and a connection limit, 409 for a reused rid, and malformed weight files."""

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import socket
import stat
import struct
import time

import numpy as np
import pytest
import requests

from k2jax.serve import server as server_mod
from k2jax.serve.limits import RequestCaps

from .conftest import MAX_LEN

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _post(served, route, body, status=200, **kw):
  r = requests.post(f"{served.server.url}/{route}", json=body, timeout=120, **kw)
  assert r.status_code == status, r.text
  return r.json()


def _greedy(served, ids, n=6):
  body = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
  return _post(served, "generate", body)


CAPS = RequestCaps()
_SP = {"max_new_tokens": 1}
OVER_CAP = [
  ("generate", {"input_ids": [[1, 2]] * 129, "sampling_params": _SP}, "input_ids", "max_batch_size=128"),
  ("generate", {"text": ["hi"] * 129, "sampling_params": _SP}, "text", "max_batch_size=128"),
  ("generate", {"input_ids": [1, 2], "sampling_params": {"stop": ["x"] * 33}}, "sampling_params.stop", "=32"),
  ("generate", {"input_ids": [1, 2], "sampling_params": {"stop": ["y" * 4097]}}, "sampling_params.stop", "=4096"),
  (
    "generate",
    {"input_ids": [[1], [2]], "sampling_params": [_SP, {"stop": ["x"] * 1_000}]},
    "sampling_params[1].stop",
    "max_stop_strings=32",
  ),
  (
    "generate",
    {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [3] * 257}},
    "sampling_params.stop_token_ids",
    "max_stop_token_ids=256",
  ),
  ("generate", {"text": "z" * 500 + "é" * 300}, "text", "max_prompt_bytes=1000"),  # 1100 bytes
  ("v1/completions", {"prompt": [[1, 2]] * 65, "n": 2}, "prompt", "max_batch_size=128"),
  ("v1/completions", {"prompt": "hi", "stop": ["s"] * 33}, "stop", "max_stop_strings=32"),
  (
    "v1/chat/completions",
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}] * 129},
    "tools",
    "max_tools=128",
  ),
  (
    "v1/chat/completions",
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "w" * 1001}]}]},
    "messages",
    "max_prompt_bytes=1000",
  ),
]


@pytest.mark.parametrize("route,body,field,cap", OVER_CAP, ids=[f"{r}:{f}:{c}" for r, _, f, c in OVER_CAP])
def test_over_a_cap_is_400_naming_the_cap_and_value(served, route, body, field, cap):
  caps = served.server.caps
  served.server.caps = dataclasses.replace(caps, max_prompt_bytes=1000)  # prompts over 1 MiB exceed the body cap
  try:
    err = _post(served, route, body, status=400)["error"]
  finally:
    served.server.caps = caps
  assert err["param"] == field and cap in err["message"] and "--max_" in err["message"], err


def test_a_request_at_the_caps_is_served(served):
  sp = {"max_new_tokens": 1, "stop": ["q" * 64] * 32, "stop_token_ids": list(range(256))}
  out = _post(served, "generate", {"input_ids": [[1, 2]] * 128, "sampling_params": sp})
  assert len(out) == 128 and all(o["meta_info"]["completion_tokens"] == 1 for o in out)


def test_body_over_its_cap_is_413_naming_it(served):
  limit = served.server.app.state.limits.max_body_bytes
  r = requests.post(f"{served.server.url}/generate", data=b" " * (limit + 1), timeout=30)
  assert r.status_code == 413 and f"max_body_bytes={limit}" in r.json()["error"]["message"]


def test_every_cap_is_a_launch_flag():
  text = (ROOT / "launch" / "serve.py").read_text()
  for name in [f.name for f in dataclasses.fields(RequestCaps)] + [
    "max_body_bytes",
    "header_timeout_s",
    "keep_alive_timeout_s",
    "max_connections",
  ]:
    assert f'"{name}"' in text, name


def test_a_full_batch_does_not_starve_a_small_request(served):
  """The batch's prompts take turns: a request sent while a 128-prompt batch runs is answered while
  almost all of the batch is still to do (FIFO admission would answer it after the whole batch)."""
  body = {
    "input_ids": [[1, 2, 3, 4 + i] for i in range(128)],
    "sampling_params": {"max_new_tokens": 24, "ignore_eos": True},
  }
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    batch = pool.submit(requests.post, f"{served.server.url}/generate", json=body, timeout=600)
    deadline = time.monotonic() + 60
    while served.server.num_running() < 128 and time.monotonic() < deadline:
      time.sleep(0.005)
    assert served.server.num_running() == 128
    assert _greedy(served, [9, 8, 7], n=4)["meta_info"]["completion_tokens"] == 4
    left = served.server.num_running()
    # ahead of it at most: the prompts in the engine (slots + headroom) and those finishing beside it
    assert left >= 128 - 4 * served.engine.config.max_slots, f"only {left} of 128 batch prompts left"
    out = batch.result()
  assert out.status_code == 200 and len(out.json()) == 128
  assert served.server.num_running() == 0


def _stream(served, body):
  return requests.post(f"{served.server.url}/generate", json={**body, "stream": True}, stream=True, timeout=120)


def test_a_reused_in_flight_rid_is_409_and_the_first_request_finishes(served):
  body = {"input_ids": [5, 6, 7], "rid": "dup", "sampling_params": {"max_new_tokens": MAX_LEN - 8, "ignore_eos": True}}
  with _stream(served, body) as first:
    assert first.status_code == 200
    lines = first.iter_lines()
    assert next(line for line in lines if line.startswith(b"data: "))  # it is running
    for again in (_stream(served, body), requests.post(f"{served.server.url}/generate", json=body, timeout=60)):
      assert again.status_code == 409, again.text
      err = again.json()["error"]
      assert err["param"] == "rid" and "'dup'" in err["message"] and "in flight" in err["message"]
    batch = {"input_ids": [[1], [2]], "rid": ["other", "dup"], "sampling_params": {"max_new_tokens": 1}}
    assert _post(served, "generate", batch, status=409)["error"]["param"] == "rid"
    events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
  assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_LEN - 8}
  assert _post(served, "generate", {**body, "sampling_params": _SP})["meta_info"]["id"] == "dup"  # free again


def _open(served, payload: bytes) -> socket.socket:
  host, port = served.server.url.removeprefix("http://").split(":")
  sock = socket.create_connection((host, int(port)), timeout=30)
  if payload:
    sock.sendall(payload)
  return sock


def test_idle_and_partial_header_connections_cannot_keep_a_request_out(served):
  """300 connections that never finish their headers, over a limit of 50: the oldest are evicted, the
  open count stays at the limit, and an innocent request (new connection) is answered."""
  guard = served.server.connections
  limit, evicted = guard.limit, guard.evicted
  guard.limit = 50
  socks = []
  try:
    for i in range(300):
      socks.append(_open(served, b"" if i % 2 else b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le"))
    deadline = time.monotonic() + 30
    while guard.evicted - evicted < 250 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert guard.evicted - evicted >= 250 and guard.open <= 50
    assert _greedy(served, [3, 4, 5], n=3)["meta_info"]["completion_tokens"] == 3
    try:
      assert socks[0].recv(1) == b""  # the oldest were closed
    except ConnectionResetError:
      pass
  finally:
    guard.limit = limit
    for sock in socks:
      sock.close()


def test_headers_must_arrive_in_time_and_idle_connections_close(served):
  guard = served.server.connections
  timed_out, timeout = guard.timed_out, guard.header_timeout_s
  t0 = time.monotonic()
  # One byte per 0.3 s keeps the connection busy sending, but the timer runs from its first byte.
  sock = _open(served, b"P")
  with pytest.raises((ConnectionError, BrokenPipeError, OSError)):
    for c in b"OST /generate HTTP/1.1\r\nHost: x\r\n" * 20:
      sock.sendall(bytes([c]))
      time.sleep(0.3)
      assert time.monotonic() - t0 < 10 * timeout
  sock.close()
  assert guard.timed_out == timed_out + 1
  keep_alive = served.server.app.state.limits.keep_alive_timeout_s
  sock = _open(served, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
  assert sock.recv(4096).startswith(b"HTTP/1.1 200")
  t0 = time.monotonic()
  assert sock.recv(1) == b""  # closed by the server once idle
  assert time.monotonic() - t0 < keep_alive + 5
  sock.close()


def test_connection_limit_stays_below_the_fd_limit():
  import resource

  from k2jax.httpservice import HttpLimits

  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  assert HttpLimits().connection_limit() <= soft - 128
  assert HttpLimits(max_connections=10 * soft).connection_limit() <= soft - 128
  assert HttpLimits(max_connections=7).connection_limit() == 7


# ---- malformed weight files -----------------------------------------------------------------------------
def _shard(header, data: bytes = b"", length: int | None = None) -> bytes:
  raw = header if isinstance(header, bytes) else json.dumps(header).encode()
  return struct.pack("<Q", len(raw) if length is None else length) + raw + data


_LM = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
BAD_SHARDS = [
  ("length_past_end", _shard({"lm_head.weight": _LM}, b"\0" * 16, length=1 << 40), "header length"),
  ("length_zero", _shard(b"", length=0), "header length"),
  ("not_json", _shard(b"{not json", b""), "not valid UTF-8 JSON"),
  ("json_list", _shard([1, 2, 3]), "JSON list, not an object"),
  ("offsets_past_end", _shard({"lm_head.weight": {**_LM, "data_offsets": [0, 1 << 30]}}, b"\0" * 16), "outside"),
  ("offsets_reversed", _shard({"lm_head.weight": {**_LM, "data_offsets": [16, 0]}}, b"\0" * 16), "outside"),
  ("size_mismatch", _shard({"lm_head.weight": {**_LM, "data_offsets": [0, 8]}}, b"\0" * 16), "needs 16"),
  ("bad_dtype", _shard({"lm_head.weight": {**_LM, "dtype": "F3"}}, b"\0" * 16), "unknown dtype"),
  ("negative_shape", _shard({"lm_head.weight": {**_LM, "shape": [-1, 2]}}, b"\0" * 16), "shape"),
  ("short_file", b"\x01\x02", "too short"),
]


def _delta(served, name: str, shard: bytes | None, shard_name: str = "m.safetensors") -> str:
  d = pathlib.Path(served.weights_root) / f"bad_{name}"
  d.mkdir(exist_ok=True)
  if shard is not None:
    (d / shard_name).write_bytes(shard)
  (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard_name}}))
  return str(d)


@pytest.fixture(scope="module")
def greedy_before(served):
  return _greedy(served, [3, 1, 4, 1, 5])["output_ids"]


@pytest.mark.parametrize("name,shard,problem", BAD_SHARDS, ids=[b[0] for b in BAD_SHARDS])
def test_malformed_safetensors_is_400_and_the_old_weights_keep_serving(served, greedy_before, name, shard, problem):
  path = _delta(served, name, shard)
  res = _post(served, "update_weights_from_disk", {"model_path": path}, status=400)
  assert res["success"] is False and problem in res["message"] and "m.safetensors" in res["message"], res
  assert _greedy(served, [3, 1, 4, 1, 5])["output_ids"] == greedy_before


def test_weight_files_outside_the_roots_are_refused(served, greedy_before, tmp_path):
  outside = tmp_path / "elsewhere.safetensors"
  outside.write_bytes(_shard({"lm_head.weight": _LM}, b"\0" * 16))
  link = _delta(served, "symlink", None)
  os.symlink(outside, os.path.join(link, "m.safetensors"))
  for body in ({"model_path": link}, {"model_path": str(tmp_path)}, {"model_path": os.path.dirname(served.hf_dir)}):
    res = _post(served, "update_weights_from_disk", body, status=403)
    assert res["success"] is False and ("outside" in res["message"] or "weights root" in res["message"]), res
  escape = _delta(served, "escape", None, shard_name="../../elsewhere.safetensors")
  assert _post(served, "update_weights_from_disk", {"model_path": escape}, status=403)["success"] is False
  assert _greedy(served, [3, 1, 4, 1, 5])["output_ids"] == greedy_before


def test_weights_root_is_never_wider_than_the_model_dir(tmp_path):
  """Default: only the served model's own dir (not its parent); a dir every user may write is never a root."""
  shared = tmp_path / "shared"
  model = shared / "model"
  model.mkdir(parents=True)
  shared.chmod(0o1777)  # like /tmp
  assert server_mod.weight_roots(str(model), None) == [str(model.resolve())]
  model.chmod(0o777)  # a model saved straight into a world-writable dir: no default root at all
  assert server_mod.weight_roots(str(model), None) == []
  with pytest.raises(ValueError, match="writable by every user"):
    server_mod.weight_roots(str(model), str(shared))
  own = tmp_path / "sync"
  own.mkdir()
  assert os.stat(own).st_mode & stat.S_IWOTH == 0
  assert server_mod.weight_roots(str(model), str(own)) == [str(own.resolve())]


def test_healthy_after_the_attacks(served, greedy_before):
  assert requests.get(f"{served.server.url}/health", timeout=60).status_code == 200
  assert served.server.num_running() == 0 and served.server.connections.open <= served.server.connections.limit
  assert np.array_equal(_greedy(served, [3, 1, 4, 1, 5])["output_ids"], greedy_before)
