"""SGLang's `/generate` contract (reference k2-rl-and-serving.md §2.1-2.2): request checks and responses.

Bodies are validated by strict pydantic models (bounds on every sampling field, finite numbers, no
unknown keys); every malformed field raises `InvalidRequest(field, problem)`, which the HTTP layer
answers with 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from k2jax import httpservice
from k2jax.data.tokenizer import Tokenizer
from k2jax.engine.base import GenerateRequest, GenerateResult, InvalidRequest, SamplingParams
from k2jax.serve.limits import RequestCaps


class SamplingBody(httpservice.StrictBody):
  """SGLang's `sampling_params` (reference §2.2). Parameters the engine does not implement (penalties,
  grammars, logit processors) are accepted only at their neutral values, so a request never silently gets
  a different sampler. `top_k`'s upper bound (the vocab) is checked by the engine, which knows it."""

  max_new_tokens: int = Field(128, ge=0)
  temperature: float = Field(1.0, ge=0.0, le=1e4)
  top_p: float = Field(1.0, gt=0.0, le=1.0)
  top_k: int = Field(-1, ge=-1)
  stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
  stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
  ignore_eos: bool = False
  sampling_seed: int | None = None
  skip_special_tokens: bool = True
  no_stop_trim: bool = False
  # neutral only
  min_new_tokens: Literal[0] | None = None
  min_p: Literal[0, 0.0] | None = None
  frequency_penalty: Literal[0, 0.0] | None = None
  presence_penalty: Literal[0, 0.0] | None = None
  repetition_penalty: Literal[1, 1.0] | None = None
  n: Literal[1] | None = None
  json_schema: None = None
  regex: None = None
  ebnf: None = None
  structural_tag: None = None
  logit_bias: None = None
  custom_params: None = None
  stop_regex: None = None
  # ignored
  spaces_between_special_tokens: bool | None = None
  stream_interval: int | None = None


_TokenIds = list[Annotated[int, Field(ge=0)]]


class GenerateBody(httpservice.StrictBody):
  """SGLang's `/generate` body: one prompt or a batch (lists of prompts, rids, sampling params)."""

  text: str | list[str] | None = None
  input_ids: _TokenIds | list[_TokenIds] | None = None
  sampling_params: dict | list[dict] | None = None  # validated per prompt, to name the entry
  rid: str | list[str] | None = None
  return_logprob: bool = False
  top_logprobs_num: int = Field(0, ge=0)
  return_text_in_logprobs: bool = False
  stream: bool = False
  logprob_start_len: int | None = None  # with return_logprob: prompt logprobs from this position on
  # not supported: accepted only when falsy
  return_hidden_states: Literal[False] | None = None
  return_routed_experts: Literal[False] | None = None
  return_entropy: Literal[False] | None = None
  lora_path: None = None
  custom_logit_processor: None = None
  image_data: None = None
  video_data: None = None
  audio_data: None = None
  input_embeds: None = None
  token_ids_logprob: None = None
  # ignored
  extra_key: str | None = None
  priority: int | None = None
  routed_dp_rank: int | None = None
  data_parallel_rank: int | None = None
  return_prompt_token_ids: bool | None = None


@dataclasses.dataclass(frozen=True)
class TextOptions:
  """How a request wants its outputs rendered (not part of sampling)."""

  return_logprob: bool = False
  top_logprobs_num: int = 0
  return_text_in_logprobs: bool = False
  skip_special_tokens: bool = True
  no_stop_trim: bool = False
  input_ids: tuple[int, ...] = ()  # the prompt from logprob_start_len on (input_token_logprobs' ids)


@dataclasses.dataclass(frozen=True)
class GenerateCall:
  requests: list[GenerateRequest]
  options: list[TextOptions]
  batch: bool
  stream: bool = False


def parse_generate(
  body: Any, tokenizer: Tokenizer | None, max_top: int, caps: RequestCaps = RequestCaps()
) -> GenerateCall:
  """A `/generate` body -> engine requests (one, or several for a batch), within `caps`."""
  if not isinstance(body, dict):
    raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
  for key in ("text", "input_ids", "sampling_params", "rid"):  # before validating what a cap would refuse
    value = body.get(key)
    if isinstance(value, list) and (key == "text" or (value and isinstance(value[0], (list, dict, str)))):
      caps.batch(len(value), key)
  g = httpservice.validate(GenerateBody, body, "")
  if isinstance(g.text, str):
    caps.prompt_bytes([g.text], "text")
    check_unicode(g.text, "text")
  elif g.text is not None:
    caps.prompt_bytes(g.text, "text")
    for i, t in enumerate(g.text):
      check_unicode(t, f"text[{i}]")
  if g.top_logprobs_num > max_top:
    raise InvalidRequest("top_logprobs_num", f"must be in [0, {max_top}], got {g.top_logprobs_num}")
  prompts, batch = _prompts(g, tokenizer)
  n = len(prompts)
  if g.stream and batch:
    raise InvalidRequest("stream", "streaming takes one prompt per request")
  rids = _rids(g.rid, n, batch)
  sps = g.sampling_params if g.sampling_params is not None else {}
  if isinstance(sps, list):
    if len(sps) != n:
      raise InvalidRequest("sampling_params", f"has {len(sps)} entries for {n} prompts")
    fields = [f"sampling_params[{i}]" for i in range(n)]
  else:
    sps, fields = [sps] * n, ["sampling_params"] * n
  requests, options = [], []
  for ids, rid, sp, field in zip(prompts, rids, sps, fields):
    sampling, text_opts = parse_sampling(sp, field, tokenizer, caps)
    start = g.logprob_start_len if g.logprob_start_len is not None and g.return_logprob else -1
    requests.append(
      GenerateRequest(
        rid=rid,
        input_ids=tuple(ids),
        sampling=sampling,
        logprob_start_len=start,
        input_top_logprobs_num=g.top_logprobs_num,
      )
    )
    options.append(
      dataclasses.replace(
        text_opts,
        return_logprob=g.return_logprob,
        top_logprobs_num=g.top_logprobs_num,
        return_text_in_logprobs=g.return_text_in_logprobs,
        input_ids=tuple(ids[start:]) if start >= 0 else (),
      )
    )
  return GenerateCall(requests, options, batch, g.stream)


