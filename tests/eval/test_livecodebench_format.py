"""LiveCodeBench code_generation_lite rows: LiveCodeBench's prompts, a contest-date window, the verifier's verdict
on the public and (encoded) private cases; a bad row or window names the problem."""

import pytest

from k2jax.eval import TaskFormatError, load_docs
from k2jax.eval.grading import grade
from k2jax.sandbox.code import CodeRewardConfig

from .benchmark_rows import LIVECODEBENCH
from .conftest import write_jsonl

STDIN_OK = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
STDIN_PUBLIC_ONLY = "```python\nprint(3)\n```"  # passes the public case, fails the private one
CALL_OK = "```python\nclass Solution:\n    def maxOf(self, nums):\n        return max(nums)\n```"


def test_prompts_window_and_verdicts(tmp_path):
  path = write_jsonl(tmp_path / "test5.jsonl", LIVECODEBENCH)
  stdin, call = load_docs(path, "livecodebench")
  assert "### Format: Read the inputs from stdin" in stdin.prompt and "# YOUR CODE HERE" in stdin.prompt
  assert "use the following starter code" in call.prompt and "def maxOf(self" in call.prompt
  assert stdin.prompt.startswith("You are an expert Python programmer.") and stdin.data["platform"] == "atcoder"
  (late,) = load_docs(path, "livecodebench@2024-08-01..")
  (early,) = load_docs(path, "livecodebench@..2024-01-01")
  assert (late.doc_id, early.doc_id) == ("abc999_a", "9001")
  with pytest.raises(TaskFormatError, match=r"no records"):
    load_docs(path, "livecodebench@2025-01-01..2025-02-01")
  with pytest.raises(TaskFormatError, match=r"'2024-13-01' is not an ISO date"):
    load_docs(path, "livecodebench@2024-13-01..")
  code = CodeRewardConfig()
  assert grade("livecodebench", "lcb", stdin, STDIN_OK, "stop", code).score == 1.0
  assert grade("livecodebench", "lcb", stdin, STDIN_PUBLIC_ONLY, "stop", code).score == 0.0
  assert grade("livecodebench", "lcb", call, CALL_OK, "stop", code).score == 1.0
  assert grade("livecodebench", "lcb", call, "```python\nclass Solution: pass\n```", "stop", code).score == 0.0


def test_bad_rows_name_file_line_and_field(tmp_path):
  bad = dict(LIVECODEBENCH[0], private_test_cases="not base64 !!")
  with pytest.raises(TaskFormatError, match=r"x.jsonl:2: .*field 'private_test_cases'"):
    load_docs(write_jsonl(tmp_path / "x.jsonl", [LIVECODEBENCH[1], bad]), "livecodebench")
  bad = dict(LIVECODEBENCH[0], contest_date="last week")
  with pytest.raises(TaskFormatError, match=r"y.jsonl:1: .*field 'contest_date': 'last week' is not an ISO date"):
    load_docs(write_jsonl(tmp_path / "y.jsonl", [bad]), "livecodebench")
