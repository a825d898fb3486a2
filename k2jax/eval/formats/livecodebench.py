"""LiveCodeBench `code_generation_lite` rows (the JSONL files test.jsonl .. test6.jsonl of
livecodebench/code_generation_lite) as the runner's own format, graded by `k2jax.sandbox.verify`, which reads
their `public_test_cases` / `private_test_cases` (JSON, or base64 + zlib + pickle of JSON) and `metadata`
(`func_name` of call-based problems) itself.

  livecodebench                   every row: question_title, question_content, platform, question_id,
                                  contest_date (ISO), starter_code, difficulty, public_test_cases,
                                  private_test_cases, metadata
  livecodebench@START..END        only rows whose contest_date falls in [START, END] (ISO dates, either side
                                  may be empty: `livecodebench@2024-08-01..` is "from August 2024"), as
                                  LiveCodeBench's --start_date / --end_date pick a release's window (dates
                                  only: launch/eval.py's `--tasks=FORMAT:PATH` splits at the first colon)

The prompt is LiveCodeBench's generation prompt (lcb_runner/prompts/code_generation.py): its system
instruction, the question, then the starter-code format (call-based problems, LeetCode's `class Solution`)
or the stdin format; the code of the response's last ``` block is graded, pass@1 = all cases pass.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from k2jax.eval.records import Doc, SkipRecord, TaskFormat, record_id, str_field
from k2jax.eval.verdict import UNGRADABLE, Verdict
from k2jax.sandbox.code import CodeRewardConfig, extract_code
from k2jax.sandbox.formats import parse_row
from k2jax.sandbox.verify import is_infra_error, verify

SYSTEM = (
  "You are an expert Python programmer. You will be given a question (problem specification) and will generate "
  "a correct Python program that matches the specification and passes all tests."
)
WITH_STARTER = (
  "You will use the following starter code to write the solution to the problem and enclose your code within "
  "delimiters."
)
WITHOUT_STARTER = (
  "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test on the "
  "sample inputs). Enclose your code within delimiters as follows. Ensure that when the python program runs, it "
  "reads the inputs, runs the algorithm and writes output to STDOUT."
)
_TEST_FIELDS = ("public_test_cases", "private_test_cases", "metadata")


def prompt(question: str, starter_code: str) -> str:
  """LiveCodeBench's user prompt (its system instruction first) for a stdin or a starter-code problem."""
  if starter_code.strip():
    fmt = f"### Format: {WITH_STARTER}\n```python\n{starter_code}\n```\n\n"
  else:
    fmt = f"### Format: {WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"
  return f"{SYSTEM}\n\n### Question:\n{question}\n\n{fmt}### Answer: (use the provided format with backticks)\n\n"


def parser(start: datetime.date | None = None, end: datetime.date | None = None):
  def parse(r: Mapping[str, Any], i: int) -> Doc:
    day = _date(str_field(r, "contest_date"))
    if (start and day < start) or (end and day > end):
      raise SkipRecord
    question, starter = str_field(r, "question_content"), str_field(r, "starter_code")
    str_field(r, "platform")
    tests = {k: r[k] for k in _TEST_FIELDS if k in r}
    parse_row(tests)  # the verifier reads these tests: a malformed one fails the read (ValueError names it)
    data = {"tests": tests, "platform": r["platform"], "contest_date": day.isoformat()}
    return Doc(record_id(r, ("question_id",), i), prompt(question, starter), "", data)

  return parse


def grade(doc: Doc, text: str, code: CodeRewardConfig) -> Verdict:
  config = dataclasses.replace(code, stop_at_first_failure=True)  # pass@1: every case passes
  try:
    graded = verify(extract_code(text), doc.data["tests"], config)
  except ValueError as e:
    return Verdict(0.0, None, f"{UNGRADABLE}{e}")
  if is_infra_error(graded):
    raise RuntimeError(f"eval: the code sandbox could not run: {graded.info['infra_error']}")
  timed_out = graded.reward < 1.0 and "timed out after" in graded.reason  # a case ran past its time: graded again
  return Verdict(float(graded.reward >= 1.0), None, graded.reason, timed_out=timed_out)


def windowed(arg: str) -> TaskFormat:
  """The format `livecodebench@START..END`; ValueError naming the bad date."""
  head, sep, tail = arg.partition("..")
  if not sep:
    raise ValueError(f"livecodebench@{arg}: expected livecodebench@START..END (ISO dates, either may be empty)")
  start, end = (_date(x, f"livecodebench@{arg}") if x else None for x in (head, tail))
  return TaskFormat(f"livecodebench@{arg}", "generate", parser(start, end), grade=grade)


def _date(text: str, where: str = "field 'contest_date'") -> datetime.date:
  try:
    return datetime.datetime.fromisoformat(text.strip()).date()
  except ValueError:
    raise ValueError(f"{where}: {text!r} is not an ISO date (2024-08-01 or 2024-08-01T00:00:00)") from None


FORMATS = (TaskFormat("livecodebench", "generate", parser(), grade=grade),)
PARAMETRIZED = {"livecodebench": windowed}  # name@ARG -> a TaskFormat
