"""Grading one generated sample of a task: a score in [0, 1] (1 = correct), the answer maj@k votes on, a reason.

Graders reuse the RL rewards: `\\boxed{}` extraction and equivalence of `grading/math.py`, the code verifier
`k2jax.sandbox.verify` (HumanEval, MBPP) and `make_reward` for `answer.KIND` tasks; swe episodes are graded
by `k2jax.swe.grade` in `swe.py` (a `Verdict` too). HumanEval's `check(candidate)`
and MBPP's asserts (after `test_setup_code`) run as trusted code in a sandbox of their own, calling the program,
which runs in another, through plain data: the program's exit status decides nothing (`os._exit(0)` fails), and
neither can it reach the test's process. A sandbox that cannot start raises (an eval score with holes in it is
not a score); a test the verifier cannot read is `ungradable`.
"""

from __future__ import annotations

import re

from k2jax.eval.records import Doc, canonical_number
from k2jax.eval.tasks import get_format
from k2jax.eval.verdict import UNGRADABLE, Verdict, math_timed_out
from k2jax.grading.base import Completion, Prompt
from k2jax.grading.contract import RewardConfig, make_reward
from k2jax.grading.math import equivalent, extract_boxed
from k2jax.sandbox.code import CodeRewardConfig, extract_code
from k2jax.sandbox.verify import is_infra_error, verify

CASE_TIMEOUT = "timed out after"  # a code case's failure when it ran past its time (k2jax.sandbox.verify)


def grade(fmt: str, task: str, doc: Doc, text: str, finish_reason: str, code: CodeRewardConfig) -> Verdict:
  """The verdict on `text`, the model's response to `doc` of format `fmt`."""
  if fmt == "gsm8k":
    return _gsm8k(doc, text)
  if fmt == "math":
    return _math(doc, text)
  if fmt == "humaneval":
    return _humaneval(doc, text, code)
  if fmt == "mbpp":
    return _mbpp(doc, text, code)
  if fmt.startswith("answer."):
    return _reward(fmt.split(".", 1)[1], task, doc, text, finish_reason, code)
  if fmt == "swe":  # a patch left in a workspace, not a text: k2jax.eval.swe grades the episode
    raise ValueError("task format 'swe' is graded by its episode (k2jax.eval.swe.sample), not from a text")
  own = get_format(fmt).grade  # the benchmark formats of formats/ grade their own docs
  if own is None:
    raise ValueError(f"no grader for task format {fmt!r}")
  return own(doc, text, code)


def _gsm8k(doc: Doc, text: str) -> Verdict:
  # lm-eval's two extractions: the number after '####' when the model wrote one, else the last number.
  tail = text.rsplit("####", 1)[1] if "####" in text else None
  got = canonical_number(tail) if tail is not None else _last_number(text)
  if got is None:
    return Verdict(0.0, None, "no number in the response")
  want = doc.data["answer"]
  return Verdict(float(got == want), got, "correct" if got == want else f"{got} != {want}")


def _math(doc: Doc, text: str) -> Verdict:
  got = extract_boxed(text)
  if got is None:
    return Verdict(0.0, None, "no \\boxed{} answer")
  try:
    ok, why = equivalent(got, str(doc.data["answer"]))
  except ValueError as e:  # a reference math-verify cannot read: the same for every sample
    return Verdict(0.0, None, f"{UNGRADABLE}{e}")
  return Verdict(float(ok), got, why, timed_out=math_timed_out(why))  # maj@k groups by the format's `same`


def _humaneval(doc: Doc, text: str, config: CodeRewardConfig) -> Verdict:
  prompt, entry = doc.data["prompt"], doc.data["entry_point"]
  body = extract_code(text) if "```" in text else text
  # A chat answer restates the whole function: define it after the prompt (whose imports it may need).
  program = f"{prompt}\n{body}" if re.search(rf"^def {re.escape(entry)}\s*\(", body, re.MULTILINE) else prompt + body
  return _verified(program, {"prompt": prompt, "test": doc.data["test"], "entry_point": entry}, config)


def _mbpp(doc: Doc, text: str, config: CodeRewardConfig) -> Verdict:
  row = {"test_list": list(doc.data["tests"]), "test_setup_code": doc.data["setup"]}
  return _verified(extract_code(text), row, config)


def _verified(program: str, row: dict, config: CodeRewardConfig) -> Verdict:
  try:
    graded = verify(program, row, config)
  except ValueError as e:  # a test the verifier cannot read: the same for every sample
    return Verdict(0.0, None, f"{UNGRADABLE}{e}")
  if is_infra_error(graded):
    raise RuntimeError(f"eval: the code sandbox could not run: {graded.info['infra_error']}")
  return Verdict(graded.reward, None, graded.reason, timed_out=graded.reward < 1 and CASE_TIMEOUT in graded.reason)


def _reward(kind: str, task: str, doc: Doc, text: str, finish_reason: str, code: CodeRewardConfig) -> Verdict:
  fn = make_reward(kind, RewardConfig(code=code))
  prompt = Prompt(doc.doc_id, task, (), text=doc.prompt, data=doc.data)
  try:
    (result,) = fn(prompt, [Completion((), text, finish_reason, truncated=False)])
  except ValueError as e:  # e.g. a code test the splitter refuses
    return Verdict(0.0, None, f"{UNGRADABLE}{e}")
  if result.info.get("infra_error"):
    raise RuntimeError(f"eval: the {kind} grader could not grade: {result.info['infra_error']}")
  answer = None
  if kind == "exact":
    answer = text.strip()
  elif kind == "math" and result.info.get("extracted") is not None:
    answer = str(result.info["extracted"]).strip()
  timed_out = math_timed_out(result.reason) if kind == "math" else result.reward < 1 and CASE_TIMEOUT in result.reason
  return Verdict(float(result.reward), answer, result.reason, timed_out=timed_out)


def _last_number(text: str) -> str | None:
  found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
  return canonical_number(found[-1]) if found else None
