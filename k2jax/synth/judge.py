"""Stage (e): an LLM judge scores each trajectory against its task rubric; only trajectories that meet
the success criteria become SFT records (K2 §3.1.1 large-scale rejection sampling). A kept record is
`{"id", "messages", "tools"}`, checked with `k2jax.data.chat.normalize_messages` before it is written,
so `k2jax.data.sft` can read every line."""

from __future__ import annotations

import json

from k2jax.data.chat import ChatFormatError, normalize_messages
from k2jax.synth.llm import LLM

JUDGE_PROMPT = """ROLE: judge
You grade an AI agent's conversation against the task rubric. Check every success criterion and
checkpoint and whether tools were used as expected (an agent may reach the goal in another valid way).
Answer with JSON {"passed": true|false, "score": 0-10, "reason": one sentence}."""


def judge(llm: LLM, trajectory: dict, min_score: float) -> dict:
  """The SFT record when the judge passes the trajectory; raises InvalidOutput otherwise."""
  transcript = [
    {k: m[k] for k in ("role", "content", "tool_calls", "name") if m.get(k)} for m in trajectory["messages"]
  ]
  value = llm.json(
    [
      {"role": "system", "content": JUDGE_PROMPT},
      {
        "role": "user",
        "content": json.dumps(
          {
            "task": trajectory["task"]["instruction"],
            "rubric": trajectory["task"]["rubric"],
            "conversation": transcript,
          },
          ensure_ascii=False,
        ),
      },
    ],
    role="judge",
  )
  if not isinstance(value, dict) or not isinstance(value.get("passed"), bool):
    raise llm.invalid("judge", "expected JSON {passed: bool, score, reason}")
  score = value.get("score")
  score = float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else 0.0
  if not value["passed"] or score < min_score:
    raise llm.invalid("judge_rejected", f"failed the rubric (score {score}): {str(value.get('reason'))[:200]}")
  try:
    normalize_messages(trajectory["messages"], trajectory["tools"])
  except ChatFormatError as e:
    raise llm.invalid("sft_format", str(e)) from None
  return {
    "messages": trajectory["messages"],
    "tools": trajectory["tools"],
    "judge_score": score,
    "judge_reason": str(value.get("reason", ""))[:500],
  }
