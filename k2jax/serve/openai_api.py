"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions` on top of the engine.

Chat prompts are rendered with K2's chat template (`k2jax.data.chat.render_chat`, tools declared
first) and generations are parsed back with the same module's `parse_assistant`, so tool calls in
`<|tool_calls_section_begin|>...` markup come back as OpenAI `tool_calls` with `finish_reason
"tool_calls"` (what SGLang's `kimi_k2` tool-call parser returns). SGLang's extra request fields
`top_k`, `stop_token_ids`, `ignore_eos`, `rid` work here too.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import weakref
from typing import Annotated, Any, Callable, Literal

from pydantic import Field

from k2jax import httpservice
from k2jax.data import chat
from k2jax.data.tokenizer import Tokenizer
from k2jax.engine.base import GenerateRequest, GenerateResult, InvalidRequest, SamplingParams
from k2jax.engine.inference import InferenceEngine
from k2jax.serve import limits, protocol
from k2jax.serve.limits import RequestCaps


class StreamOptions(httpservice.StrictBody):
  """OpenAI's `stream_options` (with `stream: true` only): `include_usage` adds a last chunk with the usage."""

  include_usage: bool | None = None
  continuous_usage_stats: bool | None = None  # SGLang's; accepted, usage comes in the last chunk only


class _OpenAIBody(httpservice.StrictBody):
  """Fields common to both endpoints; SGLang's extras (`top_k`, `stop_token_ids`, `ignore_eos`, `rid`)."""

  model: str | None = None
  max_tokens: int | None = Field(None, ge=0)
  temperature: float | None = Field(None, ge=0.0, le=1e4)
  top_p: float | None = Field(None, gt=0.0, le=1.0)
  n: int | None = Field(None, ge=1)
  stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
  seed: int | None = None
  stream: bool | None = None
  stream_options: StreamOptions | None = None
  user: str | None = None
  presence_penalty: Literal[0, 0.0] | None = None
  frequency_penalty: Literal[0, 0.0] | None = None
  logit_bias: None = None
  top_k: int | None = Field(None, ge=-1)
  stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
  ignore_eos: bool | None = None
  rid: str | None = None


_Ids = list[Annotated[int, Field(ge=0)]]


class GenerateResultBody(_OpenAIBody):
  prompt: str | list[str] | _Ids | list[_Ids]
  logprobs: int | None = Field(None, ge=0)
  echo: bool | None = None  # the prompt's tokens (and with logprobs their logprobs) before the output
  suffix: None = None
  best_of: Literal[1] | None = None


class ChatBody(_OpenAIBody):
  messages: list[dict]
  tools: list[dict] | None = None
  tool_choice: Literal["auto", "none"] | None = None
  parallel_tool_calls: bool | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = Field(None, ge=0)
  max_completion_tokens: int | None = Field(None, ge=0)


@dataclasses.dataclass(frozen=True)
class OpenAICall:
  """A parsed OpenAI request: the engine requests to run and how to answer with their results."""

  requests: list[GenerateRequest]
  stream: bool
  respond: Callable[[list[GenerateResult]], dict]  # the whole (non-streaming) response body
  chunk: Callable[[str, str | None], dict]  # one SSE chunk: (text delta, finish_reason or None)
  stops: tuple[str, ...]  # stop strings: streamed text holds back what could still become one
  include_usage: bool = False  # stream_options.include_usage: a last chunk with no choices and the usage


def completions(
  body: Any, engine: InferenceEngine, tok: Tokenizer | None, model_name: str, caps: RequestCaps = RequestCaps()
) -> OpenAICall:
  b = _parse(GenerateResultBody, body, caps)
  if isinstance(b.prompt, list) and b.prompt and isinstance(b.prompt[0], (str, list)):
    caps.batch(len(b.prompt) * (b.n or 1), "prompt")
  prompts = _completion_prompts(b.prompt, tok, caps)
  if b.logprobs is not None and b.logprobs > engine.config.num_top_logprobs:
    raise InvalidRequest("logprobs", f"must be in [0, {engine.config.num_top_logprobs}], got {b.logprobs}")
  sampling = _sampling(b, b.max_tokens, 16)
  call_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
  echo = bool(b.echo)
  if echo and b.stream:
    raise InvalidRequest("echo", "echo with stream is not supported; send stream: false")

  def respond(results: list[GenerateResult]) -> dict:
    choices = []
    for i, (c, req) in enumerate(zip(results, requests)):
      prompt = req.input_ids if echo else ()
      text = protocol.output_text(c, protocol.TextOptions(), tok) if tok else ""
      choices.append(
        {
          "index": i,
          "text": (tok.decode(prompt) if tok else "") + text,
          "logprobs": _completion_logprobs(c, b.logprobs, tok, prompt) if b.logprobs is not None else None,
          "finish_reason": c.finish_reason,
          "matched_stop": c.matched_stop,
        }
      )
    return _envelope(call_id, created, "text_completion", model_name, choices, results, sum(map(len, prompts)))

  def chunk(delta: str, finish: str | None) -> dict:
    choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
    return {"id": call_id, "object": "text_completion", "created": created, "model": model_name, "choices": [choice]}

  # echo with logprobs: the prompt's logprobs come from each request's prefill (logprob_start_len 0)
  start = 0 if echo and b.logprobs is not None else -1
  requests = _requests(engine, prompts, sampling, b, caps, start)
  return OpenAICall(requests, bool(b.stream), respond, chunk, sampling.stop, _include_usage(b))


def chat_completions(
  body: Any, engine: InferenceEngine, tok: Tokenizer | None, model_name: str, caps: RequestCaps = RequestCaps()
) -> OpenAICall:
  b = _parse(ChatBody, body, caps)
  if tok is None:
    raise InvalidRequest("messages", "chat needs a tokenizer; this server has none")
  caps.tools(b.tools)
  caps.chat_bytes(b.messages, b.tools)
  check_messages(b.messages, b.tools)
  try:
    ids, _ = chat.render_chat(b.messages, b.tools, tokenizer=tok, add_generation_prompt=True)
  except chat.ChatFormatError as e:
    raise InvalidRequest(e.field, str(e).split(": ", 1)[-1]) from e
  top = b.top_logprobs or 0
  if top > engine.config.num_top_logprobs:
    raise InvalidRequest("top_logprobs", f"must be in [0, {engine.config.num_top_logprobs}], got {top}")
  parse_tools = bool(b.tools) and (b.tool_choice or "auto") == "auto"
  max_new = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
  sampling = _sampling(b, max_new, engine.config.max_seq_len - len(ids))
  call_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

  def respond(results: list[GenerateResult]) -> dict:
    choices = []
    for i, c in enumerate(results):
      message, finish = _assistant_message(c, tok, parse_tools)
      choices.append(
        {
          "index": i,
          "message": message,
          "finish_reason": finish,
          "matched_stop": c.matched_stop,
          "logprobs": {"content": _chat_logprobs(c, top, tok)} if b.logprobs else None,
        }
      )
    return _envelope(call_id, created, "chat.completion", model_name, choices, results, len(ids))

  def chunk(delta: str, finish: str | None) -> dict:
    choice = {"index": 0, "delta": {"role": "assistant", "content": delta} if delta else {}, "finish_reason": finish}
    return {
      "id": call_id,
      "object": "chat.completion.chunk",
      "created": created,
      "model": model_name,
      "choices": [choice],
    }

  if b.stream and parse_tools:
    raise InvalidRequest("stream", "streaming with tools is not supported; send stream: false to get tool_calls")
  requests = _requests(engine, [ids], sampling, b, caps)
  return OpenAICall(requests, bool(b.stream), respond, chunk, sampling.stop, _include_usage(b))


def check_messages(messages: list, tools: list | None) -> None:
  """What OpenAI's and SGLang's validation refuse before rendering: a message without `content` (or with
  `content: null`), unless it is an assistant turn carrying `tool_calls`; text that is not Unicode."""
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      continue  # render_chat names it
    if m.get("content") is None and not (m.get("role") == "assistant" and m.get("tool_calls")):
      got = "is missing" if "content" not in m else "is null"
      raise InvalidRequest(f"messages[{i}].content", f"{got}: give a string or a list of text parts")
    for key, value in m.items():
      for text in limits.strings(value):
        protocol.check_unicode(text, f"messages[{i}].{key}")
  for text in limits.strings(tools or []):
    protocol.check_unicode(text, "tools")


def _assistant_message(c: GenerateResult, tok: Tokenizer, parse_tools: bool) -> tuple[dict, str]:
  ids = list(c.output_ids)
  if isinstance(c.matched_stop, int) and ids and ids[-1] == c.matched_stop:
    ids = ids[:-1]  # the stop token (<|im_end|>, [EOS]) is not part of the message
  parsed = chat.parse_assistant(ids, tokenizer=tok)
  text = protocol.output_text(c, protocol.TextOptions(), tok) if not parse_tools else parsed["content"]
  message = {"role": "assistant", "content": text}
  finish = c.finish_reason
  if parse_tools and parsed.get("tool_calls"):
    message["tool_calls"] = parsed["tool_calls"]
    message["content"] = parsed["content"] or None
    finish = "tool_calls" if finish == "stop" else finish
  return message, finish


def _parse(model, body: Any, caps: RequestCaps):
  if not isinstance(body, dict):
    raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
  stop, ids, tools = body.get("stop"), body.get("stop_token_ids"), body.get("tools")
  caps.stops(stop if isinstance(stop, list) else (), ids if isinstance(ids, list) else (), "")  # before validating
  caps.tools(tools if isinstance(tools, list) else None)
  protocol.check_stop_unicode(stop, "stop")
  b = httpservice.validate(model, body, "")
  caps.stops((b.stop,) if isinstance(b.stop, str) else b.stop or (), b.stop_token_ids or (), "")
  if b.stream_options is not None and b.stream_options.model_fields_set and not b.stream:  # as SGLang and vLLM
    raise InvalidRequest("stream_options", "is only allowed with stream: true")
  return b


def _include_usage(b: _OpenAIBody) -> bool:
  return bool(b.stream_options is not None and b.stream_options.include_usage)


def _sampling(b: _OpenAIBody, max_new: int | None, default_max: int) -> SamplingParams:
  return SamplingParams(
    max_new_tokens=default_max if max_new is None else max_new,
    temperature=1.0 if b.temperature is None else b.temperature,
    top_p=1.0 if b.top_p is None else b.top_p,
    top_k=-1 if b.top_k is None else b.top_k,
    stop=(b.stop,) if isinstance(b.stop, str) else tuple(b.stop or ()),
    stop_token_ids=tuple(b.stop_token_ids or ()),
    ignore_eos=bool(b.ignore_eos),
    seed=b.seed,
  )


def _requests(
  engine: InferenceEngine,
  prompts: list[list[int]],
  sampling: SamplingParams,
  b: _OpenAIBody,
  caps: RequestCaps,
  logprob_start_len: int = -1,
):
  """n samples per prompt (seeds seed, seed+1, ... when a seed is given), checked by the engine."""
  n = b.n or 1
  if n > engine.config.max_slots * 4:
    raise InvalidRequest("n", f"must be in [1, {engine.config.max_slots * 4}], got {n}")
  caps.batch(n * len(prompts), "n" if len(prompts) == 1 else "prompt")
  if b.stream and n * len(prompts) != 1:
    raise InvalidRequest("stream", "streaming takes one prompt and n = 1")
  base = b.rid or uuid.uuid4().hex
  requests = []
  for ids in prompts:
    for j in range(n):
      seed = None if sampling.seed is None else sampling.seed + j
      rid = base if len(prompts) * n == 1 else f"{base}-{len(requests)}"
      request = GenerateRequest(
        rid,
        tuple(ids),
        dataclasses.replace(sampling, seed=seed),
        logprob_start_len,
        input_top_logprobs_num=b.logprobs or 0,
      )
      try:
        engine.check(request)
      except InvalidRequest as e:  # engine fields are /generate's; name the OpenAI ones instead
        field = {"input_ids": "prompt", "sampling_params.max_new_tokens": "max_tokens"}.get(e.field, e.field)
        raise InvalidRequest(field.replace("sampling_params.", ""), str(e).split(": ", 1)[-1]) from e
      requests.append(request)
  return requests


def _completion_prompts(prompt: Any, tok: Tokenizer | None, caps: RequestCaps) -> list[list[int]]:
  if not prompt:
    raise InvalidRequest("prompt", "must be a string, a list of strings, or token id list(s), not empty")
  if all(isinstance(p, list) for p in prompt):
    for i, p in enumerate(prompt):
      if not p:
        raise InvalidRequest(f"prompt[{i}]", "must not be empty")
    return [list(p) for p in prompt]
  if all(isinstance(p, int) for p in prompt):
    return [list(prompt)]
  texts = [prompt] if isinstance(prompt, str) else prompt
  if tok is None:
    raise InvalidRequest("prompt", "this server has no tokenizer; send token ids")
  caps.prompt_bytes(texts, "prompt")
  for i, t in enumerate(texts):
    protocol.check_unicode(t, "prompt" if isinstance(prompt, str) else f"prompt[{i}]")
  return [tok.encode_with_specials(t) for t in texts]


def _completion_logprobs(c: GenerateResult, n: int, tok: Tokenizer | None, prompt: tuple[int, ...] = ()) -> dict:
  """OpenAI's completion logprobs; with `prompt` (echo) the prompt's tokens first, the first one's logprob
  None (it has no context, as SGLang and vLLM answer)."""
  name = _namer(tok)
  ids = list(prompt) + list(c.output_ids)
  tokens = [name(t) for t in ids]
  prompt_lps = list(c.input_logprobs) if prompt else []
  prompt_tops = [{name(t): lp for t, lp in top[:n]} if top else None for top in c.input_top_logprobs] if prompt else []
  offsets, pos = [], 0
  for t in tokens:
    offsets.append(pos)
    pos += len(t)
  return {
    "tokens": tokens,
    "token_logprobs": prompt_lps + list(c.output_logprobs),
    "text_offset": offsets,
    "top_logprobs": prompt_tops + [{name(t): lp for t, lp in top[:n]} for top in c.top_logprobs],
  }


def _chat_logprobs(c: GenerateResult, n: int, tok: Tokenizer) -> list[dict]:
  def entry(t: int, lp: float) -> dict:
    text = tok.token_name(t)
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": lp}

  return [
    {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top[:n]]}
    for t, lp, top in zip(c.output_ids, c.output_logprobs, c.top_logprobs)
  ]


