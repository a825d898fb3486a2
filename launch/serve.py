"""Serve a k2jax workdir or HF directory with SGLang's HTTP API plus OpenAI's /v1 endpoints.

  python launch/serve.py --model=PATH --port=30000 [--max_running_requests=8 --max_seq_len=2048]
  python launch/serve.py --model=PATH --backend=sglang_jax [--sglang_jax=device=tpu --sglang_jax=tp_size=8 ...]

--backend=k2jax (default): k2jax's own engine (`k2jax.engine.InferenceEngine`) on one device, or with
  --sharding on a serving mesh over all devices of all processes. Several JAX processes
  (--coordinator_address/--num_processes/--process_id as launch/convert.py, or the cluster's own
  environment): every process runs this command; process 0 serves HTTP and schedules, the others
  follow its engine in lockstep (`k2jax.serve.follower`). Stop process 0 (SIGTERM/SIGINT): its engine
  closes and the other processes exit with it.
--backend=sglang_jax: sglang-jax's engine (Python >= 3.12 with sgl_jax installed, docs/rl.md "sglang-jax")
  behind the same routes, with weight updates swapped on device and `meta_info.weight_version`
  (`k2jax.engine.sglang_jax_server`): a remote RL rollout engine for `--config.rollout.engine_url`.
  `--sglang_jax=KEY=VALUE` (repeatable) sets a field of `k2jax.engine.SglangJaxConfig` (sglang-jax's
  ServerArgs names; tuples comma-separated); --max_running_requests and --max_seq_len size its batch and
  context length.

Routes: /generate, /update_weights_from_disk, /flush_cache, /abort_request, /health, /get_model_info,
/v1/completions, /v1/chat/completions (both with `stream: true`), /v1/models, /tokenize, /detokenize,
/tokenizer_info, /get_server_info. With --api_key, every route but /health needs `Authorization: Bearer
<key>` (SGLang's --api-key); --api_key repeated gives each client its own key, and clients (a key, else
a peer address) take turns in the engine (docs/serving.md).
"""

import dataclasses
import logging
import os
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from k2jax import compile_cache, distributed, host_malloc  # noqa: E402

