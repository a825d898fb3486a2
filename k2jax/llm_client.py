"""The one OpenAI-compatible chat client: knowledge rephrasing, agentic data synthesis and the RL judge.

Any `/v1/chat/completions` endpoint works (the k2jax server, SGLang, vLLM, a hosted API). Built on the
`openai` package, whose client retries connection errors, timeouts and 408/409/429/5xx answers with
exponential backoff (honouring `Retry-After`) and is safe to share between threads; this module adds a
concurrency limit and maps failures onto k2jax's transport errors, so callers see the same
`ServiceError` family whether an engine, an environment service or an LLM endpoint failed:
  RequestRejected    4xx other than 408/409/429 (retrying the same request cannot help)
  ServiceUnreachable no answer after the retries (connection refused, timeouts, 5xx)
  InvalidResponse    an answer without a first choice's message
It lives below `data/` (rephrasing and synthesis use it) and `rl/` (the judge), beside `transport`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

from k2jax.transport import InvalidResponse, RequestRejected, ServiceUnreachable


@dataclasses.dataclass(frozen=True)
class ChatConfig:
  url: str  # server root or its .../v1
  model: str = "default"
  api_key: str | None = None  # sent as a Bearer token
  temperature: float = 0.7
  max_tokens: int = 512
  timeout_s: float = 120.0  # per attempt
  max_retries: int = 3  # attempts = 1 + max_retries (the openai client's backoff: 0.5 s doubling to 8 s)
  concurrency: int = 8  # requests in flight from one client

  def __post_init__(self):
    if not self.url.startswith(("http://", "https://")):
      raise ValueError(f"ChatConfig.url must start with http:// or https://, got {self.url!r}")
    if self.max_retries < 0 or self.concurrency < 1 or self.timeout_s <= 0:
      raise ValueError(f"ChatConfig needs max_retries >= 0, concurrency >= 1, timeout_s > 0; got {self}")


class ChatClient:
  """Thread-safe; `chat` returns the first choice's message, `text` its content."""

  def __init__(self, config: ChatConfig):
    self.config = config
    root = config.url.rstrip("/")
    self.base_url = root if root.endswith("/v1") else f"{root}/v1"
    # Imported when a client is made: the package takes ~0.9 s to import (`python -X importtime`), a third
    # of every launcher's start-up, and most runs never make one.
    import openai  # noqa: PLC0415

    self._client = openai.OpenAI(
      base_url=self.base_url,
      api_key=config.api_key or "EMPTY",  # the client insists on a key; local servers ignore it
      max_retries=config.max_retries,
      timeout=config.timeout_s,
    )
    self._slots = threading.BoundedSemaphore(config.concurrency)

  def chat(
    self,
    messages: Sequence[dict],
    *,
    tools: Sequence[dict] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
  ) -> dict:
    """The first choice's message as a dict: `role`, `content` (may be None) and maybe `tool_calls`."""
    import openai  # noqa: PLC0415 (loaded by __init__)

    extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
    url = f"{self.base_url}/chat/completions"
    try:
      with self._slots:
        resp = self._client.chat.completions.create(
          model=self.config.model,
          messages=list(messages),
          temperature=self.config.temperature if temperature is None else temperature,
          max_tokens=max_tokens or self.config.max_tokens,
          **extra,
        )
    except openai.APIStatusError as e:
      error = RequestRejected if e.status_code < 500 and e.status_code not in (408, 409, 429) else ServiceUnreachable
      raise error(f"{url}: HTTP {e.status_code} after {self.config.max_retries} retries: {e.message}") from e
    except openai.APIConnectionError as e:  # includes timeouts
      raise ServiceUnreachable(
        f"{url}: no answer after {1 + self.config.max_retries} attempts "
        f"(timeout {self.config.timeout_s}s per attempt): {e!r}"
      ) from e
    except openai.APIResponseValidationError as e:
      raise InvalidResponse(f"{url}: invalid response: {e}") from e
    choices = getattr(resp, "choices", None)
    message = getattr(choices[0], "message", None) if choices else None
    if message is None:
      raise InvalidResponse(f"{url}: answer without choices[0].message: {str(resp)[:200]}")
    out = message.model_dump(exclude_none=True)
    out.setdefault("content", None)
    return out

  def text(self, messages: Sequence[dict], *, max_tokens: int | None = None, temperature: float | None = None) -> str:
    """The first choice's text content ("" when the model said nothing)."""
    content = self.chat(messages, max_tokens=max_tokens, temperature=temperature)["content"]
    if content is not None and not isinstance(content, str):
      raise InvalidResponse(f"{self.base_url}: choices[0].message.content is {type(content).__name__}, not text")
    return content or ""

  def close(self) -> None:
    self._client.close()