def parse_sampling(
  sp: Any, field: str, tokenizer: Tokenizer | None, caps: RequestCaps = RequestCaps()
) -> tuple[SamplingParams, TextOptions]:
  if isinstance(sp, dict):  # counts first: validating a million stop strings is itself the attack
    stop, ids = sp.get("stop"), sp.get("stop_token_ids")
    caps.stops(stop if isinstance(stop, list) else (), ids if isinstance(ids, list) else (), f"{field}.")
    check_stop_unicode(stop, f"{field}.stop")  # before pydantic, whose message for it names no surrogate
  s = httpservice.validate(SamplingBody, sp, field)
  sampling = SamplingParams(
    max_new_tokens=s.max_new_tokens,
    temperature=s.temperature,
    top_p=s.top_p,
    top_k=s.top_k,
    stop=(s.stop,) if isinstance(s.stop, str) else tuple(s.stop or ()),
    stop_token_ids=tuple(s.stop_token_ids or ()),
    ignore_eos=s.ignore_eos,
    seed=s.sampling_seed,
  )
  if "" in sampling.stop:
    raise InvalidRequest(f"{field}.stop", "stop strings must be non-empty")
  caps.stops(sampling.stop, sampling.stop_token_ids, f"{field}.")
  return sampling, TextOptions(skip_special_tokens=s.skip_special_tokens, no_stop_trim=s.no_stop_trim)


def check_unicode(text: str, field: str) -> None:
  """400 for text that is not Unicode: a JSON `\\ud800`..`\\udfff` escape without its pair decodes to a lone
  surrogate, which no tokenizer can encode (UTF-8 has no bytes for it); OpenAI and SGLang refuse it too."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    code = f"U+{ord(text[e.start]):04X}"
    raise InvalidRequest(field, f"is not valid Unicode: a lone surrogate {code} at character {e.start}") from None


def check_stop_unicode(stop: Any, field: str) -> None:
  """`check_unicode` for a raw `stop` value (a string or a list of them; other types are pydantic's)."""
  for i, text in enumerate([stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []):
    if isinstance(text, str):
      check_unicode(text, field if isinstance(stop, str) else f"{field}[{i}]")


def finish_reason(c: GenerateResult) -> dict | None:
  """SGLang's `meta_info.finish_reason` object for a result (None while the request runs)."""
  if c.finish_reason == "stop":
    return {"type": "stop", "matched": c.matched_stop}
  if c.finish_reason == "length":
    return {"type": "length", "length": len(c.output_ids)}
  if c.finish_reason == "abort":
    return {"type": "abort", "message": c.abort_message}
  return None


def generate_response(c: GenerateResult, opts: TextOptions, tokenizer: Tokenizer | None, weight_version: int) -> dict:
  """SGLang's `/generate` answer for one request (`weight_version`: the server's, reported when no token
  carries one yet)."""
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
  if opts.return_logprob and opts.input_ids:
    meta["input_token_logprobs"] = [[lp, t, piece(t)] for lp, t in zip(c.input_logprobs, opts.input_ids)]
    if opts.top_logprobs_num:
      meta["input_top_logprobs"] = [
        [[lp, t, piece(t)] for t, lp in top[: opts.top_logprobs_num]] or None for top in c.input_top_logprobs
      ]
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


def _prompts(g: GenerateBody, tokenizer: Tokenizer | None) -> tuple[list[list[int]], bool]:
  if (g.text is None) == (g.input_ids is None):
    raise InvalidRequest("input_ids", "give exactly one of `text` or `input_ids`")
  if g.input_ids is not None:
    ids = g.input_ids
    if ids and all(isinstance(x, list) for x in ids):
      for i, x in enumerate(ids):
        if not x:
          raise InvalidRequest(f"input_ids[{i}]", "must not be empty")
      return [list(x) for x in ids], True
    if not ids:
      raise InvalidRequest("input_ids", "must not be empty")
    return [list(ids)], False
  if tokenizer is None:
    raise InvalidRequest("text", "this server has no tokenizer; send input_ids")
  if isinstance(g.text, str):
    return [tokenizer.encode_with_specials(g.text)], False
  if not g.text:
    raise InvalidRequest("text", "must be a string or a non-empty list of strings")
  return [tokenizer.encode_with_specials(t) for t in g.text], True


def _rids(rid: str | list[str] | None, n: int, batch: bool) -> list[str]:
  if rid is None:
    return [uuid.uuid4().hex for _ in range(n)]
  if batch:
    if not isinstance(rid, list) or len(rid) != n or not all(rid):
      raise InvalidRequest("rid", f"a batch needs a list of {n} non-empty strings")
    if len(set(rid)) != n:
      raise InvalidRequest("rid", "ids in a batch must be distinct")
    return list(rid)
  if isinstance(rid, list) and len(rid) == 1:
    rid = rid[0]
  if not isinstance(rid, str) or not rid:
    raise InvalidRequest("rid", f"must be a non-empty string, got {rid!r}")
  return [rid]
