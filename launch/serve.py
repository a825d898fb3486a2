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

_MODEL = flags.DEFINE_string("model", None, "k2jax workdir or HF directory (config.json + safetensors).", required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 30000, "Port to bind.")
_SLOTS = flags.DEFINE_integer("max_running_requests", 8, "Requests decoded together (cache slots).")
_MAX_LEN = flags.DEFINE_integer("max_seq_len", 2048, "Prompt + generated tokens per request.")
_PREFIX = flags.DEFINE_integer("prefix_cache_entries", 16, "Finished sequences kept for prefix reuse.")
_SHARDING = flags.DEFINE_enum("sharding", "", ["", "tp", "ep", "tp_ep"], "Serving preset over all local devices.")
_MESH = flags.DEFINE_string("mesh", "", "Serving mesh, e.g. expert:4,tensor:2 ('' = the preset's default).")
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
  "weights_root", None, "/update_weights_from_disk loads only paths inside this dir (default: the model's parent)."
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
    sharding=_SHARDING.value,
    mesh=_MESH.value,
  )
  server = Server(
    _MODEL.value,
    engine_config=config,
    host=_HOST.value,
    port=_PORT.value,
    tokenizer_path=_TOKENIZER.value,
    served_model_name=_NAME.value,
    limits=HttpLimits(api_key=_API_KEY.value),
    weights_root=_WEIGHTS_ROOT.value,
  )
  print(f"serving {_MODEL.value} at {server.url}", flush=True)
  try:
    server.serve_forever()
  finally:
    server.close()


if __name__ == "__main__":
  app.run(main)
