"""Tool calls out of generated tokens, validated against the registry, with structured errors.

The agent's output is untrusted: a malformed call section, arguments that are not JSON, an unknown
tool, or arguments the tool's schema rejects each become a `ToolError` that is returned to the agent
as the call's result (MCP's `isError` result, reference §5.1), so the model can see and correct it.
Nothing here raises on model output; `tests/agentic/test_calls.py` fuzzes that with hypothesis.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import jsonschema

from k2jax.agentic.tools import ToolRegistry
from k2jax.data.chat import parse_assistant
from k2jax.data.tokenizer import Tokenizer

ERROR_KINDS = (
  "malformed_call",
  "malformed_json",
  "unknown_tool",
  "bad_arguments",
  "denied",
  "rate_limited",
  "timeout",
  "tool_failed",
  "no_network",
)
NO_CALL_ID = "functions.invalid:0"  # answers a call whose id could not be read


@dataclasses.dataclass(frozen=True)
class ToolError:
  kind: str  # one of ERROR_KINDS
  message: str
  call_id: str = NO_CALL_ID
  tool: str | None = None

  def __post_init__(self):
    if self.kind not in ERROR_KINDS:
      raise ValueError(f"ToolError.kind {self.kind!r} not in {ERROR_KINDS}")

  def content(self) -> str:
    """The text the agent sees as this call's result."""
    return json.dumps({"isError": True, "error": self.kind, "message": self.message}, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  call_id: str  # K2 id functions.{name}:{idx}
  name: str
  arguments: dict


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """One assistant turn: its text, its valid calls and one error per bad call (in order)."""

  content: str
  calls: tuple[ToolCall, ...]
  errors: tuple[ToolError, ...]
  message: dict  # the OpenAI-style assistant message (raw arguments strings)

  @property
  def has_calls(self) -> bool:
    return bool(self.calls or self.errors)


def parse_turn(ids: Sequence[int], registry: ToolRegistry, tokenizer: Tokenizer) -> ParsedTurn:
  """Parses one assistant generation (token ids) into validated calls and structured errors."""
  try:
    msg = parse_assistant(list(ids), tokenizer=tokenizer)
  except (ValueError, TypeError, OverflowError) as e:  # e.g. ids outside the vocabulary
    err = ToolError("malformed_call", f"cannot decode the turn: {e}")
    return ParsedTurn("", (), (err,), {"role": "assistant", "content": ""})
  calls, errors = [], []
  for raw in msg.get("tool_calls", []):
    fn = raw["function"]
    result = validate_call(raw["id"], fn["name"], fn["arguments"], registry)
    (errors if isinstance(result, ToolError) else calls).append(result)
  if msg.get("tool_call_error"):
    errors.append(ToolError("malformed_call", msg["tool_call_error"]))
  clean = {"role": "assistant", "content": msg.get("content", "")}
  if msg.get("tool_calls"):
    clean["tool_calls"] = msg["tool_calls"]
  return ParsedTurn(clean["content"], tuple(calls), tuple(errors), clean)


def parse_openai_calls(tool_calls: Any, registry: ToolRegistry) -> tuple[list[ToolCall], list[ToolError]]:
  """The same validation for OpenAI `message.tool_calls` (what an HTTP chat endpoint returns)."""
  calls, errors = [], []
  if not isinstance(tool_calls, list):
    return [], ([ToolError("malformed_call", "tool_calls is not a list")] if tool_calls else [])
  for i, raw in enumerate(tool_calls):
    fn = raw.get("function") if isinstance(raw, dict) else None
    call_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      errors.append(ToolError("malformed_call", f"tool_calls[{i}] has no function.name", call_id or NO_CALL_ID))
      continue
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
      args = json.dumps(args)
    result = validate_call(call_id or f"functions.{fn['name']}:{i}", fn["name"], args, registry)
    (errors if isinstance(result, ToolError) else calls).append(result)
  return calls, errors


def validate_call(call_id: str, name: str, arguments: str, registry: ToolRegistry) -> ToolCall | ToolError:
  """A ToolCall when `name` is registered and `arguments` is a JSON object its schema accepts."""
  if name not in registry:
    known = ", ".join(registry.names[:20])
    return ToolError("unknown_tool", f"no tool named {name!r}; available: {known}", call_id, name)
  try:
    args = json.loads(arguments)
  except (ValueError, RecursionError) as e:
    return ToolError("malformed_json", f"arguments are not valid JSON: {e}"[:300], call_id, name)
  if not isinstance(args, dict):
    return ToolError("bad_arguments", f"arguments must be a JSON object, got {type(args).__name__}", call_id, name)
  try:
    error = jsonschema.exceptions.best_match(registry.validator(name).iter_errors(args))
  except RecursionError:
    return ToolError("bad_arguments", "arguments nest too deeply", call_id, name)
  if error is not None:
    path = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return ToolError("bad_arguments", f"{path}: {error.message}"[:300], call_id, name)
  return ToolCall(call_id, name, args)