from k2jax.engine import EngineConfig, SglangJaxConfig  # noqa: E402
from k2jax.httpservice import HttpLimits  # noqa: E402
from k2jax.serve import Server, follower  # noqa: E402
from k2jax.serve.limits import RequestCaps  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "k2jax workdir or HF directory (config.json + safetensors).", required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 30000, "Port to bind.")
_SLOTS = flags.DEFINE_integer("max_running_requests", 8, "Requests decoded together (cache slots).")
_MAX_LEN = flags.DEFINE_integer("max_seq_len", 2048, "Prompt + generated tokens per request.")
_PREFIX = flags.DEFINE_integer("prefix_cache_entries", 16, "Finished sequences kept for prefix reuse.")
_PREFILL_TOKENS = flags.DEFINE_integer(
  "max_prefill_tokens",
  0,
  "Padded tokens (requests x length) per batched prefill (SGLang's --max-prefill-tokens); "
  "0 = max(max_seq_len, max_running_requests * 16).",
)
_SHARDING = flags.DEFINE_enum(
  "sharding", "", ["", "tp", "ep", "tp_ep"], "Serving preset over all devices (of every process)."
)
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
_API_KEY = flags.DEFINE_multi_string(
  "api_key",
  None,
  "Bearer token every route but /health requires (SGLang's --api-key). Repeat it to give each client its own key: "
  "clients take turns by key. An empty key is refused.",
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
_SLOTS_PER_CLIENT = flags.DEFINE_integer(
  "max_slots_per_client",
  None,
  "Engine slots one client's prompts (all its requests) hold at once (default: as --max_slots_per_request).",
)
_REQUESTS_PER_CLIENT = flags.DEFINE_integer(
  "max_requests_per_client", _CAPS.max_requests_per_client, "HTTP requests one client has in flight (429 beyond)."
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
_BACKEND = flags.DEFINE_enum(
  "backend", "k2jax", ["k2jax", "sglang_jax"], "Engine behind the routes: k2jax's own, or sglang-jax's (TPU fleets)."
)
_SGLANG_JAX = flags.DEFINE_multi_string(
  "sglang_jax", [], "--backend=sglang_jax: KEY=VALUE of k2jax.engine.SglangJaxConfig (repeatable), e.g. device=tpu."
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "host:port of process 0 (else K2JAX_COORDINATOR or the cluster)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Total JAX processes (multi-host).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (multi-host).")
_COMPILE_CACHE = compile_cache.define_flag()


def sglang_jax_config(items: list[str], max_running_requests: int, max_seq_len: int) -> SglangJaxConfig:
  """SglangJaxConfig from `--sglang_jax=KEY=VALUE` items (typed by the field's default; tuples comma-separated)."""
  base = SglangJaxConfig(max_running_requests=max_running_requests, context_length=max_seq_len)
  fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(SglangJaxConfig)}
  updates = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or key not in fields:
      raise app.UsageError(f"--sglang_jax={item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
    default = fields[key]
    try:
      if isinstance(default, bool):
        if value.lower() not in ("true", "false"):
          raise ValueError("expected true or false")
        updates[key] = value.lower() == "true"
      elif isinstance(default, tuple):
        updates[key] = tuple(int(v) for v in value.split(","))
      else:
        updates[key] = type(default)(value)
    except ValueError as e:
      raise app.UsageError(f"--sglang_jax={item!r}: {e}") from e
  return dataclasses.replace(base, **updates)


def engine_factory():
  """`Server(make_engine=...)` for --backend (None: the k2jax engine)."""
  if _BACKEND.value == "k2jax":
    if _SGLANG_JAX.value:
      raise app.UsageError("--sglang_jax needs --backend=sglang_jax")
    return None
  from k2jax.engine.sglang_jax_server import SglangJaxServing  # noqa: PLC0415 (sgl_jax: Python >= 3.12)

  config = sglang_jax_config(_SGLANG_JAX.value, _SLOTS.value, _MAX_LEN.value)
  model_dir = tempfile.mkdtemp(prefix="k2jax_sglang_jax_")  # config.json + tokenizer it starts from
  return lambda model, eos: SglangJaxServing(model, config, model_dir=model_dir, eos_token_ids=eos)


def api_keys(values: list[str] | None) -> tuple[str, ...] | None:
  """--api_key's values; an empty one is refused (it would silently turn authentication off)."""
  if not values:
    return None
  if any(not v for v in values):
    raise app.UsageError("--api_key is empty: give the key (or leave the flag out to serve without one)")
  return tuple(values)


def main(argv):
  del argv
  keys = api_keys(_API_KEY.value)  # before anything loads: a bad flag fails at once
  multi = distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  compile_cache.enable(_COMPILE_CACHE.value)
  host_malloc.keep_freed_memory()  # freed XLA:CPU buffers stay in the heap (k2jax/host_malloc.py)
  logging.basicConfig(level=logging.INFO)
  config = EngineConfig(
    max_slots=_SLOTS.value,
    max_seq_len=_MAX_LEN.value,
    prefix_cache_entries=_PREFIX.value,
    max_prefill_tokens=_PREFILL_TOKENS.value,
    precompile=_PRECOMPILE.value,
    sharding=_SHARDING.value,
    mesh=_MESH.value,
  )
  if multi:
    if _BACKEND.value != "k2jax":
      raise app.UsageError("--backend=sglang_jax runs in one process (its mesh is that process's devices)")
    try:
      follower.check_processes(config)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    if jax.process_index() > 0:
      print(f"process {jax.process_index()} follows process 0's engine", flush=True)
      follower.follow(_MODEL.value, config)
      distributed.shutdown("serve")
      return
  server = Server(
    _MODEL.value,
    engine_config=config,
    host=_HOST.value,
    port=_PORT.value,
    tokenizer_path=_TOKENIZER.value,
    served_model_name=_NAME.value,
    limits=HttpLimits(
      api_key=keys,
      max_body_bytes=_BODY.value,
      header_timeout_s=_HEADER_TIMEOUT.value,
      keep_alive_timeout_s=_KEEP_ALIVE.value,
      max_connections=_CONNECTIONS.value,
    ),
    weights_root=_WEIGHTS_ROOT.value,
    make_engine=engine_factory(),
    caps=RequestCaps(
      max_batch_size=_BATCH.value,
      max_stop_strings=_STOPS.value,
      max_stop_bytes=_STOP_BYTES.value,
      max_stop_token_ids=_STOP_IDS.value,
      max_tools=_TOOLS.value,
      max_prompt_bytes=_PROMPT_BYTES.value,
      max_slots_per_request=_SLOTS_PER_REQUEST.value,
      max_slots_per_client=_SLOTS_PER_CLIENT.value,
      max_requests_per_client=_REQUESTS_PER_CLIENT.value,
    ),
  )
  auth = f"{len(keys)} API key(s) required on every route but /health" if keys else "no API key: every route is open"
  print(f"serving {_MODEL.value} at {server.url} (backend {_BACKEND.value}; {auth})", flush=True)
  # uvicorn shuts down gracefully on SIGTERM and then raises the signal again: by default that would kill
  # the process before `server.close()`, leaving the engine unclosed (and other processes waiting for its
  # CLOSE). This handler turns that second SIGTERM into a normal return (a further one kills as usual).
  signal.signal(signal.SIGTERM, lambda *_: signal.signal(signal.SIGTERM, signal.SIG_DFL))
  try:
    server.serve_forever()
  finally:
    server.close()
  if multi:
    distributed.shutdown("serve")  # after CLOSE reached the followers: the processes leave together


if __name__ == "__main__":
  app.run(main)
