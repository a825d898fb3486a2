"""EvalPlus HumanEval+ / MBPP+ rows: the canonical solution's outputs (computed in the sandbox) are the expected
ones, base and plus inputs each decide a status, `atol` and EvalPlus's special oracles compare, the runner
reports base_pass@1 beside pass@1 (the plus score); bad rows name file, line and field."""

import pytest

from k2jax.eval import EvalConfig, TaskFormatError, TaskSpec, load_docs, run
from k2jax.eval.formats import evalplus
from k2jax.eval.grading import grade
from k2jax.sandbox.code import CodeRewardConfig

from .benchmark_rows import HUMANEVAL_PLUS, MBPP_PLUS
from .conftest import scripted_model, write_jsonl

CODE = CodeRewardConfig(case_time_s=4.0)

CLOSE_OK = (
  "```python\nfrom typing import List\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
  "    s = sorted(numbers)\n    return any(b - a < threshold for a, b in zip(s, s[1:]))\n```"
)
CLOSE_LE = CLOSE_OK.replace("b - a < threshold", "b - a <= threshold")  # passes the base inputs, not the plus ones
CLOSE_BODY = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])\n"
TRUNC_STR = "```python\ndef truncate_number(number):\n    s = str(number)\n    return float(s[s.index('.'):])\n```"
TRUNC_ROUND = "```python\ndef truncate_number(number):\n    return round(number % 1, 2)\n```"


def _grade(fmt, doc, text):
  return grade(fmt, fmt, doc, text, "stop", CODE)


def test_humaneval_plus_base_and_plus_verdicts(tmp_path):
  close, trunc = load_docs(write_jsonl(tmp_path / "HumanEvalPlus.jsonl", HUMANEVAL_PLUS), "humaneval_plus")
  assert (close.doc_id, trunc.doc_id) == ("HumanEval/0", "HumanEval/2")
  assert close.prompt.startswith(evalplus.INSTRUCTION + "\n```\nfrom typing import List")
  assert close.prompt.endswith('    True\n    """\n```\n')
  assert evalplus.expected_outputs(close, CODE) == [True, False, True, False, True, True, False] + [False] * 4
  v = _grade("humaneval_plus", close, CLOSE_OK)
  assert (v.score, v.extra) == (1.0, {"base_pass": True, "plus_pass": True}), v.reason
  assert v.reason == "base 7/7, plus 4/4 inputs passed"
  v = _grade("humaneval_plus", close, CLOSE_LE)
  assert (v.score, v.extra) == (0.0, {"base_pass": True, "plus_pass": False})
  assert v.reason.startswith("base 7/7, plus 2/4 inputs passed; plus input 0: returned True, expected False")
  assert _grade("humaneval_plus", close, CLOSE_BODY).score == 1.0  # a completion of the prompt's function
  # truncate_number, atol 1e-6: 1.33 - int(1.33) is 0.33000000000000007, str's 0.33 is within it; 1e-05 has no '.'
  v = _grade("humaneval_plus", trunc, TRUNC_STR)
  assert v.extra == {"base_pass": True, "plus_pass": False} and "plus input 3: exit status 1: ValueError" in v.reason
  v = _grade("humaneval_plus", trunc, TRUNC_ROUND)
  assert v.extra["base_pass"] is False and "base input 2: returned 0.46, expected 0.456" in v.reason


def test_mbpp_plus_inputs_special_oracles_and_the_original_code(tmp_path):
  sim, prime, three = load_docs(write_jsonl(tmp_path / "MbppPlus.jsonl", MBPP_PLUS), "mbpp_plus")
  assert sim.data["base_input"][0] == [(3, 4, 5, 6), (5, 7, 4, 10)]  # Mbpp/2 takes tuples (deserialized)
  assert prime.data["plus_input"] == [[1], [7919], [49], [1000003]]  # Mbpp/3 as the file has it
  hashable = "```python\ndef similar_elements(a, b):\n    {a: 0, b: 0}\n    return sorted(set(a) & set(b))\n```"
  v = _grade("mbpp_plus", sim, hashable)  # tuples arrive (a list is unhashable); a set-equal list passes
  assert v.score == 1.0, v.reason
  assert _grade("mbpp_plus", sim, "```python\ndef similar_elements(a, b):\n    return a[:1]\n```").score == 0.0
  # MBPP's own reference code calls 1 a prime: right on the original tests, wrong on EvalPlus's [1]
  v = _grade("mbpp_plus", prime, MBPP_PLUS[1]["code"])
  assert (v.score, v.extra) == (0.0, {"base_pass": True, "plus_pass": False}) and "plus input 0" in v.reason
  assert evalplus.expected_outputs(three, CODE) == [False, False, True, True, False, True, False]  # not None
  assert _grade("mbpp_plus", three, MBPP_PLUS[2]["code"]).score == 1.0  # a re.Match: compared as not None
  assert _grade("mbpp_plus", three, "```python\ndef text_match_three(t):\n    return 'abbb' in t\n```").score == 1.0
  v = _grade("mbpp_plus", three, "```python\nimport re\ndef text_match_three(t):\n    return re.match('ab{3}', t)\n```")
  assert v.extra["base_pass"] is False and "base input 3" in v.reason  # 'caacabbbba': match only at the start


