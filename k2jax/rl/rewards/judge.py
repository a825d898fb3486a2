"""LLM-as-judge through any OpenAI-compatible `/v1/chat/completions` endpoint (SGLang, vLLM, k2jax serve).

Uses the shared JSON transport (timeouts, retries, URL in every error) rather than the `openai` package,
which is not a runtime dependency of k2jax; the request is the standard chat-completions body.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from k2jax.rl.rewards.base import RewardResult
from k2jax.transport import RetryPolicy, call_json


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
  url: str  # server root, e.g. http://127.0.0.1:30000
  model: str = "default"
  temperature: float = 0.0
  max_tokens: int = 512
  timeout_s: float = 120.0
  retry: RetryPolicy = RetryPolicy()
  api_key: str | None = None


class JudgeClient:
  """Thread-safe chat client; `chat` returns the first choice's message content."""

  def __init__(self, config: JudgeConfig):
    self.config = config
    self._url = config.url.rstrip("/") + "/v1/chat/completions"
    self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

  def chat(self, messages: Sequence[dict[str, str]]) -> str:
    payload = {
      "model": self.config.model,
      "messages": list(messages),
      "temperature": self.config.temperature,
      "max_tokens": self.config.max_tokens,
    }
    return call_json(
      self._url,
      payload,
      timeout_s=self.config.timeout_s,
      retry=self.config.retry,
      headers=self._headers,
      validate=_first_content,
    )


def _first_content(body: Any) -> str:
  content = body["choices"][0]["message"]["content"]
  if not isinstance(content, str):
    raise TypeError(f"choices[0].message.content is {type(content).__name__}, not a string")
  return content


_SCORE = re.compile(r"SCORE:\s*(\d+(?:\.\d+)?)\s*/\s*10", re.IGNORECASE)

JUDGE_TEMPLATE = """You grade a response against criteria.
[Prompt]
{prompt}
[Response]
{response}
[Criteria]
{criteria}
Explain briefly, then end with a line "SCORE: n/10" where n is 0..10."""


def llm_judge_reward(judge: JudgeClient, prompt: str, response: str, criteria: str) -> RewardResult:
  """Score/10 from the judge's last "SCORE: n/10" line; 0 with the reason when the verdict is missing."""
  reply = judge.chat(
    [{"role": "user", "content": JUDGE_TEMPLATE.format(prompt=prompt, response=response, criteria=criteria)}]
  )
  found = _SCORE.findall(reply)
  if not found:
    return RewardResult(0.0, "judge gave no 'SCORE: n/10' verdict", {"reply": reply[:500]})
  score = min(max(float(found[-1]), 0.0), 10.0) / 10.0
  return RewardResult(score, f"judge score {found[-1]}/10", {"reply": reply[:500]})
