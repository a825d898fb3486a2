"""Serve a k2jax workdir or HF directory with SGLang's HTTP API plus OpenAI's /v1 endpoints.

  python launch/serve.py --model=PATH --port=30000 [--max_running_requests=8 --max_seq_len=2048]

Routes: /generate, /update_weights_from_disk, /flush_cache, /abort_request, /health, /get_model_info,
/v1/completions, /v1/chat/completions (both with `stream: true`), /v1/models. With --api_key, the routes
that change state need `Authorization: Bearer <key>`.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from k2jax import compile_cache, host_malloc  # noqa: E402

from k2jax.engine import EngineConfig  # noqa: E402
from k2jax.httpservice import HttpLimits  # noqa: E402
from k2jax.serve import Server  # noqa: E402
from k2jax.serve.limits import RequestCaps  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "k2jax workdir or HF directory (config.json + safetensors).", required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 30000, "Port to bind.")
_SLOTS = flags.DEFINE_integer("max_running_requests", 8, "Requests decoded together (cache slots).")
_MAX_LEN = flags.DEFINE_integer("max_seq_len", 2048, "Prompt + generated tokens per request.")
_PREFIX = flags.DEFINE_integer("prefix_cache_entries", 16, "Finished sequences kept for prefix reuse.")
_PRECOMPILE = flags.DEFINE_bool(
  "precompile", True, "Compile every prefill bucket and the decode step before serving (sglang-jax's precompile)."
)
_TOKENIZER = flags.DEFINE_string(
  "tokenizer",
  "auto",
  "tiktoken rank file; 'auto' = <model>/tiktoken.model or the bundled BPE "
  "when the vocab matches; 'none' = token ids only.",
)
_NAME = flags.DEFINE_string("served_model_name", None, "Model name in OpenAI responses (default: dir name).")
_API_KEY = flags.DEFINE_string(
  "api_key", None, "Bearer token required on state-changing routes (weight updates, abort, flush); SGLang's --api-key."
)
_WEIGHTS_ROOT = flags.DEFINE_string(
  "weights_root",
  None,
  "/update_weights_from_disk loads only paths inside the served model's own dir or inside this dir (the one "
  "the trainer writes weight syncs to). Default: none, only the model's dir. Never a dir every user may "
  "write (/tmp itself is refused).",
)
_CAPS, _HTTP = RequestCaps(), HttpLimits()
_BATCH = flags.DEFINE_integer("max_batch_size", _CAPS.max_batch_size, "Prompts per request (batch, OpenAI n).")
_STOPS = flags.DEFINE_integer("max_stop_strings", _CAPS.max_stop_strings, "Stop strings per prompt.")
_STOP_BYTES = flags.DEFINE_integer("max_stop_bytes", _CAPS.max_stop_bytes, "UTF-8 bytes of a prompt's stop strings.")
_STOP_IDS = flags.DEFINE_integer("max_stop_token_ids", _CAPS.max_stop_token_ids, "Stop token ids per prompt.")
_TOOLS = flags.DEFINE_integer("max_tools", _CAPS.max_tools, "Tools per chat request.")
_PROMPT_BYTES = flags.DEFINE_integer(
  "max_prompt_bytes", _CAPS.max_prompt_bytes, "UTF-8 bytes of a request's prompt text (checked before tokenizing)."
)
_SLOTS_PER_REQUEST = flags.DEFINE_integer(
  "max_slots_per_request", None, "Engine slots one request's prompts hold at once (default: all but 1/8)."
)
_BODY = flags.DEFINE_integer("max_body_bytes", _HTTP.max_body_bytes, "Request body size (413 beyond).")
_HEADER_TIMEOUT = flags.DEFINE_float(
  "header_timeout_s",
  _HTTP.header_timeout_s,
  "A request's headers must arrive within this (then the connection closes).",
)
_KEEP_ALIVE = flags.DEFINE_float(
  "keep_alive_timeout_s", _HTTP.keep_alive_timeout_s, "Idle keep-alive connections close after this."
)
_CONNECTIONS = flags.DEFINE_integer(
  "max_connections",
  None,
  "Open connections at most (the oldest waiting for headers is closed for a new one). Default and ceiling: "
  "the fd soft limit (ulimit -n) less max(128, 1/8 of it).",
)
_COMPILE_CACHE = compile_cache.define_flag()


def main(argv):
  del argv
  compile_cache.enable(_COMPILE_CACHE.value)
  host_malloc.keep_freed_memory()  # freed XLA:CPU buffers stay in the heap (k2jax/host_malloc.py)
  logging.basicConfig(level=logging.INFO)
  config = EngineConfig(
    max_slots=_SLOTS.value,
    max_seq_len=_MAX_LEN.value,
    prefix_cache_entries=_PREFIX.value,
    precompile=_PRECOMPILE.value,
  )
  server = Server(
    _MODEL.value,
    engine_config=config,
    host=_HOST.value,
    port=_PORT.value,
    tokenizer_path=_TOKENIZER.value,
    served_model_name=_NAME.value,
    limits=HttpLimits(
      api_key=_API_KEY.value,
      max_body_bytes=_BODY.value,
      header_timeout_s=_HEADER_TIMEOUT.value,
      keep_alive_timeout_s=_KEEP_ALIVE.value,
      max_connections=_CONNECTIONS.value,
    ),
    weights_root=_WEIGHTS_ROOT.value,
    caps=RequestCaps(
      max_batch_size=_BATCH.value,
      max_stop_strings=_STOPS.value,
      max_stop_bytes=_STOP_BYTES.value,
      max_stop_token_ids=_STOP_IDS.value,
      max_tools=_TOOLS.value,
      max_prompt_bytes=_PROMPT_BYTES.value,
      max_slots_per_request=_SLOTS_PER_REQUEST.value,
    ),
  )
  print(f"serving {_MODEL.value} at {server.url}", flush=True)
  try:
    server.serve_forever()
  finally:
    server.close()


if __name__ == "__main__":
  app.run(main)
