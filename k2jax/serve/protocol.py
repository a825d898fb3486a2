"""SGLang's `/generate` contract (reference k2-rl-and-serving.md §2.1-2.2): request checks and responses.

Every malformed field raises `InvalidRequest(field, problem)`, which the HTTP layer answers with 400.
Sampling parameters the engine does not implement (penalties, grammars, logit processors) are
accepted only at their neutral values, so a request never silently gets a different sampler.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from k2jax.data.tokenizer import Tokenizer
from k2jax.engine.base import GenerateRequest, GenerateResult, InvalidRequest, SamplingParams

# sampling_params keys accepted only at the given neutral value.
_NEUTRAL_SAMPLING = {
  "min_new_tokens": 0,
  "min_p": 0.0,
  "frequency_penalty": 0.0,
  "presence_penalty": 0.0,
  "repetition_penalty": 1.0,
  "n": 1,
  "json_schema": None,
  "regex": None,
  "ebnf": None,
  "structural_tag": None,
  "logit_bias": None,
  "custom_params": None,
  "stop_regex": None,
}
_IGNORED_SAMPLING = ("spaces_between_special_tokens", "stream_interval")
# top-level /generate keys accepted only when falsy.
_FALSY_ONLY = (
  "stream",
  "return_hidden_states",
  "return_routed_experts",
  "return_entropy",
  "lora_path",
  "custom_logit_processor",
  "image_data",
  "video_data",
  "audio_data",
  "input_embeds",
  "token_ids_logprob",
)
_IGNORED_TOP = (
  "extra_key",
  "priority",
  "routed_dp_rank",
  "data_parallel_rank",
  "return_prompt_token_ids",
  "logprob_start_len",
)


@dataclasses.dataclass(frozen=True)
class TextOptions:
  """How a request wants its outputs rendered (not part of sampling)."""

  return_logprob: bool = False
  top_logprobs_num: int = 0
  return_text_in_logprobs: bool = False
  skip_special_tokens: bool = True
  no_stop_trim: bool = False


@dataclasses.dataclass(frozen=True)
class GenerateCall:
  requests: list[GenerateRequest]
  options: list[TextOptions]
  batch: bool


def parse_generate(body: Any, tokenizer: Tokenizer | None, max_top: int) -> GenerateCall:
  """A `/generate` body -> engine requests (one, or several for a batch)."""
  if not isinstance(body, dict):
    raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
  known = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "top_logprobs_num",
    "return_text_in_logprobs",
    *_FALSY_ONLY,
    *_IGNORED_TOP,
  }
  for key in body:
    if key not in known:
      raise InvalidRequest(key, "unknown or unsupported /generate field")
    if key in _FALSY_ONLY and body[key]:
      raise InvalidRequest(key, "not supported by the k2jax engine (send false/null)")
  if body.get("logprob_start_len", -1) not in (-1, None):
    raise InvalidRequest("logprob_start_len", "input-token logprobs are not supported; use -1")
  prompts, batch = _prompts(body, tokenizer)
  n = len(prompts)
  rids = _rids(body.get("rid"), n, batch)
  sps = body.get("sampling_params") or {}
  if isinstance(sps, list):
    if len(sps) != n:
      raise InvalidRequest("sampling_params", f"has {len(sps)} entries for {n} prompts")
  else:
    sps = [sps] * n
  requests, options = [], []
  for i, (ids, rid, sp) in enumerate(zip(prompts, rids, sps)):
    field = "sampling_params" if not isinstance(body.get("sampling_params"), list) else f"sampling_params[{i}]"
    sampling, text_opts = parse_sampling(sp, field, tokenizer)
    requests.append(GenerateRequest(rid=rid, input_ids=tuple(ids), sampling=sampling))
    options.append(
      dataclasses.replace(
        text_opts,
        return_logprob=get_bool(body, "return_logprob", False),
        top_logprobs_num=get_int(body, "top_logprobs_num", 0, lo=0, hi=max_top),
        return_text_in_logprobs=get_bool(body, "return_text_in_logprobs", False),
      )
    )
  return GenerateCall(requests, options, batch)


def parse_sampling(sp: Any, field: str, tokenizer: Tokenizer | None) -> tuple[SamplingParams, TextOptions]:
  if not isinstance(sp, dict):
    raise InvalidRequest(field, f"must be an object, got {type(sp).__name__}")
  known = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "skip_special_tokens",
    "no_stop_trim",
    *_NEUTRAL_SAMPLING,
    *_IGNORED_SAMPLING,
  }
  for key, value in sp.items():
    if key not in known:
      raise InvalidRequest(f"{field}.{key}", "unknown sampling parameter")
    if key in _NEUTRAL_SAMPLING and value is not None and value != _NEUTRAL_SAMPLING[key]:
      raise InvalidRequest(
        f"{field}.{key}", f"not supported by the k2jax engine (only {_NEUTRAL_SAMPLING[key]!r}), got {value!r}"
      )
  f = lambda k: f"{field}.{k}"  # noqa: E731
  sampling = SamplingParams(
    max_new_tokens=get_int(sp, "max_new_tokens", 128, lo=0, field=f("max_new_tokens")),
    temperature=get_float(sp, "temperature", 1.0, lo=0.0, field=f("temperature")),
    top_p=get_float(sp, "top_p", 1.0, lo=0.0, field=f("top_p"), lo_open=True, hi=1.0),
    top_k=get_int(sp, "top_k", -1, field=f("top_k")),
    stop=tuple(str_list(sp.get("stop"), f("stop"))),
    stop_token_ids=tuple(int_list(sp.get("stop_token_ids"), f("stop_token_ids"))),
    ignore_eos=get_bool(sp, "ignore_eos", False, field=f("ignore_eos")),
    seed=get_int(sp, "sampling_seed", None, field=f("sampling_seed")),
  )
  text = TextOptions(
    skip_special_tokens=get_bool(sp, "skip_special_tokens", True, field=f("skip_special_tokens")),
    no_stop_trim=get_bool(sp, "no_stop_trim", False, field=f("no_stop_trim")),
  )
  return sampling, text


def finish_reason(c: GenerateResult) -> dict:
  """SGLang's `meta_info.finish_reason` object for a result."""
  if c.finish_reason == "stop":
    return {"type": "stop", "matched": c.matched_stop}
  if c.finish_reason == "length":
    return {"type": "length", "length": len(c.output_ids)}
  return {"type": "abort", "message": c.abort_message, "status_code": 200}