def test_outputs_match_is_evalplus_rule():
  match = evalplus.outputs_match
  assert match("humaneval", "f", [1], 0.1 + 0.2, 0.3, 0.0)  # a float expected: atol 1e-6 enforced
  assert not match("humaneval", "f", [1], 0.3001, 0.3, 0.0)
  assert match("humaneval", "f", [1], [1.0, 2.0000001], [1.0, 2.0], 0.0)
  assert not match("humaneval", "f", [1], (1.0, 2.0000001), [1.0, 2.0], 1e-6)  # the type must match
  assert not match("humaneval", "f", [1], 2, 2.0000001, 1e-6) and match("humaneval", "f", [1], 2.0, 2.0000001, 1e-6)
  assert not match("humaneval", "f", [1], [1, 2], (1, 2), 0.0) and not match("humaneval", "f", [1], "a", 1.0, 1e-6)
  assert match("humaneval", "find_zero", [[-6, 11, -6, 1]], 1.0000000001, 3.0, 1e-4)  # any root of the poly
  assert not match("humaneval", "find_zero", [[-6, 11, -6, 1]], 1.5, 1.0, 1e-4)
  assert match("mbpp", "sum_div", [8], 0, 7, 0.0) and not match("humaneval", "sum_div", [8], 0, 7, 0.0)
  assert match("mbpp", "Diff", [[1], [2]], [2, 1], [1, 2], 0.0) and not match("mbpp", "Diff", [], 3, [3], 0.0)
  assert match("mbpp", "surface_Area", [3, 4], 35, 34, 0.5) and not match("mbpp", "surface_Area", [3, 4], 36, 34, 0.5)


def test_the_runner_reports_base_beside_plus(tmp_path, tok):
  tasks = (
    TaskSpec("he_plus", write_jsonl(tmp_path / "HumanEvalPlus.jsonl", HUMANEVAL_PLUS), "humaneval_plus"),
    TaskSpec("mbpp_plus", write_jsonl(tmp_path / "MbppPlus.jsonl", MBPP_PLUS[1:2]), "mbpp_plus"),
  )

  def respond(prompt, seed):
    if "has_close_elements" in prompt:
      return CLOSE_OK if seed % 2 else CLOSE_LE
    if "truncate_number" in prompt:
      return TRUNC_STR
    return MBPP_PLUS[1]["code"]

  model, _ = scripted_model(tok, respond)
  config = EvalConfig(
    model="scripted", tasks=tasks, out=str(tmp_path / "out"), n=2, ks=(1,), temperature=0.7, code=CODE, progress=False
  )
  report = run(config, model)["tasks"]
  seeds = [s["seed"] % 2 for s in report["he_plus"]["docs"][0]["samples"]]
  he = report["he_plus"]["metrics"]
  assert he["pass@1"] == pytest.approx(sum(seeds) / 2 / 2)  # HumanEval/0: the odd seeds; HumanEval/2: none
  assert he["base_pass@1"] == 1.0  # every sample passes the base inputs
  m = report["mbpp_plus"]["metrics"]
  assert (m["pass@1"], m["base_pass@1"]) == (0.0, 1.0)
  assert report["mbpp_plus"]["docs"][0]["samples"][0]["base_pass"] is True


def test_bad_rows_name_file_line_and_field(tmp_path):
  cases = [
    (dict(HUMANEVAL_PLUS[0], atol="0"), "humaneval_plus", r"field 'atol' must be a number"),
    (
      {k: v for k, v in HUMANEVAL_PLUS[0].items() if k != "plus_input"},
      "humaneval_plus",
      r"missing field 'plus_input'",
    ),
    (dict(HUMANEVAL_PLUS[0], base_input=[1.0, 0.3]), "humaneval_plus", r"field 'base_input' must be a list of arg"),
    (dict(HUMANEVAL_PLUS[0], canonical_solution="\n  return (\n"), "humaneval_plus", r"field 'canonical_solution'"),
    (dict(MBPP_PLUS[0], plus_input=[[3, 4]]), "mbpp_plus", r"field 'plus_input': not the inputs of Mbpp/2"),
    (dict(MBPP_PLUS[0], task_id="Mbpp/two"), "mbpp_plus", r"field 'task_id': 'Mbpp/two' is not Mbpp/<number>"),
  ]
  for k, (row, fmt, message) in enumerate(cases):
    path = write_jsonl(tmp_path / f"bad{k}.jsonl", [MBPP_PLUS[1] if fmt == "mbpp_plus" else HUMANEVAL_PLUS[1], row])
    with pytest.raises(TaskFormatError, match=rf"bad{k}.jsonl:2: not a {fmt} record: {message}"):
      load_docs(path, fmt)
