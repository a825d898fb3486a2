"""A generated sample's record: the fields its verdict gives it, a second grading of a stored sample whose
grading timed out (from its text: nothing is generated again), and the check that every prompt leaves the
engine room to answer, made before any request."""

from __future__ import annotations

from collections.abc import Mapping

from k2jax.eval.grading import grade
from k2jax.eval.records import Doc, TaskFormat, TaskFormatError
from k2jax.eval.verdict import Verdict
from k2jax.sandbox.code import CodeRewardConfig

# What a sample record holds of its generation (the rest is its verdict's, made again by a regrade).
GENERATED = ("task", "doc_id", "sample", "fingerprint", "seed", "prompt_tokens", "completion_tokens", "finish_reason")
GENERATED += ("text",)


class PromptTooLong(TaskFormatError):
  """A doc whose prompt leaves the engine no room to answer: named before anything is sent."""


def redo(rec: Mapping | None) -> bool:
  """Whether a stored sample is to be made (again): absent, or its grading timed out."""
  return rec is None or bool(rec.get("timed_out"))


def verdict_fields(verdict: Verdict) -> dict:
  out = {"score": verdict.score, "answer": verdict.answer, "reason": verdict.reason}
  out.update(verdict.extra)  # a format's own fields (IFEval: each instruction's strict / loose verdict)
  if verdict.timed_out:
    out["timed_out"] = True
  return out


def regrade(task: str, fmt: TaskFormat, doc: Doc, rec: Mapping, code: CodeRewardConfig) -> dict:
  """A stored sample whose grading timed out, graded again from its text."""
  kept = {k: rec[k] for k in GENERATED if k in rec}
  verdict = grade(fmt.name, task, doc, rec["text"], rec["finish_reason"], code)
  return {**kept, **verdict_fields(verdict)}


def check_lengths(spec, prompts: Mapping[str, list[int]], docs: Mapping[str, Doc], max_len: int | None, where: str):
  """Every prompt must leave the engine (its max_seq_len: the embedded engine's, a server's /get_model_info)
  room for a token: else an error naming the task file, line and doc, before any request (a server would
  refuse each one, and a retried refusal is no answer)."""
  if max_len is None:
    return
  for doc_id, ids in prompts.items():
    if len(ids) >= max_len:
      raise PromptTooLong(
        f"{spec.path}:{docs[doc_id].line}: task {spec.name} doc {doc_id}: the prompt is {len(ids)} tokens; the "
        f"engine at {where} takes at most {max_len} tokens of prompt and answer (leave the row out, or serve a "
        "longer context)"
      )
