"""The HTTP server: SGLang's API (`/generate`, weight updates, abort, cache, health, info) plus OpenAI's.

Built on the standard library's `ThreadingHTTPServer`: every request gets a thread that blocks on the
engine, which is exactly the engine's concurrency model, and k2jax then needs no web framework at run
time. Errors in a request's content answer 400 with `{"error": {"message", "param"}}` naming the field.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
import uuid
from http.server import ThreadingHTTPServer
from typing import Any

import jax
import numpy as np
from flax import nnx

import k2jax
from k2jax import jsonhttp
from k2jax.api import model_from_state
from k2jax.convert import overlay
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, Tokenizer, load_tokenizer
from k2jax.model.config import K2Config
from k2jax.model.transformer import K2Model
from k2jax.serve import openai_api, protocol
from k2jax.serve.engine import EngineConfig, InferenceEngine, InvalidRequest, Request, SamplingOptions

log = logging.getLogger(__name__)


class Server:
  """Loads a model (HF dir or k2jax workdir), runs an `InferenceEngine` and answers HTTP on host:port."""

  def __init__(
    self,
    model_path: str,
    *,
    engine_config: EngineConfig = EngineConfig(),
    host: str = "127.0.0.1",
    port: int = 30000,
    tokenizer_path: str | None = "auto",
    served_model_name: str | None = None,
  ):
    self.model_path = model_path
    model = k2jax.load(model_path)
    self.cfg: K2Config = model.cfg
    self._served_state = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))  # host copy, for deltas
    self.tokenizer = resolve_tokenizer(model_path, tokenizer_path, self.cfg.vocab_size)
    self.model_name = served_model_name or os.path.basename(os.path.normpath(model_path))
    self.engine = InferenceEngine(
      model,
      engine_config,
      eos_token_ids=eos_ids(self.cfg, self.tokenizer),
      detokenize=self.tokenizer.decode if self.tokenizer else None,
    )
    self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
    self._httpd.daemon_threads = True
    self._thread: threading.Thread | None = None

  @property
  def url(self) -> str:
    host, port = self._httpd.server_address[:2]
    return f"http://{host}:{port}"

  def start(self) -> "Server":
    """Serves on a background thread (tests, the embedded RL engine)."""
    self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name="k2jax-http")
    self._thread.start()
    return self

  def serve_forever(self) -> None:
    self._httpd.serve_forever()

  def close(self) -> None:
    self._httpd.shutdown()
    self._httpd.server_close()
    self.engine.close()

  # ---- routes: (method, path) -> handler(body) -> (status, payload) ---------------------------------
  def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
    routes = {
      "generate": self.generate,
      "abort_request": self.abort_request,
      "update_weights_from_disk": self.update_weights_from_disk,
      "flush_cache": self.flush_cache,
      "health": self.health,
      "health_generate": self.health,
      "get_model_info": self.model_info,
      "model_info": self.model_info,
      "get_server_info": self.server_info,
      "server_info": self.server_info,
      "v1/models": self.list_models,
      "v1/completions": lambda b: (200, openai_api.completions(b, self.engine, self.tokenizer, self.model_name)),
      "v1/chat/completions": lambda b: (
        200,
        openai_api.chat_completions(b, self.engine, self.tokenizer, self.model_name),
      ),
    }
    post_only = ("generate", "abort_request", "update_weights_from_disk", "v1/completions", "v1/chat/completions")
    if path not in routes:
      return 404, {"error": {"message": f"no route /{path}", "code": 404}}
    if method == "GET" and path in post_only:
      return 405, {"error": {"message": f"/{path} needs POST", "code": 405}}
    return routes[path](body)

  def generate(self, body: Any) -> tuple[int, Any]:
    call = protocol.parse_generate(body, self.tokenizer, self.engine.config.num_top_logprobs)
    handles = []
    try:
      for req in call.requests:
        handles.append(self.engine.submit(req))
    except InvalidRequest:
      for h in handles:
        self.engine.abort(h.request.rid)
      raise
    outs = [protocol.generate_response(self.engine.wait(h), o, self.tokenizer) for h, o in zip(handles, call.options)]
    return 200, outs if call.batch else outs[0]

  def abort_request(self, body: Any) -> tuple[int, Any]:
    body = body or {}
    abort_all = protocol.get_bool(body, "abort_all", False)
    rid = body.get("rid")
    if not abort_all and (not isinstance(rid, str) or not rid):
      raise InvalidRequest("rid", "give a request id (string) or abort_all: true")
    self.engine.abort(rid, abort_all=abort_all)
    return 200, None

  def update_weights_from_disk(self, body: Any) -> tuple[int, Any]:
    if not isinstance(body, dict):
      raise InvalidRequest("body", "must be a JSON object")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
      raise InvalidRequest("model_path", "required: an HF directory or a k2jax workdir")
    version = body.get("weight_version")
    if version is not None and not str(version).lstrip("-").isdigit():
      raise InvalidRequest("weight_version", f"must be an integer (or its string), got {version!r}")
    if body.get("load_format") not in (None, "auto"):
      raise InvalidRequest("load_format", f"only 'auto' is supported, got {body['load_format']!r}")
    if protocol.get_bool(body, "abort_all_requests", False):
      self.engine.abort(abort_all=True)
    try:
      model = self._load_weights(path)
      new = self.engine.update_weights(
        model, None if version is None else int(version), flush_cache=protocol.get_bool(body, "flush_cache", True)
      )
    except (OSError, ValueError, KeyError) as e:  # missing files, bad config, shape mismatch
      return 400, {"success": False, "message": f"{path}: {e}", "num_paused_requests": 0}
    self.model_path = path
    return 200, {
      "success": True,
      "message": f"loaded {path} as weight version {new}",
      "num_paused_requests": 0,
      "weight_version": str(new),
    }

  def _load_weights(self, path: str) -> K2Model:
    """A full model (HF dir or workdir), or a weight-sync delta overlaid on the served weights."""
    if overlay.is_partial_hf_dir(path):
      state = overlay.overlay_hf_tensors(self.cfg, self._served_state, path)
      model = model_from_state(self.cfg, state)
    else:
      model = k2jax.load(path, param_dtype=self.cfg.param_dtype, compute_dtype=self.cfg.compute_dtype)
      if model.cfg.replace(extra=()) != self.cfg.replace(extra=()):
        raise ValueError("its config.json describes a different architecture than the served model")
      state = nnx.to_pure_dict(nnx.state(model))
    self._served_state = jax.tree.map(np.asarray, state)
    return model

  def flush_cache(self, body: Any) -> tuple[int, Any]:
    self.engine.flush_cache()
    return 200, "Cache flushed."

  def health(self, body: Any) -> tuple[int, Any]:
    """Like SGLang: a one-token generation when idle (proves the model runs), else just alive."""
    if self.engine.num_running():
      return 200, ""
    done = self.engine.generate(
      Request(f"health-{uuid.uuid4().hex}", (0,), SamplingOptions(max_new_tokens=1, temperature=0.0))
    )
    ok = done.finish["type"] != "abort"
    return (200, "") if ok else (503, {"error": {"message": done.finish.get("message"), "code": 503}})

  def model_info(self, body: Any) -> tuple[int, Any]:
    return 200, {
      "model_path": self.model_path,
      "tokenizer_path": self.tokenizer.path if self.tokenizer else None,
      "is_generation": True,
      "weight_version": str(self.engine.weight_version),
      "model_type": self.cfg.model_type,
      "architectures": list(self.cfg.architectures),
      "max_seq_len": self.engine.config.max_seq_len,
      "max_running_requests": self.engine.config.max_slots,
      "preferred_sampling_params": None,
    }

  def server_info(self, body: Any) -> tuple[int, Any]:
    """Identity and capabilities for the RL client's handshake (SGLang's route; `engine` names k2jax)."""
    c = self.engine.config
    return 200, {
      "engine": "k2jax",
      "version": importlib.metadata.version("k2jax"),
      "capabilities": {
        "weight_update": ["disk"],
        "weight_version": True,
        "seeded_sampling": True,  # keyed by (seed, position): resumed requests continue exactly
        "abort": True,
      },
      "model_path": self.model_path,
      "max_running_requests": c.max_slots,
      "max_seq_len": c.max_seq_len,
    }

  def list_models(self, body: Any) -> tuple[int, Any]:
    return 200, {
      "object": "list",
      "data": [{"id": self.model_name, "object": "model", "owned_by": "k2jax", "root": self.model_path}],
    }


def resolve_tokenizer(model_path: str, tokenizer_path: str | None, vocab_size: int) -> Tokenizer | None:
  """`auto`: the model dir's tiktoken.model, else the bundled BPE when its vocab fits; None: token ids only."""
  if tokenizer_path is None or tokenizer_path == "none":
    return None
  if tokenizer_path == "auto":
    own = os.path.join(model_path, "tiktoken.model")
    if os.path.isfile(own):
      tokenizer_path = own
    elif load_tokenizer(BUNDLED_TOKENIZER).vocab_size == vocab_size:
      tokenizer_path = BUNDLED_TOKENIZER
    else:
      log.warning("no tokenizer for %s (vocab %d): serving token ids only", model_path, vocab_size)
      return None
  tok = load_tokenizer(tokenizer_path)
  if tok.vocab_size != vocab_size:
    raise ValueError(
      f"tokenizer {tokenizer_path} has {tok.vocab_size} tokens but the model's vocab_size is {vocab_size}"
    )
  return tok


def eos_ids(cfg: K2Config, tok: Tokenizer | None) -> tuple[int, ...]:
  """Default stop tokens: the config's eos, and K2's [EOS] and <|im_end|> (end of an assistant turn)."""
  ids = {cfg.eos_token_id} if cfg.eos_token_id is not None else set()
  if tok is not None:
    ids |= {tok.eos_id, tok.special_ids["<|im_end|>"]}
  return tuple(sorted(ids))


def _make_handler(server: Server):
  return jsonhttp.make_handler(
    server.route,
    bad_request=InvalidRequest,
    log=log,
    bad_request_body=lambda e: {"error": {"message": str(e), "type": "BadRequestError", "param": e.field, "code": 400}},
  )
