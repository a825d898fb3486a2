"""The HTTP server: SGLang's API (`/generate`, weight updates, abort, cache, health, info) plus OpenAI's.

FastAPI on uvicorn (`k2jax.httpservice`), as SGLang serves. Handlers are coroutines that never block the
event loop: they submit to the engine, whose scheduler thread wakes them after every token, so a
connection costs no thread and thousands can wait at once. When a client disconnects, its requests are
aborted at once and their cache slots freed. `stream: true` on `/generate` and on the OpenAI endpoints
answers with server-sent events. Errors answer 4xx with `{"error": {"message", "param", ...}}` naming
the field. With an `api_key`, every route but `/health` and `/health_generate` needs `Authorization:
Bearer <key>`, as SGLang's `--api-key` guards every route but its health and metrics probes: generation,
tokenizing and the info routes (which name the model's paths) included.

Routes are bounded (the server cannot be starved by one client, keyed or not): per-request caps
(`limits.RequestCaps`), turns between clients and between one client's requests (`fair.FairQueue`; a
client is its key, else its peer address: `client_id`), and header/idle timeouts with a connection
limit below the fd limit (`httpservice.HttpLimits`).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import stat
import uuid
from typing import Annotated, AsyncIterator, Callable, Literal, TypeVar

import fastapi
from fastapi import responses
from pydantic import Field
from safetensors import SafetensorError

from k2jax import httpservice
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, Tokenizer, load_tokenizer
from k2jax.engine.base import GenerateRequest, GenerateResult, InvalidRequest, SamplingParams
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.engine.placement import load_model, make_placement
from k2jax.httpservice import HttpLimits
from k2jax.model.config import K2Config
from k2jax.serve import openai_api, protocol, weight_files
from k2jax.serve.fair import Call, FairQueue, LoopShare
from k2jax.serve.limits import RequestCaps

log = logging.getLogger(__name__)
T = TypeVar("T")


OPEN_ROUTES = ("/health", "/health_generate")  # answer without the API key (as SGLang's /health*)


def client_id(request: fastapi.Request) -> str:
  """Who sent `request`, for fair turns: the API key it authenticated with (`require_api_key`), else its
  peer address (host only: a client's many connections are one client)."""
  index = getattr(request.state, "api_key_index", None)
  if index is not None:
    return f"key:{index}"
  return f"peer:{request.client.host if request.client else 'unknown'}"


class AbortBody(httpservice.StrictBody):
  rid: str | None = None
  abort_all: bool = False


class UpdateWeightsBody(httpservice.StrictBody):
  model_path: str = Field(min_length=1)
  weight_version: int | Annotated[str, Field(pattern=r"^-?[0-9]+$")] | None = None  # SGLang sends a string
  load_format: Literal["auto"] | None = None
  abort_all_requests: bool = False
  flush_cache: bool = True


class TokenizeBody(httpservice.StrictBody):
  prompt: str
  add_special_tokens: bool = True


class DetokenizeBody(httpservice.StrictBody):
  tokens: list[int]


class Server:
  """Loads a model (HF dir or k2jax workdir), runs an `InferenceEngine` and answers HTTP on host:port.

  `/update_weights_from_disk` loads only paths inside the served model's own directory or inside
  `weights_root` (a directory the trainer writes its weight syncs to; default none), so the route is
  neither a file reader nor an existence oracle for the rest of the machine. A directory every user may
  write (/tmp itself) is never a root: anyone could plant weights there.
  """

  def __init__(
    self,
    model_path: str,
    *,
    engine_config: EngineConfig = EngineConfig(),
    host: str = "127.0.0.1",
    port: int = 30000,
    tokenizer_path: str | None = "auto",
    served_model_name: str | None = None,
    limits: HttpLimits = HttpLimits(),
    weights_root: str | None = None,
    make_engine: Callable | None = None,
    caps: RequestCaps = RequestCaps(),
  ):
    """`make_engine(model, eos_token_ids)`: another engine with `InferenceEngine`'s serving surface (submit,
    progress, wait, abort, update_weights, ...), e.g. `k2jax.engine.sglang_jax_server.SglangJaxServing`;
    default: k2jax's own `InferenceEngine` with `engine_config`."""
    self.model_path = model_path
    # Weights read onto the serving layout (EngineConfig.sharding/.mesh; one device by default).
    model = load_model(model_path, make_placement(engine_config.sharding, engine_config.mesh))
    self.cfg: K2Config = model.cfg
    self.tokenizer = resolve_tokenizer(model_path, tokenizer_path, self.cfg.vocab_size)
    self.model_name = served_model_name or os.path.basename(os.path.normpath(model_path))
    self.weights_roots = weight_roots(model_path, weights_root)
    self.caps = caps
    eos = eos_ids(self.cfg, self.tokenizer)
    if make_engine is not None:
      self.engine = make_engine(model, eos)
    else:
      detokenize = self.tokenizer.decode if self.tokenizer else None
      self.engine = InferenceEngine(model, engine_config, eos_token_ids=eos, detokenize=detokenize)
    del model  # the engine holds what it serves
    slots = self.engine.config.max_slots
    # Scored-only prompts (lm-eval's loglikelihood) may fill every slot and a second batch behind it: each
    # leaves after one prefill, so a newcomer waits about two prefills at most (`FairQueue.scored_batch`).
    window = slots + max(1, slots // 8)
    self.fair = FairQueue(
      self.engine,
      window,
      caps.slots_per_request(slots),
      scored_batch=slots,
      per_client=caps.slots_per_client(slots),
      max_calls_per_client=caps.max_requests_per_client,
    )
    self.loop_share = LoopShare()
    self.app = self._routes(httpservice.make_app("k2jax", limits, field_errors=(InvalidRequest,)))
    self._http = httpservice.Service(self.app, host=host, port=port, limits=limits, name="k2jax-http")

  @property
  def url(self) -> str:
    return self._http.url

  def start(self) -> "Server":
    """Serves on a background thread (tests, the embedded RL engine)."""
    self._http.start()
    return self

  def serve_forever(self) -> None:
    self._http.serve_forever()

  @property
  def connections(self) -> httpservice.ConnectionGuard:
    """The open connections' guard: its limit, header timeout and eviction counters."""
    return self._http.guard

  def close(self) -> None:
    self._http.close()
    self.engine.close()

  # ---- routes ----------------------------------------------------------------------------------------
  def _routes(self, app: fastapi.FastAPI) -> fastapi.FastAPI:
    """Every route needs the API key (when the server has one) but the liveness probes (`OPEN_ROUTES`)."""
    auth = [fastapi.Depends(httpservice.require_api_key)]
    post = lambda path: app.post(path, dependencies=auth)  # noqa: E731
    get = lambda path: app.get(path, dependencies=auth)  # noqa: E731
    post("/generate")(self.generate)
    post("/v1/completions")(self.completions)
    post("/v1/chat/completions")(self.chat_completions)
    post("/abort_request")(self.abort_request)
    post("/update_weights_from_disk")(self.update_weights_from_disk)
    app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=auth)(self.flush_cache)
    for path in OPEN_ROUTES:
      app.get(path)(self.health)
    for path in ("/get_model_info", "/model_info"):
      get(path)(self.model_info)
    for path in ("/get_server_info", "/server_info"):
      get(path)(self.server_info)
    get("/v1/models")(self.list_models)
    post("/tokenize")(self.tokenize)
    post("/detokenize")(self.detokenize)
    get("/tokenizer_info")(self.tokenizer_info)
    return app

  async def generate(self, request: fastapi.Request):
    def parse(body):
      call = protocol.parse_generate(body, self.tokenizer, self.engine.config.num_top_logprobs, self.caps)
      for req in call.requests:
        self.engine.check(req)
      return call

    call = await self._parse(request, parse)
    if call.stream:
      (opts,) = call.options
      version = self.engine.weight_version
      render = lambda c: protocol.generate_response(c, opts, self.tokenizer, version)  # noqa: E731
      queued = self.fair.submit(call.requests, client_id(request))
      return _sse(self._stream(queued, lambda c, done: [render(c)]))
    results = await self._run(request, call.requests)
    version = self.engine.weight_version
    outs = [protocol.generate_response(c, o, self.tokenizer, version) for c, o in zip(results, call.options)]
    return _json(outs if call.batch else outs[0])

  async def completions(self, request: fastapi.Request):
    parse = lambda b: openai_api.completions(b, self.engine, self.tokenizer, self.model_name, self.caps)  # noqa: E731
    return await self._openai(request, await self._parse(request, parse))

  async def chat_completions(self, request: fastapi.Request):
    parse = lambda b: openai_api.chat_completions(b, self.engine, self.tokenizer, self.model_name, self.caps)  # noqa: E731
    return await self._openai(request, await self._parse(request, parse))

  async def abort_request(self, request: fastapi.Request):
    body = httpservice.validate(AbortBody, await httpservice.read_json(request) or {})
    if not body.abort_all and not body.rid:
      raise InvalidRequest("rid", "give a request id (string) or abort_all: true")
    if body.abort_all:
      self.fair.abort_all()
    else:
      self.fair.abort([body.rid])
      self.engine.abort([body.rid])  # also one submitted to the engine directly
    return responses.Response(status_code=200)

  async def update_weights_from_disk(self, request: fastapi.Request):
    body = httpservice.validate(UpdateWeightsBody, await httpservice.read_json(request))
    try:
      weight_files.check_model_path(body.model_path)
    except weight_files.WeightFileError as e:
      return _update_failed(e.status, str(e))
    path = os.path.realpath(body.model_path)
    if not weight_files.inside(path, self.weights_roots):
      roots = " or ".join(self.weights_roots)
      msg = f"model_path must be inside the served model's dir or the weights root: {roots} (flag --weights_root)"
      return _update_failed(403, msg)
    try:
      await asyncio.to_thread(weight_files.check_weights_dir, path, self.weights_roots)
    except weight_files.WeightFileError as e:  # nothing was loaded: the old weights keep serving
      return _update_failed(e.status, f"{body.model_path}: {e}")
    if body.abort_all_requests:
      self.fair.abort_all()
    version = None if body.weight_version is None else int(body.weight_version)
    try:
      new = await asyncio.to_thread(self.engine.update_weights, path, version, flush_cache=body.flush_cache)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # missing files, bad config, shape mismatch
      return _update_failed(400, f"{body.model_path}: {e}")
    self.model_path = body.model_path
    return {
      "success": True,
      "message": f"loaded {body.model_path} as weight version {new}",
      "num_paused_requests": 0,
      "weight_version": str(new),
    }

  async def flush_cache(self):
    await asyncio.to_thread(self.engine.flush_cache)
    return responses.PlainTextResponse("Cache flushed.")

  async def health(self, request: fastapi.Request):
    """Like SGLang: a one-token generation when idle (proves the model runs), else just alive."""
    if self.fair.num_running() or self.engine.num_running():
      return responses.Response(status_code=200)
    probe = GenerateRequest(f"health-{uuid.uuid4().hex}", (0,), SamplingParams(max_new_tokens=1, temperature=0.0))
    try:
      await self._run(request, [probe])
    except RuntimeError as e:  # the engine failed or is closed
      return httpservice.error_response(503, str(e))
    return responses.Response(status_code=200)

  def _need_tokenizer(self, field: str) -> Tokenizer:
    if self.tokenizer is None:
      raise InvalidRequest(field, "this server has no tokenizer")
    return self.tokenizer

  async def tokenize(self, request: fastapi.Request):
    """Token ids of `prompt` (lm-eval's `remote` tokenizer): exactly what a text prompt to /generate or
    /v1/completions becomes, special-token text mapped to its id, as the export's HF tokenizer, SGLang and
    vLLM answer. `add_special_tokens` only adds BOS/EOS templates there, and K2 adds none, so both values
    give the same ids: lm-eval's remote backend reads `eos_token_id` as `tokenize(eos_token,
    add_special_tokens=False)[0]`, which must be the [EOS] id, not the first piece of the text "[EOS]"."""
    body = httpservice.validate(TokenizeBody, await httpservice.read_json(request))
    tok = self._need_tokenizer("prompt")
    protocol.check_unicode(body.prompt, "prompt")
    if len(body.prompt.encode()) > self.caps.max_prompt_bytes:
      raise InvalidRequest("prompt", f"longer than {self.caps.max_prompt_bytes} bytes")
    ids = await asyncio.to_thread(tok.encode_with_specials, body.prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.config.max_seq_len}

  async def detokenize(self, request: fastapi.Request):
    body = httpservice.validate(DetokenizeBody, await httpservice.read_json(request))
    tok = self._need_tokenizer("tokens")
    bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
    if bad:
      raise InvalidRequest("tokens", f"token ids {bad[:5]} outside [0, {tok.vocab_size})")
    text = await asyncio.to_thread(tok.decode, body.tokens)
    return {"text": text, "prompt": text}  # SGLang names it text, vLLM prompt

  async def tokenizer_info(self):
    """The tokenizer's special tokens and sizes (lm-eval's `remote` tokenizer reads eos_token first)."""
    tok = self._need_tokenizer("tokenizer")
    return {
      "tokenizer_path": tok.path,
      "vocab_size": tok.vocab_size,
      "model_vocab_size": self.cfg.vocab_size,
      "eos_token": tok.token_name(tok.eos_id),
      "eos_token_id": tok.eos_id,
      "bos_token": tok.token_name(tok.bos_id),
      "bos_token_id": tok.bos_id,
      "pad_token": tok.token_name(tok.eos_id),  # K2 pads with EOS
      "pad_token_id": tok.eos_id,
      "add_bos_token": False,
      "max_model_len": self.engine.config.max_seq_len,
    }

  async def model_info(self):
    return {
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

  async def server_info(self):
    """Identity and capabilities for the RL client's handshake (SGLang's route; `engine` names k2jax)."""
    backend = getattr(self.engine, "backend", "k2jax")  # the engine behind these routes
    seeded = self.engine.capabilities().seeded_sampling if backend != "k2jax" else True
    return {
      "engine": "k2jax",
      "version": _version() + ("" if backend == "k2jax" else f" ({backend} backend)"),
      "backend": backend,
      "capabilities": {
        "weight_update": ["disk"],
        "weight_version": True,
        "seeded_sampling": seeded,  # k2jax: keyed by (seed, position), so resumed requests continue exactly
        "abort": True,
      },
      "model_path": self.model_path,
      "max_running_requests": self.engine.config.max_slots,
      "max_seq_len": self.engine.config.max_seq_len,
    }

  async def list_models(self):
    return {
      "object": "list",
      "data": [{"id": self.model_name, "object": "model", "owned_by": "k2jax", "root": self.model_path}],
    }

  async def _parse(self, request: fastapi.Request, parse: Callable[[object], T]) -> T:
    """Reads the body and runs `parse` on its JSON; a heavy body takes its turn on the event loop."""
    raw = await httpservice.read_body(request)
    return await self.loop_share.run(len(raw), lambda: parse(httpservice.parse_json(raw)))

  # ---- running requests --------------------------------------------------------------------------------
  def num_running(self) -> int:
    """Prompts of HTTP requests in flight: queued for their turn or in the engine."""
    return self.fair.num_running()

  async def _run(self, request: fastapi.Request, reqs: list[GenerateRequest]) -> list[GenerateResult]:
    """Runs `reqs` to completion, taking turns with other requests; aborts them all if the client goes
    away first. Raises RuntimeError when the engine failed on one of them (answered 500)."""
    call = self.fair.submit(reqs, client_id(request))
    watcher = asyncio.create_task(self._abort_on_disconnect(request, call))
    try:
      while not call.done:
        await call.changed.wait()
        call.changed.clear()
    finally:
      watcher.cancel()
      if not call.done:  # cancelled (server shutting down): nothing may keep decoding for nobody
        self.fair.cancel(call)
    return [_result(self.fair, call, i) for i in range(len(reqs))]

  async def _stream(self, call: Call, render: Callable[[GenerateResult, bool], list[dict]]) -> AsyncIterator[dict]:
    """Yields render(progress, finished) after every new token; aborts the request if the stream is dropped."""
    sent = -1
    try:
      while True:
        done = call.done
        if call.lives[0] is not None or done:
          progress = _result(self.fair, call, 0) if done else self.engine.progress(call.lives[0])
          if done or len(progress.output_ids) > sent:
            sent = len(progress.output_ids)
            for chunk in render(progress, done):
              yield chunk
        if done:
          return
        await call.changed.wait()
        call.changed.clear()
    finally:  # client disconnected (the response is cancelled) or finished
      if not call.done:
        self.fair.cancel(call)

  async def _openai(self, request: fastapi.Request, call: openai_api.OpenAICall):
    if not call.stream:
      return _json(call.respond(await self._run(request, call.requests)))
    text = _TextDeltas(self.tokenizer, call.stops)

    def render(c: GenerateResult, done: bool) -> list[dict]:
      if not done:
        delta = text.advance(c)
        return [call.chunk(delta, None)] if delta else []
      body = call.respond([c])
      final = body["choices"][0]
      delta = text.finish(final.get("text", (final.get("message") or {}).get("content") or ""))
      usage = [{**call.chunk("", None), "choices": [], "usage": body["usage"]}] if call.include_usage else []
      return ([call.chunk(delta, None)] if delta else []) + [call.chunk("", final["finish_reason"])] + usage

    return _sse(self._stream(self.fair.submit(call.requests, client_id(request)), render))

  async def _abort_on_disconnect(self, request: fastapi.Request, call: Call) -> None:
    # The body has been read, so the next ASGI message can only be the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
      pass
    self.fair.cancel(call)


def _json(body) -> responses.JSONResponse:
  """A response body of plain JSON types (dicts, lists, tuples, str, int, float, None) answered as it is:
  FastAPI would first walk it through `jsonable_encoder` (pure Python, per value), which cost more than
  the scoring itself for a batch of echoed prompt logprobs."""
  return responses.JSONResponse(body)


def _result(fair: FairQueue, call: Call, i: int) -> GenerateResult:
  try:
    return fair.result(call, i)
  except InvalidRequest as e:  # the engine refused it at its turn: a rid in flight outside HTTP
    if e.field == "rid":
      raise httpservice.HttpError(409, str(e), "rid") from None
    raise


def _update_failed(status: int, message: str) -> responses.JSONResponse:
  return responses.JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, status)


def weight_roots(model_path: str, weights_root: str | None) -> list[str]:
  """Where `/update_weights_from_disk` may read: the served model's dir and `weights_root`, never a
  directory every user may write (a model saved straight into /tmp gets no default root)."""
  roots = []
  for path, given in ((model_path, False), (weights_root, True)):
    if path is None:
      continue
    real = os.path.realpath(path)
    if os.path.isdir(real) and os.stat(real).st_mode & stat.S_IWOTH:
      if given:
        raise ValueError(f"weights_root {path} is writable by every user; give a directory only the trainer writes")
      log.warning("%s is writable by every user: weight updates may not read from it", path)
      continue
    roots.append(real)
  return roots


class _TextDeltas:
  """Streamed text: the part of the decoded output that can no longer change (no half UTF-8 character,
  nothing that could still turn into a stop string, which the final text trims)."""

  def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...]):
    self.tokenizer, self.hold = tokenizer, max((len(s) for s in stops), default=1) - 1
    self.sent = ""

  def advance(self, c: GenerateResult) -> str:
    if self.tokenizer is None:
      return ""
    text = protocol.output_text(c, protocol.TextOptions(), self.tokenizer).rstrip("\ufffd")
    stable = text[: len(text) - self.hold] if self.hold else text
    if not stable.startswith(self.sent) or len(stable) == len(self.sent):
      return ""
    delta, self.sent = stable[len(self.sent) :], stable
    return delta

  def finish(self, final: str) -> str:
    return final[len(self.sent) :] if final.startswith(self.sent) else ""


def _version() -> str:
  """k2jax's installed version; a checkout run from PYTHONPATH (not pip-installed) has no metadata."""
  try:
    return importlib.metadata.version("k2jax")
  except importlib.metadata.PackageNotFoundError:
    return "checkout"


def _sse(chunks: AsyncIterator[dict]) -> responses.StreamingResponse:
  """Server-sent events as SGLang and OpenAI send them: `data: <json>` per chunk, then `data: [DONE]`."""

  async def events():
    async for chunk in chunks:
      yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"

  return responses.StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


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
