"""A local SGLang-API server (127.0.0.1, free port) backed by any `Engine`, with injectable faults.

`flavor` picks whose shapes it mimics (reference §2.6): "sglang" (update routes, `weight_version` in
model info and replies, `enable_deterministic_inference` in server info) or "sglang-jax" (no update
route: 404; no weight version anywhere; `enable_deterministic_sampling`). Like FastAPI, a GET on a
POST-only route answers 405 and an unknown route 404. Faults `abort_before_prefill` and `dup50`
/ `dup50_mismatch` send the real servers' replies for a request aborted while queued and sglang-jax's
repeated leading 50 logprob entries.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from safetensors.numpy import load_file

from k2jax.engine.base import Engine, GenerateRequest, SamplingParams

FAULTS = (
  "malformed_json",
  "short_logprobs",
  "dup_logprobs",
  "wrong_ids",
  "bad_finish",
  "bad_count",
  "hang",
  "drop",
  "http500",
  "http400",
  "abort_before_prefill",
  "dup50",
  "dup50_mismatch",
  "no_version",
  "detok_dropped_id",
)
FLAVORS = ("sglang", "sglang-jax")
POST_ROUTES = ("generate", "abort_request", "update_weights_from_disk")


class FakeSglangServer:
  """`faults` is a queue of fault names consumed one per /generate call (empty = behave)."""

  def __init__(self, engine: Engine, hang_s: float = 5.0, flavor: str = "sglang", deterministic: bool = True):
    if flavor not in FLAVORS:
      raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    self.engine = engine
    self.hang_s = hang_s
    self.flavor = flavor
    self.deterministic = deterministic
    self.faults: collections.deque[str] = collections.deque()
    self.calls: collections.Counter[str] = collections.Counter()
    self.loaded: list[tuple[str, int, list[str]]] = []  # (path, version, tensor names)
    self._lock = threading.Lock()
    self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
    self._httpd.daemon_threads = True
    self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self._httpd.server_address[1]}"

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._httpd.shutdown()
    self._httpd.server_close()

  def next_fault(self) -> str | None:
    with self._lock:
      return self.faults.popleft() if self.faults else None

  def generate(self, body: dict) -> dict:
    sp = body.get("sampling_params", {})
    req = GenerateRequest(
      rid=body["rid"],
      input_ids=tuple(body["input_ids"]),
      sampling=SamplingParams(
        max_new_tokens=sp["max_new_tokens"],
        temperature=sp["temperature"],
        top_p=sp["top_p"],
        top_k=sp["top_k"],
        stop_token_ids=tuple(sp["stop_token_ids"]),
        seed=sp.get("sampling_seed"),
      ),
    )
    res = self.engine.generate(req)
    finish = {
      "stop": {"type": "stop", "matched": res.matched_stop},
      "length": {"type": "length", "length": len(res.output_ids)},
      "abort": {"type": "abort", "message": res.abort_message},
    }[res.finish_reason]
    version = res.weight_versions[-1] if res.weight_versions else 0
    out = {
      "text": " ".join(map(str, res.output_ids)),
      "output_ids": list(res.output_ids),
      "meta_info": {
        "id": res.rid,
        "finish_reason": finish,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "weight_version": str(version),
        "cached_tokens": 0,
        "e2e_latency": 0.0,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(res.output_logprobs, res.output_ids)],
      },
    }
    if self.flavor == "sglang-jax":
      del out["meta_info"]["weight_version"]
    return out

  def server_info(self) -> dict:
    if self.flavor == "sglang-jax":  # server_args fields of sglang-jax (cddbf6f) plus its version
      args = {"enable_deterministic_sampling": self.deterministic, "precompile_token_paddings": None}
      return {"model_path": "fake", "tp_size": 1, "device": "cpu", **args, "version": "0.0.3rc98"}
    return {
      "model_path": "fake",
      "tp_size": 1,
      "enable_deterministic_inference": self.deterministic,
      "weight_version": "default",
      "version": "0.5.0",
    }

  def model_info(self) -> dict:
    info = {"model_path": "fake", "tokenizer_path": None, "is_generation": True, "preferred_sampling_params": None}
    if self.flavor == "sglang":
      info["weight_version"] = "default"
    return info

  def has_route(self, route: str) -> bool:
    return not (self.flavor == "sglang-jax" and route == "update_weights_from_disk")

  def update_weights(self, body: dict) -> dict:
    path, version = body["model_path"], int(body["weight_version"])
    names = []
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
      names += list(load_file(f))
    if not names:
      return {"success": False, "message": f"no safetensors in {path}", "num_paused_requests": 0}
    self.engine.update_weights(path, version)
    self.loaded.append((path, version, sorted(names)))
    return {"success": True, "message": "ok", "num_paused_requests": 0}


def _make_handler(server: FakeSglangServer):
  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
      pass

    def _reply(self, code: int, payload, raw: bytes | None = None):
      data = raw if raw is not None else json.dumps(payload).encode()
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def do_GET(self):
      route = self.path.strip("/").split("?")[0]
      server.calls[route] += 1
      if route == "health":
        return self._reply(200, None, raw=b"")
      if route == "get_model_info":
        return self._reply(200, server.model_info())
      if route == "get_server_info":
        return self._reply(200, server.server_info())
      if route == "flush_cache":
        return self._reply(200, None, raw=b"Cache flushed.")
      if route in POST_ROUTES and server.has_route(route):
        return self._reply(405, {"detail": "Method Not Allowed"})
      self._reply(404, {"detail": "Not Found"})

    def do_POST(self):
      route = self.path.strip("/")
      server.calls[route] += 1
      body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
      if route == "generate":
        return self._generate(body)
      if route == "abort_request":
        server.engine.abort([body["rid"]])
        return self._reply(200, None, raw=b"")
      if route == "update_weights_from_disk" and server.has_route(route):
        return self._reply(200, server.update_weights(body))
      if route == "flush_cache":
        return self._reply(200, None, raw=b"Cache flushed.")
      self._reply(404, {"error": route})

    def _generate(self, body):
      fault = server.next_fault()
      if fault == "drop":
        self.close_connection = True
        return
      if fault == "hang":
        time.sleep(server.hang_s)
        return
      if fault in ("http500", "http400"):
        return self._reply(int(fault[4:]), {"error": fault})
      if fault == "malformed_json":
        return self._reply(200, None, raw=b'{"text": "x", "output_ids": [1, 2')
      if fault == "abort_before_prefill":  # sglang-jax tokenizer_manager._handle_abort_req, verbatim shape
        finish = {"type": "abort", "message": "Abort before prefill"}
        meta = {"id": body["rid"], "finish_reason": finish, "prompt_tokens": 0, "completion_tokens": 0}
        return self._reply(200, {"text": "", "meta_info": meta})
      out = server.generate(body)
      _corrupt(out, fault)
      self._reply(200, out)

  return Handler


def _corrupt(out: dict, fault: str | None) -> None:
  meta = out["meta_info"]
  if fault == "short_logprobs":
    meta["output_token_logprobs"] = meta["output_token_logprobs"][:-1]
  elif fault == "dup_logprobs":  # the sglang-jax bug of reference §2.6
    meta["output_token_logprobs"] += meta["output_token_logprobs"][:2]
  elif fault == "wrong_ids":
    meta["output_token_logprobs"][0][1] += 1
  elif fault == "bad_finish":
    meta["finish_reason"] = {"type": "exploded"}
  elif fault == "bad_count":
    meta["completion_tokens"] += 1
  elif fault == "dup50":  # sglang-jax past 50 tokens: the first 50 entries again in front
    meta["output_token_logprobs"] = meta["output_token_logprobs"][:50] + meta["output_token_logprobs"]
  elif fault == "dup50_mismatch":  # 50 extra entries that are not a repeat of the leading block
    lps = meta["output_token_logprobs"]
    meta["output_token_logprobs"] = [[lp - 0.5, t, x] for lp, t, x in lps[:50]] + lps
  elif fault == "no_version":
    meta.pop("weight_version", None)
  elif fault == "detok_dropped_id":  # sglang-jax's detokenizer held back a token decoding to incomplete UTF-8
    del out["output_ids"][1]
