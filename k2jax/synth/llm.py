"""The LLM client every synthesis role uses: any OpenAI-compatible `/v1/chat/completions` endpoint
(the embedded k2jax server, SGLang, vLLM, a hosted API), with a concurrency limit, retries with
backoff (`k2jax.rl.transport`), and counters of calls and invalid outputs.

Invalid outputs (no JSON where JSON was asked for, wrong fields) are expected from weak models; the
caller counts and drops them (`InvalidOutput`), never crashes. Transport failures that survive the
retries raise `ServiceError`: the unit is left undone and a rerun resumes it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any, Sequence

from k2jax.rl.transport import RetryPolicy, call_json


class InvalidOutput(ValueError):
  """The model answered, but not with what the role needs; `.kind` names the role/check."""

  def __init__(self, kind: str, message: str):
    super().__init__(f"{kind}: {message}")
    self.kind = kind


@dataclasses.dataclass(frozen=True)
class LLMConfig:
  url: str  # server root or .../v1
  model: str = "default"
  api_key: str | None = None
  temperature: float = 0.7
  max_tokens: int = 512
  timeout_s: float = 120.0
  concurrency: int = 8  # requests in flight to this endpoint
  retry: RetryPolicy = RetryPolicy(max_retries=3)

  def __post_init__(self):
    if not self.url.startswith(("http://", "https://")):
      raise ValueError(f"LLMConfig.url must start with http:// or https://, got {self.url!r}")


class LLM:
  def __init__(self, config: LLMConfig):
    self.config = config
    root = config.url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    self._url = f"{root}/v1/chat/completions"
    self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    self._slots = threading.BoundedSemaphore(config.concurrency)
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
    body = {
      "model": self.config.model,
      "messages": list(messages),
      "temperature": self.config.temperature,
      "max_tokens": max_tokens or self.config.max_tokens,
    }
    if tools:
      body["tools"] = list(tools)
    self._count(f"calls.{role}")
    with self._slots:
      return call_json(
        self._url,
        body,
        timeout_s=self.config.timeout_s,
        retry=self.config.retry,
        headers=self._headers,
        validate=_first_message,
      )

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


def _first_message(body: Any) -> dict:
  message = body["choices"][0]["message"]
  if not isinstance(message, dict):
    raise TypeError(f"choices[0].message is {type(message).__name__}, not an object")
  return message
