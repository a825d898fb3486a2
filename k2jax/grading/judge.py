"""LLM-as-judge through any OpenAI-compatible `/v1/chat/completions` endpoint (SGLang, vLLM, k2jax serve).

The judge is a `k2jax.llm_client.ChatClient` (build it with temperature 0 for reproducible verdicts).
"""

from __future__ import annotations

import re

from k2jax.llm_client import ChatClient
from k2jax.grading.base import RewardResult

_SCORE = re.compile(r"SCORE:\s*(\d+(?:\.\d+)?)\s*/\s*10", re.IGNORECASE)

JUDGE_TEMPLATE = """You grade a response against criteria.
[Prompt]
{prompt}
[Response]
{response}
[Criteria]
{criteria}
Explain briefly, then end with a line "SCORE: n/10" where n is 0..10."""


def llm_judge_reward(judge: ChatClient, prompt: str, response: str, criteria: str) -> RewardResult:
  """Score/10 from the judge's last "SCORE: n/10" line; 0 with the reason when the verdict is missing."""
  reply = judge.text(
    [{"role": "user", "content": JUDGE_TEMPLATE.format(prompt=prompt, response=response, criteria=criteria)}]
  )
  found = _SCORE.findall(reply)
  if not found:
    return RewardResult(0.0, "judge gave no 'SCORE: n/10' verdict", {"reply": reply[:500]})
  score = min(max(float(found[-1]), 0.0), 10.0) / 10.0
  return RewardResult(score, f"judge score {found[-1]}/10", {"reply": reply[:500]})
