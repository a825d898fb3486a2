"""Kimi K2 chat template and tool-call format: render messages to token ids with an SFT loss mask,
and parse token ids (or text) back to messages. Pure functions; no state beyond the tokenizer.

Format (released K2 template; reference k2-data-and-synthesis.md §6):
  <|im_system|>tool_declare<|im_middle|>[...compact OpenAI tools JSON...]<|im_end|>   (if tools)
  <|im_system|>system<|im_middle|>{content}<|im_end|>
  <|im_user|>user<|im_middle|>{content}<|im_end|>
  <|im_assistant|>assistant<|im_middle|>{content}<|tool_calls_section_begin|>
      <|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{json}<|tool_call_end|>
      ...<|tool_calls_section_end|><|im_end|>
  <|im_system|>{tool name or "tool"}<|im_middle|>## Return of {call id}\n{content}<|im_end|>
The section markup has no whitespace between tokens (as K2 emits it). Message `name` replaces the
role label when given. Loss mask: 1 on an assistant turn's body (content, the whole tool-call section,
and its closing <|im_end|>, so the model learns to stop); 0 on its `<|im_assistant|>assistant
<|im_middle|>` header and on every system, user, tool-declaration and tool-result token.

Tool-call ids: K2 ids are `functions.{name}:{idx}` and carry the function name. Other ids (OpenAI's
opaque `call_...`) are rewritten to K2 ids with a counter over the whole dialogue (K2 paper App. B),
and tool results that cite them are rewritten to match. Tool names containing `.` or `:` are
rejected: the id cannot carry them unambiguously.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from k2jax.data.tokenizer import Tokenizer, load_tokenizer

ROLES = ("system", "user", "assistant", "tool")
K2_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
_K2_ID = re.compile(r"^functions\.([^.:]+):(\d+)$")
_ROLE_TOKEN = {
  "system": "<|im_system|>",
  "user": "<|im_user|>",
  "assistant": "<|im_assistant|>",
  "tool": "<|im_system|>",
}


class ChatFormatError(ValueError):
  """A message list that cannot be rendered; `.field` names the offending part."""

  def __init__(self, field: str, problem: str):
    super().__init__(f"{field}: {problem}")
    self.field = field


class UnknownRoleError(ChatFormatError):
  pass


def normalize_messages(
  messages: Sequence[dict], tools: Sequence[dict] | None = None
) -> tuple[list[dict], list[dict] | None]:
  """Validates OpenAI-style messages/tools and returns the canonical form `render_chat` renders
  (and `parse_chat` returns): string contents, K2 tool-call ids, JSON-string arguments."""
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ChatFormatError("messages", "must be a non-empty list")
  out, id_map, counter = [], {}, 0
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise ChatFormatError(f"messages[{i}]", "must be an object")
    role = m.get("role")
    if role not in ROLES:
      raise UnknownRoleError(f"messages[{i}].role", f"unknown role {role!r} (want one of {ROLES})")
    msg = {"role": role, "content": _content(m.get("content"), f"messages[{i}].content")}
    if m.get("name") is not None and role != "tool":
      msg["name"] = str(m["name"])
    if role == "assistant" and m.get("tool_calls"):
      msg["tool_calls"] = []
      for j, call in enumerate(m["tool_calls"]):
        msg["tool_calls"].append(_tool_call(call, f"messages[{i}].tool_calls[{j}]", counter, id_map))
        counter += 1
    if role == "tool":
      call_id = m.get("tool_call_id")
      if not isinstance(call_id, str) or not call_id:
        raise ChatFormatError(f"messages[{i}].tool_call_id", "tool message needs a tool_call_id")
      msg["tool_call_id"] = id_map.get(call_id, call_id)
      if m.get("name"):
        msg["name"] = str(m["name"])
    out.append(msg)
  return out, _tools(tools)


def render_chat(
  messages: Sequence[dict],
  tools: Sequence[dict] | None = None,
  *,
  tokenizer: Tokenizer | None = None,
  add_generation_prompt: bool = False,
  default_system: str | None = None,
) -> tuple[list[int], list[int]]:
  """Renders a conversation to (token ids, loss mask) in K2's format (see module docstring).

  Args:
    messages: OpenAI-style messages (`role`, `content`, optional `name`, assistant `tool_calls`,
      tool `tool_call_id`).
    tools: OpenAI-style tool list (`{"type": "function", "function": {...}}`), declared first.
    tokenizer: defaults to the bundled tokenizer.
    add_generation_prompt: end with `<|im_assistant|>assistant<|im_middle|>` (for sampling).
    default_system: if set and the first message is not a system message, insert this one
      (K2's released template inserts `K2_DEFAULT_SYSTEM`).
  Raises:
    ChatFormatError (UnknownRoleError for a bad role) naming the offending field.
  """
  tok = tokenizer or load_tokenizer()
  ids, mask = [], []
  for piece, trainable in _pieces(messages, tools, add_generation_prompt, default_system):
    piece_ids = [tok.special_ids[piece[1]]] if isinstance(piece, tuple) else tok.encode(piece)
    ids.extend(piece_ids)
    mask.extend([int(trainable)] * len(piece_ids))
  return ids, mask


def render_chat_text(
  messages: Sequence[dict],
  tools: Sequence[dict] | None = None,
  *,
  add_generation_prompt: bool = False,
  default_system: str | None = None,
) -> str:
  """The same rendering as text (special tokens by name), e.g. for an HTTP completion prompt."""
  return "".join(
    p[1] if isinstance(p, tuple) else p for p, _ in _pieces(messages, tools, add_generation_prompt, default_system)
  )


def parse_assistant(text_or_ids: str | Sequence[int], *, tokenizer: Tokenizer | None = None) -> dict:
  """Parses one assistant generation (what follows `<|im_assistant|>assistant<|im_middle|>`).

  Returns `{"role": "assistant", "content": str, "tool_calls": [{"id", "type": "function",
  "function": {"name", "arguments"}}]}`; stops at `<|im_end|>`. Malformed or unterminated calls are
  not returned as calls; they add `"tool_call_error"` describing what was wrong (arguments are not
  JSON-validated here: `arguments` is the raw string, as in OpenAI's API).
  """
  tok = tokenizer or load_tokenizer()
  ids = tok.encode_with_specials(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
  end = tok.special_ids["<|im_end|>"]
  if end in ids:
    ids = ids[: ids.index(end)]
  return _parse_assistant_body(ids, tok)


def parse_chat(
  text_or_ids: str | Sequence[int], *, tokenizer: Tokenizer | None = None
) -> tuple[list[dict], list[dict] | None]:
  """Inverse of `render_chat`: returns (messages, tools) in `normalize_messages` form."""
  tok = tokenizer or load_tokenizer()
  ids = tok.encode_with_specials(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
  sp = tok.special_ids
  starts = {sp["<|im_system|>"]: "system", sp["<|im_user|>"]: "user", sp["<|im_assistant|>"]: "assistant"}
  messages, tools, pos = [], None, 0
  while pos < len(ids):
    if ids[pos] not in starts:
      raise ValueError(f"token {pos} ({tok.token_name(ids[pos])!r}) does not start a turn")
    mid, end = _find(ids, sp["<|im_middle|>"], pos), _find(ids, sp["<|im_end|>"], pos)
    role, name = starts[ids[pos]], tok.decode(ids[pos + 1 : mid])
    body = ids[mid + 1 : end]
    if role == "assistant":
      msg = _parse_assistant_body(body, tok)
    else:
      text = tok.decode(body)
      if role == "system" and name == "tool_declare":
        tools, msg = json.loads(text), None
      elif role == "system" and text.startswith("## Return of "):
        header, _, content = text.partition("\n")
        msg = {"role": "tool", "content": content, "tool_call_id": header[len("## Return of ") :]}
        if name != "tool":
          msg["name"] = name
      else:
        msg = {"role": role, "content": text}
    if msg is not None:
      if role != "tool" and msg["role"] != "tool" and name != msg["role"]:
        msg["name"] = name
      messages.append(msg)
    pos = end + 1
  return messages, tools


def _pieces(messages, tools, add_generation_prompt, default_system):
  """(piece, trainable) pairs; a piece is text or ("special", name)."""
  messages, tools = normalize_messages(messages, tools)
  S = lambda name: ("special", name)  # noqa: E731
  if tools:
    yield from (
      (S("<|im_system|>"), 0),
      ("tool_declare", 0),
      (S("<|im_middle|>"), 0),
      (json.dumps(tools, separators=(",", ":"), ensure_ascii=False), 0),
      (S("<|im_end|>"), 0),
    )
  if default_system is not None and messages[0]["role"] != "system":
    messages = [{"role": "system", "content": default_system}] + messages
  for m in messages:
    role, train = m["role"], m["role"] == "assistant"
    label = m.get("name") or role
    yield from ((S(_ROLE_TOKEN[role]), 0), (label, 0), (S("<|im_middle|>"), 0))
    if role == "tool":
      yield f"## Return of {m['tool_call_id']}\n{m['content']}", 0
    elif m["content"]:
      yield m["content"], train
    if m.get("tool_calls"):
      yield S("<|tool_calls_section_begin|>"), 1
      for call in m["tool_calls"]:
        yield from (
          (S("<|tool_call_begin|>"), 1),
          (call["id"], 1),
          (S("<|tool_call_argument_begin|>"), 1),
          (call["function"]["arguments"], 1),
          (S("<|tool_call_end|>"), 1),
        )
      yield S("<|tool_calls_section_end|>"), 1
    yield S("<|im_end|>"), train
  if add_generation_prompt:
    yield from ((S("<|im_assistant|>"), 0), ("assistant", 0), (S("<|im_middle|>"), 0))


def _parse_assistant_body(ids: list[int], tok: Tokenizer) -> dict:
  sp = tok.special_ids
  begin = sp["<|tool_calls_section_begin|>"]
  cut = ids.index(begin) if begin in ids else len(ids)
  msg: dict[str, Any] = {"role": "assistant", "content": tok.decode(ids[:cut]), "tool_calls": []}
  rest, errors = ids[cut + 1 :], []
  if cut < len(ids) and sp["<|tool_calls_section_end|>"] not in rest:
    errors.append("tool-call section not closed")
  pos = 0
  while sp["<|tool_call_begin|>"] in rest[pos:]:
    start = rest.index(sp["<|tool_call_begin|>"], pos)
    try:
      arg = rest.index(sp["<|tool_call_argument_begin|>"], start)
      stop = rest.index(sp["<|tool_call_end|>"], arg)
    except ValueError:
      errors.append(f"tool call {len(msg['tool_calls'])} not terminated")
      break
    call_id, args = tok.decode(rest[start + 1 : arg]).strip(), tok.decode(rest[arg + 1 : stop])
    match = _K2_ID.match(call_id)
    if match is None:
      errors.append(f"tool call id {call_id!r} is not functions.NAME:IDX")
    else:
      msg["tool_calls"].append(
        {"id": call_id, "type": "function", "function": {"name": match.group(1), "arguments": args}}
      )
    pos = stop + 1
  if not msg["tool_calls"]:
    del msg["tool_calls"]
  if errors:
    msg["tool_call_error"] = "; ".join(errors)
  return msg


def _content(content, field: str) -> str:
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # OpenAI content parts: only text parts carry training text.
    if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
      return "".join(p["text"] for p in content)
  raise ChatFormatError(field, f"must be a string or a list of text parts, got {type(content).__name__}")


def _tool_call(call, field: str, counter: int, id_map: dict) -> dict:
  fn = call.get("function") if isinstance(call, dict) else None
  if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
    raise ChatFormatError(field, "needs function.name")
  name = fn["name"]
  if "." in name or ":" in name:
    raise ChatFormatError(f"{field}.function.name", f"{name!r} contains '.' or ':'")
  args = fn.get("arguments", "{}")
  if not isinstance(args, str):
    args = json.dumps(args, ensure_ascii=False)
  try:
    json.loads(args)
  except ValueError as e:
    raise ChatFormatError(f"{field}.function.arguments", f"not valid JSON: {e}") from e
  old = call.get("id")
  match = _K2_ID.match(old) if isinstance(old, str) else None
  new = old if match and match.group(1) == name else f"functions.{name}:{counter}"
  if isinstance(old, str):
    id_map[old] = new
  return {"id": new, "type": "function", "function": {"name": name, "arguments": args}}


def _tools(tools):
  if tools is None or len(tools) == 0:
    return None
  if not isinstance(tools, (list, tuple)):
    raise ChatFormatError("tools", "must be a list")
  for i, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise ChatFormatError(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ...}}")
  return list(tools)


def _find(ids: list[int], token: int, start: int) -> int:
  try:
    return ids.index(token, start)
  except ValueError:
    raise ValueError(f"unterminated turn starting at token {start}") from None
