"""What every synthesis role asks of an LLM: JSON or text answers, with invalid outputs counted.

Transport is `k2jax.llm_client.ChatClient` (any OpenAI-compatible endpoint, retries with backoff, a
concurrency limit). Invalid outputs (no JSON where JSON was asked for, wrong fields) are expected from
weak models; the caller counts and drops them (`InvalidOutput`), never crashes. Transport failures
that survive the retries raise `ServiceError`: the unit is left undone and a rerun resumes it.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any, Sequence

from k2jax.llm_client import ChatClient, ChatConfig


class InvalidOutput(ValueError):
  """The model answered, but not with what the role needs; `.kind` names the role/check."""

  def __init__(self, kind: str, message: str):
    super().__init__(f"{kind}: {message}")
    self.kind = kind


class LLM:
  """A `ChatClient` with per-role counters of calls and invalid outputs (`counts`)."""

  def __init__(self, config: ChatConfig):
    self.config = config
    self._client = ChatClient(config)
    self._lock = threading.Lock()
    self.counts: collections.Counter = collections.Counter()

  def chat(
    self,
    messages: Sequence[dict],
    *,
    tools: Sequence[dict] | None = None,
    max_tokens: int | None = None,
    role: str = "llm",
  ) -> dict:
    """The first choice's message (`content`, maybe `tool_calls`)."""
    self._count(f"calls.{role}")
    return self._client.chat(messages, tools=tools, max_tokens=max_tokens)

  def text(self, messages: Sequence[dict], *, role: str, max_tokens: int | None = None) -> str:
    content = (self.chat(messages, max_tokens=max_tokens, role=role).get("content") or "").strip()
    if not content:
      raise self.invalid(role, "empty answer")
    return content

  def json(self, messages: Sequence[dict], *, role: str, max_tokens: int | None = None) -> Any:
    """The first JSON value (object or array) in the answer."""
    text = self.text(messages, role=role, max_tokens=max_tokens)
    value = extract_json(text)
    if value is None:
      raise self.invalid(role, f"no JSON in answer {text[:120]!r}")
    return value

  def invalid(self, role: str, message: str) -> InvalidOutput:
    self._count(f"invalid.{role}")
    return InvalidOutput(role, message)

  def _count(self, key: str) -> None:
    with self._lock:
      self.counts[key] += 1


def extract_json(text: str) -> Any | None:
  """The first decodable JSON object/array in `text` (models wrap JSON in prose or code fences)."""
  decoder = json.JSONDecoder()
  for i, ch in enumerate(text):
    if ch in "{[":
      try:
        return decoder.raw_decode(text, i)[0]
      except (ValueError, RecursionError):
        continue
  return None
