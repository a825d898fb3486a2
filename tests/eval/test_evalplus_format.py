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


# MbppPlus's Mbpp/88 (its prompt, entry point, canonical solution and base inputs as published; the plus inputs
# here are a short selection of the same shape): the canonical solution returns a collections.Counter.
FREQ_COUNT = {
  "task_id": "Mbpp/88",
  "prompt": (
    '"""\nWrite a function to get the frequency of all the elements in a list, returned as a dictionary.\n'
    "assert freq_count([10,10,10,10,20,20,20,20,40,40,50,50,30])==({10: 4, 20: 4, 40: 2, 50: 2, 30: 1}) \n"
    '"""\n'
  ),
  "entry_point": "freq_count",
  "canonical_solution": "\nimport collections\ndef freq_count(list1):\n  freq_count= collections.Counter(list1)\n  return freq_count\n",
  "base_input": [
    [[10, 10, 10, 10, 20, 20, 20, 20, 40, 40, 50, 50, 30]],
    [[1, 2, 3, 4, 3, 2, 4, 1, 3, 1, 4]],
    [[5, 6, 7, 4, 9, 10, 4, 5, 6, 7, 9, 5]],
  ],
  "plus_input": [[[]], [[1]], [[True, 1, 2.0, 2]]],
  "atol": 0,
}


def _row(task_id, prompt, entry, canonical, base, plus, atol=0):
  return {"task_id": task_id, "prompt": prompt, "entry_point": entry, "canonical_solution": canonical}, {
    "base_input": base,
    "plus_input": plus,
    "atol": atol,
  }


def _live_rows():
  rows = [FREQ_COUNT]
  for task_id, entry, canonical in (
    (
      "HumanEval/901",
      "first_seen",
      "    import collections\n    return collections.OrderedDict((c, s.count(c)) for c in s)\n",
    ),
    (
      "HumanEval/902",
      "split",
      "    import collections\n    P = collections.namedtuple('P', 'q r')\n    return P(*divmod(a, b))\n",
    ),
    ("HumanEval/904", "half", "    import decimal\n    return decimal.Decimal(a) / 2\n"),
  ):
    args = {"first_seen": "s", "split": "a, b", "total": "xs", "half": "a"}[entry]
    base = {
      "first_seen": [["abca"], ["zzy"]],
      "split": [[7, 2], [9, 3]],
      "total": [[[1, 2, 3]], [[-4]]],
      "half": [[3], [10]],
    }[entry]
    rows.append(
      {
        "task_id": task_id,
        "prompt": f'def {entry}({args}):\n    """Return it."""\n',
        "entry_point": entry,
        "canonical_solution": canonical,
        "base_input": base,
        "plus_input": [base[0]],
        "atol": 0,
      }
    )
  return rows


def test_canonical_outputs_of_standard_types_compare_as_evalplus_compares(tmp_path):
  """A Counter, an OrderedDict, a namedtuple, a numpy scalar, a Decimal from the canonical solution: gradable,
  with `==` as EvalPlus evaluates it on the live objects (ungradable for every sample before)."""
  rows = _live_rows()
  freq = load_docs(write_jsonl(tmp_path / "MbppPlus.jsonl", rows[:1]), "mbpp_plus")[0]
  first, split, half = load_docs(write_jsonl(tmp_path / "HumanEvalPlus.jsonl", rows[1:]), "humaneval_plus")
  expected = evalplus.expected_outputs(freq, CODE)
  assert type(expected[0]).__name__ == "Counter" and expected[0] == {10: 4, 20: 4, 40: 2, 50: 2, 30: 1}
  assert expected[-1] == {True: 2, 2.0: 2}  # True == 1 and 2.0 == 2 are one key each, as in Python
  as_dict = (
    "```python\ndef freq_count(xs):\n    d = {}\n    for x in xs:\n        d[x] = d.get(x, 0) + 1\n    return d\n```"
  )
  v = _grade("mbpp_plus", freq, as_dict)  # Counter == dict: EvalPlus passes a plain dict
  assert (v.score, v.extra) == (1.0, {"base_pass": True, "plus_pass": True}), v.reason
  assert _grade("mbpp_plus", freq, FREQ_COUNT["canonical_solution"]).score == 1.0
  off_by_one = as_dict.replace("d.get(x, 0) + 1", "d.get(x, 1) + 1")
  v = _grade("mbpp_plus", freq, off_by_one)
  assert v.score == 0.0 and "base input 0: returned {10: 5" in v.reason
  # OrderedDict == dict (no order asked of a plain dict); two OrderedDicts compare in order.
  assert _grade("humaneval_plus", first, "    return {c: s.count(c) for c in s}\n").score == 1.0
  ordered = "    import collections\n    return collections.OrderedDict(sorted((c, s.count(c)) for c in set(s)))\n"
  assert _grade("humaneval_plus", first, ordered).score == 0.0  # 'abca': a, b, c sorted is the order; 'zzy' not
  # A namedtuple == a tuple of its items; Decimal(3) / 2 == 1.5 exactly.
  assert _grade("humaneval_plus", split, "    return divmod(a, b)\n").score == 1.0
  assert _grade("humaneval_plus", split, "    return [a // b, a % b]\n").score == 0.0  # a list is no tuple
  assert _grade("humaneval_plus", half, "    return a / 2\n").score == 1.0
  assert _grade("humaneval_plus", half, "    return a // 2\n").score == 0.0
  # An object whose __eq__ is always true is no value the grader compares: it cannot cross.
  always = "    class A:\n        def __eq__(self, o):\n            return True\n    return A()\n"
  v = _grade("humaneval_plus", half, always)
  assert v.score == 0.0 and "not a value the grader compares" in v.reason