def generate_response(c: GenerateResult, opts: TextOptions, tokenizer: Tokenizer | None, weight_version: int) -> dict:
  """SGLang's non-streaming `/generate` answer for one request (`weight_version`: the server's, reported
  when no token carries one)."""
  meta = {
    "id": c.rid,
    "finish_reason": finish_reason(c),
    "prompt_tokens": c.prompt_tokens,
    "completion_tokens": len(c.output_ids),
    "cached_tokens": c.cached_tokens,
    "weight_version": str(c.weight_versions[-1] if c.weight_versions else weight_version),
    "e2e_latency": c.latency_s,
  }
  piece = (lambda t: tokenizer.token_name(t)) if (tokenizer and opts.return_text_in_logprobs) else (lambda t: None)
  if opts.return_logprob:
    meta["output_token_logprobs"] = [[lp, t, piece(t)] for lp, t in zip(c.output_logprobs, c.output_ids)]
    if opts.top_logprobs_num:
      meta["output_top_logprobs"] = [
        [[lp, t, piece(t)] for t, lp in top[: opts.top_logprobs_num]] for top in c.top_logprobs
      ]
  out = {"output_ids": list(c.output_ids), "meta_info": meta}
  if tokenizer is not None:
    out["text"] = output_text(c, opts, tokenizer)
  return out


def output_text(c: GenerateResult, opts: TextOptions, tokenizer: Tokenizer) -> str:
  """Decoded output; a matched stop token or stop string (and what follows it) is trimmed."""
  ids = list(c.output_ids)
  matched = c.matched_stop
  if not opts.no_stop_trim and isinstance(matched, int) and ids and ids[-1] == matched:
    ids = ids[:-1]
  if opts.skip_special_tokens:
    ids = [t for t in ids if t < tokenizer.num_base_tokens]
  text = tokenizer.decode(ids)
  if not opts.no_stop_trim and isinstance(matched, str) and matched in text:
    text = text[: text.index(matched)]
  return text


def _prompts(body: dict, tokenizer: Tokenizer | None) -> tuple[list[list[int]], bool]:
  has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
  if has_text == has_ids:
    raise InvalidRequest("input_ids", "give exactly one of `text` or `input_ids`")
  if has_ids:
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
      return [int_list(x, f"input_ids[{i}]", required=True) for i, x in enumerate(ids)], True
    return [int_list(ids, "input_ids", required=True)], False
  if tokenizer is None:
    raise InvalidRequest("text", "this server has no tokenizer; send input_ids")
  text = body["text"]
  if isinstance(text, str):
    return [tokenizer.encode_with_specials(text)], False
  if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
    return [tokenizer.encode_with_specials(t) for t in text], True
  raise InvalidRequest("text", "must be a string or a non-empty list of strings")


def _rids(rid: Any, n: int, batch: bool) -> list[str]:
  if rid is None:
    return [uuid.uuid4().hex for _ in range(n)]
  if batch:
    if not isinstance(rid, list) or len(rid) != n or not all(isinstance(r, str) and r for r in rid):
      raise InvalidRequest("rid", f"a batch needs a list of {n} non-empty strings")
    if len(set(rid)) != n:
      raise InvalidRequest("rid", "ids in a batch must be distinct")
    return list(rid)
  if isinstance(rid, list) and len(rid) == 1:
    rid = rid[0]
  if not isinstance(rid, str) or not rid:
    raise InvalidRequest("rid", f"must be a non-empty string, got {rid!r}")
  return [rid]


def get_bool(d: dict, key: str, default: bool, field: str | None = None) -> bool:
  v = d.get(key, default)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise InvalidRequest(field or key, f"must be true or false, got {v!r}")
  return v


def get_int(d: dict, key: str, default, *, lo: int | None = None, hi: int | None = None, field: str | None = None):
  v = d.get(key, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, int):
    raise InvalidRequest(field or key, f"must be an integer, got {v!r}")
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    raise InvalidRequest(field or key, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
  return v


def get_float(
  d: dict, key: str, default: float, *, lo: float, field: str, hi: float | None = None, lo_open: bool = False
) -> float:
  v = d.get(key, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise InvalidRequest(field, f"must be a number, got {v!r}")
  if v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
    raise InvalidRequest(
      field, f"must be in {'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}], got {v}"
    )
  return float(v)


def str_list(v: Any, field: str) -> list[str]:
  if v is None:
    return []
  if isinstance(v, str):
    v = [v]
  if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
    raise InvalidRequest(field, "must be a non-empty string or a list of non-empty strings")
  return v


def int_list(v: Any, field: str, required: bool = False) -> list[int]:
  if v is None and not required:
    return []
  if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
    raise InvalidRequest(field, f"must be a list of integer token ids, got {str(v)[:80]}")
  if required and not v:
    raise InvalidRequest(field, "must not be empty")
  return v
