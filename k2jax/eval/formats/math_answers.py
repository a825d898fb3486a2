"""AIME 2024/2025 and MATH-500 as their dataset repositories ship them, graded by the RL math reward.

  aime     problem (or Problem, question), answer (or Answer): an integer 0..999, as a string or a number;
           id (or ID) optional. The files of HuggingFaceH4/aime_2024 (parquet: id, problem, solution,
           answer, url, year), Maxwell-Jia/AIME_2024 (ID, Problem, Solution, Answer) and the AIME 2025
           releases (opencompass/AIME2025: question, answer; math-ai/aime25: problem, answer, id).
  math500  problem, solution, answer, subject, level, unique_id (HuggingFaceH4/MATH-500's test.jsonl).

The prompt is the problem followed by the reasoning instruction of the DeepSeek-R1 / Qwen math evaluations
("Please reason step by step, and put your final answer within \\boxed{}."), for chat models as K2 reports
them; the verdict is `k2jax.grading.math.math_reward` on the response (the last `\\boxed{}` against the
answer: the one math grader of RL and evaluation, math-verify), and maj@k votes on the extracted answers'
classes under that grader (`same_answer`: `\\frac12` and `0.5` are one answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k2jax.eval.records import Doc, TaskFormat, first_field, record_id, str_field
from k2jax.eval.verdict import Verdict, math_timed_out
from k2jax.grading.base import Completion, Prompt
from k2jax.grading.math import GRADER_VERSION, math_reward, same_answer

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def parse_aime(r: Mapping[str, Any], i: int) -> Doc:
  problem = str_field(r, first_field(r, ("problem", "Problem", "question")))
  key = first_field(r, ("answer", "Answer"))
  answer = _aime_answer(r[key], key)
  doc_id = record_id(r, ("id", "ID"), i)
  return Doc(doc_id, f"{problem}\n\n{INSTRUCTION}", f" The answer is $\\boxed{{{answer}}}$.", {"answer": answer})


def parse_math500(r: Mapping[str, Any], i: int) -> Doc:
  problem, answer = str_field(r, "problem"), str_field(r, "answer")
  if not answer.strip():
    raise ValueError("field 'answer' is empty")
  solution = str_field(r, "solution") if "solution" in r else f"The answer is $\\boxed{{{answer}}}$."
  data = {"answer": answer, **{k: r[k] for k in ("subject", "level") if k in r}}
  return Doc(record_id(r, ("unique_id",), i), f"{problem}\n\n{INSTRUCTION}", f" {solution}", data)


def grade_math(doc: Doc, text: str, code: Any = None) -> Verdict:
  """The RL math reward's verdict; the extracted answer (maj@k's vote) as it was written, stripped."""
  prompt = Prompt(doc.doc_id, "math", (), text=doc.prompt, data={"answer": doc.data["answer"]})
  result = math_reward(prompt, Completion((), text, "stop", truncated=False))
  extracted = result.info.get("extracted") if result.info else None
  answer = None if extracted is None else str(extracted).strip()
  return Verdict(float(result.reward), answer, result.reason, timed_out=math_timed_out(result.reason))


def _aime_answer(value: Any, key: str) -> str:
  if isinstance(value, bool) or not isinstance(value, (int, str)):
    raise TypeError(f"field '{key}' must be an integer (or its string), got {type(value).__name__}")
  text = str(value).strip()
  if not text.isdigit() or not 0 <= int(text) <= 999:
    raise ValueError(f"field '{key}' must be an AIME answer, an integer 0..999, got {value!r}")
  return str(int(text))


FORMATS = (
  TaskFormat("aime", "generate", parse_aime, grade=grade_math, votes=True, same=same_answer, version=GRADER_VERSION),
  TaskFormat(
    "math500", "generate", parse_math500, grade=grade_math, votes=True, same=same_answer, version=GRADER_VERSION
  ),
)