class _Names(dict):
  """A tokenizer's token names as they are asked for (`Tokenizer.token_name`, a tiktoken decode per call:
  most of the time of an echoed batch's response before; a name is looked up again for every occurrence and
  every top logprob). At most the vocab's names, kept as long as the tokenizer (`_NAMES`)."""

  def __init__(self, tok: Tokenizer):
    super().__init__()
    self.tok = tok

  def __missing__(self, t: int) -> str:
    name = self[t] = self.tok.token_name(t)
    return name


_NAMES: "weakref.WeakKeyDictionary[Tokenizer, _Names]" = weakref.WeakKeyDictionary()


def _namer(tok: Tokenizer | None) -> Callable[[int], str]:
  if tok is None:
    return lambda t: f"<|token_{t}|>"
  names = _NAMES.get(tok)
  if names is None:
    names = _NAMES.setdefault(tok, _Names(tok))
  return names.__getitem__


def _envelope(
  call_id: str, created: int, obj: str, model: str, choices: list, results: list[GenerateResult], prompt_tokens: int
) -> dict:
  completion_tokens = sum(len(c.output_ids) for c in results)
  return {
    "id": call_id,
    "object": obj,
    "created": created,
    "model": model,
    "choices": choices,
    "usage": {
      "prompt_tokens": prompt_tokens,
      "completion_tokens": completion_tokens,
      "total_tokens": prompt_tokens + completion_tokens,
    },
  }