def test_live_values_rebuild_only_standard_types():
  """The encoder (run here, where numpy imports; the default sandbox's interpreter has the standard library
  only) and the rebuilder: numpy scalars and arrays, and nothing but the standard types."""
  import collections
  import decimal

  import numpy as np

  from k2jax.sandbox.compare import LIVE_SOURCE, live_value

  space = {}
  exec(LIVE_SOURCE, space)
  encode = next(v for k, v in space.items() if k.endswith("_encode"))
  for value in (np.int64(6), np.float32(0.5), np.array([[1.5, 2.0]]), decimal.Decimal("0.1"), collections.deque([1])):
    back = live_value(encode(value))
    assert type(back) is type(value) and np.all(back == value)
  assert evalplus.outputs_match("humaneval", "f", [], 6, live_value(encode(np.int64(6))), 0.0)  # int == int64
  # EvalPlus's tolerance path asks the same type: a float within 1e-6 of a numpy float64 fails, a float64 passes.
  exp = live_value(encode(np.float64(0.3)))
  assert not evalplus.outputs_match("humaneval", "f", [], 0.1 + 0.2, exp, 0.0)
  assert evalplus.outputs_match("humaneval", "f", [], np.float64(0.1 + 0.2), exp, 0.0)
  assert not evalplus.outputs_match("humaneval", "f", [], decimal.Decimal("0.1"), 0.1, 0.0)  # Decimal != float

  assert live_value(["Counter", [[["str", "a"], ["int", 2]]]]) == {"a": 2}
  p = live_value(["namedtuple", ["P", ["q", "r"], [["int", 1], ["int", 2]]]])
  assert (
    p == (1, 2)
    and p.q == 1
    and type(p) is type(live_value(["namedtuple", ["P", ["q", "r"], [["int", 3], ["int", 4]]]]))
  )
  assert str(live_value(["numpy", ["float32", ["float", 0.5]]]).dtype) == "float32"
  for bad in (
    ["obj", 1],
    ["list", [["int", "1"]]],
    ["dict", [[["list", []], ["int", 1]]]],
    ["numpy", ["object", ["int", 1]]],
    ["namedtuple", ["P", ["q"], []]],
    "x",
  ):
    with pytest.raises(ValueError):
      live_value(bad)


def test_atol_carries_across_one_lists_inputs_as_in_evalplus():
  check = evalplus.check_outputs
  ran = [(True, 5), (True, 0.5), (True, [1, 2.5000001])]
  exp = [5, 0.5, [1, 2.5]]
  inputs = [[0], [1], [2]]
  # Input 1's expected 0.5 is a float with atol 0: atol becomes 1e-6 for input 2 too, whose [1, 2.5] is no list
  # of floats: within it, it passes.
  assert check("humaneval", "f", inputs, ran, exp, 0.0) == [None, None, None]
  # Alone (or in a list where no float came first) the same input is compared exactly and fails.
  assert check("humaneval", "f", inputs[2:], ran[2:], exp[2:], 0.0) == ["returned [1, 2.5000001], expected [1, 2.5]"]
  # A call that failed on the float input raises nothing: the later input is compared exactly.
  failed = [(True, 5), (False, "timed out after 4.0s"), (True, [1, 2.5000001])]
  assert check("humaneval", "f", inputs, failed, exp, 0.0)[1:] == [
    "timed out after 4.0s",
    "returned [1, 2.5000001], expected [1, 2.5]",
  ]
