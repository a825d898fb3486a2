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
from typing import Any, Callable

from k2jax.data import chat
from k2jax.data.tokenizer import Tokenizer
from k2jax.serve import protocol
from k2jax.engine.base import GenerateRequest, GenerateResult, InvalidRequest, SamplingParams
from k2jax.engine.inference import InferenceEngine

_COMMON = {
  "model",
  "max_tokens",
  "temperature",
  "top_p",
  "n",
  "stop",
  "seed",
  "stream",
  "user",
  "presence_penalty",
  "frequency_penalty",
  "logit_bias",
  "top_k",
  "stop_token_ids",
  "ignore_eos",
  "rid",
  "stream_options",
}
_NEUTRAL = {
  "presence_penalty": 0,
  "frequency_penalty": 0,
  "logit_bias": None,
  "stream": False,
  "echo": False,
  "suffix": None,
  "best_of": 1,
  "stream_options": None,
}


def completions(body: Any, engine: InferenceEngine, tok: Tokenizer | None, model_name: str) -> dict:
  _check_keys(body, _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"})
  prompts = _completion_prompts(body.get("prompt"), tok)
  nlp = protocol.get_int(body, "logprobs", None, lo=0, hi=engine.config.num_top_logprobs)
  opts = protocol.TextOptions()
  results = _run(engine, prompts, _sampling(body, 16, "max_tokens"), body)
  choices = []
  for i, c in enumerate(results):
    choice = {
      "index": i,
      "text": protocol.output_text(c, opts, tok) if tok else "",
      "logprobs": _completion_logprobs(c, nlp, tok) if nlp is not None else None,
      "finish_reason": c.finish_reason,
      "matched_stop": c.matched_stop,
    }
    choices.append(choice)
  return _envelope("cmpl", "text_completion", model_name, choices, results, sum(map(len, prompts)))


def chat_completions(body: Any, engine: InferenceEngine, tok: Tokenizer | None, model_name: str) -> dict:
  _check_keys(
    body,
    _COMMON
    | {"messages", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs", "max_completion_tokens"},
  )
  if tok is None:
    raise InvalidRequest("messages", "chat needs a tokenizer; this server has none")
  tools = body.get("tools")
  choice_mode = body.get("tool_choice") or "auto"
  if choice_mode not in ("auto", "none"):
    raise InvalidRequest("tool_choice", f"only 'auto' and 'none' are supported, got {choice_mode!r}")
  try:
    ids, _ = chat.render_chat(body.get("messages"), tools, tokenizer=tok, add_generation_prompt=True)
  except chat.ChatFormatError as e:
    raise InvalidRequest(e.field, str(e).split(": ", 1)[-1]) from e
  want_lp = protocol.get_bool(body, "logprobs", False)
  top = protocol.get_int(body, "top_logprobs", 0, lo=0, hi=engine.config.num_top_logprobs)
  key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  results = _run(engine, [ids], _sampling(body, engine.config.max_seq_len - len(ids), key), body)
  choices = []
  for i, c in enumerate(results):
    message, finish = _assistant_message(c, tok, parse_tools=bool(tools) and choice_mode == "auto")
    choices.append(
      {
        "index": i,
        "message": message,
        "finish_reason": finish,
        "matched_stop": c.matched_stop,
        "logprobs": {"content": _chat_logprobs(c, top, tok)} if want_lp else None,
      }
    )
  return _envelope("chatcmpl", "chat.completion", model_name, choices, results, len(ids))


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


def _sampling(body: dict, default_max: int, max_key: str) -> SamplingParams:
  return SamplingParams(
    max_new_tokens=protocol.get_int(body, max_key, default_max, lo=0),
    temperature=protocol.get_float(body, "temperature", 1.0, lo=0.0, field="temperature"),
    top_p=protocol.get_float(body, "top_p", 1.0, lo=0.0, lo_open=True, hi=1.0, field="top_p"),
    top_k=protocol.get_int(body, "top_k", -1),
    stop=tuple(protocol.str_list(body.get("stop"), "stop")),
    stop_token_ids=tuple(protocol.int_list(body.get("stop_token_ids"), "stop_token_ids")),
    ignore_eos=protocol.get_bool(body, "ignore_eos", False),
    seed=protocol.get_int(body, "seed", None),
  )


def _run(
  engine: InferenceEngine, prompts: list[list[int]], sampling: SamplingParams, body: dict
) -> list[GenerateResult]:
  """Submits n samples per prompt (seeds seed, seed+1, ... when a seed is given) and waits for all."""
  n = protocol.get_int(body, "n", 1, lo=1, hi=engine.config.max_slots * 4)
  base = body.get("rid")
  if base is not None and not isinstance(base, str):
    raise InvalidRequest("rid", f"must be a string, got {base!r}")
  base = base or uuid.uuid4().hex
  handles, k = [], 0
  for ids in prompts:
    for j in range(n):
      seed = None if sampling.seed is None else sampling.seed + j
      s = dataclasses.replace(sampling, seed=seed)
      rid = base if len(prompts) * n == 1 else f"{base}-{k}"
      handles.append(_submit(engine, GenerateRequest(rid, tuple(ids), s)))
      k += 1
  return [engine.wait(h) for h in handles]


def _submit(engine: InferenceEngine, request: GenerateRequest):
  try:
    return engine.submit(request)
  except InvalidRequest as e:  # engine fields are /generate's; name the OpenAI ones instead
    field = {"input_ids": "prompt", "sampling_params.max_new_tokens": "max_tokens"}.get(e.field, e.field)
    raise InvalidRequest(field, str(e).split(": ", 1)[-1]) from e


def _completion_prompts(prompt: Any, tok: Tokenizer | None) -> list[list[int]]:
  if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
    return [protocol.int_list(p, f"prompt[{i}]", required=True) for i, p in enumerate(prompt)]
  if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
    return [prompt]
  texts = [prompt] if isinstance(prompt, str) else prompt
  if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
    raise InvalidRequest("prompt", "must be a string, a list of strings, or token id list(s)")
  if tok is None:
    raise InvalidRequest("prompt", "this server has no tokenizer; send token ids")
  return [tok.encode_with_specials(t) for t in texts]


def _completion_logprobs(c: GenerateResult, n: int, tok: Tokenizer | None) -> dict:
  name = _namer(tok)
  tokens = [name(t) for t in c.output_ids]
  offsets, pos = [], 0
  for t in tokens:
    offsets.append(pos)
    pos += len(t)
  return {
    "tokens": tokens,
    "token_logprobs": list(c.output_logprobs),
    "text_offset": offsets,
    "top_logprobs": [{name(t): lp for t, lp in top[:n]} for top in c.top_logprobs],
  }


def _chat_logprobs(c: GenerateResult, n: int, tok: Tokenizer) -> list[dict]:
  def entry(t: int, lp: float) -> dict:
    text = tok.token_name(t)
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": lp}

  return [
    {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top[:n]]}
    for t, lp, top in zip(c.output_ids, c.output_logprobs, c.top_logprobs)
  ]


def _namer(tok: Tokenizer | None) -> Callable[[int], str]:
  return tok.token_name if tok is not None else (lambda t: f"<|token_{t}|>")


def _envelope(
  prefix: str, obj: str, model: str, choices: list, results: list[GenerateResult], prompt_tokens: int
) -> dict:
  completion_tokens = sum(len(c.output_ids) for c in results)
  return {
    "id": f"{prefix}-{uuid.uuid4().hex}",
    "object": obj,
    "created": int(time.time()),
    "model": model,
    "choices": choices,
    "usage": {
      "prompt_tokens": prompt_tokens,
      "completion_tokens": completion_tokens,
      "total_tokens": prompt_tokens + completion_tokens,
    },
  }


def _check_keys(body: Any, known: set[str]) -> None:
  if not isinstance(body, dict):
    raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
  for key, value in body.items():
    if key not in known:
      raise InvalidRequest(key, "unknown or unsupported field")
    if key in _NEUTRAL and value is not None and value != _NEUTRAL[key]:
      raise InvalidRequest(key, f"not supported by the k2jax engine (only {_NEUTRAL[key]!r}), got {value!r}")
