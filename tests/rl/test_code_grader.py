"""The code grader: expected values are computed here, never in the sandbox, and nothing a program returns
can make the grader do unbounded work.

Tests that run programs need the sandbox's namespaces and skip, naming why, where the kernel refuses them.
"""

import json
import resource
import tracemalloc

import pytest

from k2jax.grading.base import Completion, Prompt
from k2jax.grading.code import code_reward
from k2jax.sandbox import expr, runner
from k2jax.sandbox.code import CodeRewardConfig, extract_code, run_tests, split_test
from k2jax.sandbox.runner import SandboxConfig

CFG = CodeRewardConfig(SandboxConfig(cpu_time_s=2, wall_time_s=30, memory_bytes=256 * 2**20))
NOT_ISOLATED = runner.isolation_error(CFG.sandbox)
needs_isolation = pytest.mark.skipif(
  NOT_ISOLATED is not None, reason=f"this machine cannot create the sandbox's namespaces: {NOT_ISOLATED}"
)

# The 9 shapes the probe forged or attacked: a literal, then expected values that are expressions.
SHAPES = [
  "assert s1(7) == 49",
  "assert s2(40) == 2**40",
  "assert s3('abc') == 'abc'[::-1]",
  "import math\nassert s4(2) == math.sqrt(2)",
  "assert s5('a,b,c') == 'a,b,c'.split(',')",
  "assert s6(5) == list(range(5)) and s6(0) == []",
  "expected = 'x' * 3 + str(2**10)\nr = s7(3)\nassert r == expected",
  "assert s8(10) % 7 == 2",
  "assert 'B' in s9('abc') and not s9('')",
]
CORRECT = """
import math
def s1(x): return x * x
def s2(n): return 2 ** n
def s3(s): return s[::-1]
def s4(x): return math.sqrt(x)
def s5(s): return s.split(',')
def s6(n): return list(range(n))
def s7(n): return 'x' * n + str(2 ** 10)
def s8(n): return n * n
def s9(s): return s.upper()
"""
# Implements nothing: it reads what the sandbox is given, evaluates every step it can with each name
# bound to an echo of its arguments, and reports those values (and the classic tricks) before the harness.
FORGER = r"""
import json, os
fd = int(os.environ["K2JAX_REPORT_FD"])
plan = json.load(open("calls.json"))
class AlwaysEqual:
    def __eq__(self, other): return True
    __hash__ = object.__hash__
def echo(*a, **k): return a[0] if a else None
ns = {n: echo for n in ("s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9")}
for i, steps in enumerate(plan):
    vals = []
    for kind, src in steps:
        try:
            if kind == "exec":
                exec(src, ns)
            else:
                vals.append(eval(src, ns))
        except Exception:
            vals.append(None)
    for guess in (vals, [True] * len(vals), ["%01000000000d"] * len(vals)):
        os.write(fd, (json.dumps({"test": i, "values": guess}, default=str) + "\n").encode())
for n in ns:
    globals()[n] = lambda *a, **k: AlwaysEqual()
os._exit(0)
"""


def test_expected_values_never_enter_the_sandbox():
  for test in SHAPES:
    s = split_test(test)
    sent = json.dumps(s.steps)
    for expected in ("1099511627776", "'cba'", "1.414", "['a', 'b', 'c']", "[0, 1, 2, 3, 4]", "xxx1024", "49"):
      assert expected not in sent, (test, s.steps)
    assert all(kind == "exec" or src.startswith("s") or src == "r" for kind, src in s.steps), s.steps
  s = split_test(SHAPES[1])
  assert s.steps == (("eval", "s2(40)"),) and s.constants == (2**40,)


@needs_isolation
def test_the_nine_shapes_score_zero_forged_and_one_correct():
  good = run_tests(CORRECT, SHAPES, CFG)
  assert good.reward == 1.0 and good.reason == "9/9 tests passed", good
  forged = run_tests(FORGER, SHAPES, CFG)
  assert forged.reward == 0.0, forged
  assert [ok for ok, _ in forged.info["outcomes"]] == [False] * 9, forged.info["outcomes"]
  # Through the reward function too, from a completion's last fenced block.
  p = Prompt("c", "code", (1,), data={"tests": SHAPES})
  r = code_reward(p, Completion((), f"```python\n{FORGER}```", "stop", False), CFG)
  assert r.reward == 0.0, r


@pytest.mark.parametrize(
  "test,why",
  [
    ("assert all(f(x) == 2 for x in range(3))", "does not evaluate"),
    ("assert f(3) == hex(255)", "builtin `hex`"),
    ("def check(x):\n  return x == 3\nassert check(f(1))", "the test's own code"),
    ("class T:\n  pass\nassert f(1) == T()", "the test's own code"),
    ("for i in range(3):\n  assert f(i) == i", "top-level assert"),
    ("assert f(1) == '%05d' % 3", "numbers only"),
    ("assert f(1) == 10**100000", "grader cap"),
    ("assert f(1) == list(range(10**9))", "grader cap"),
    ("from math import *\nassert f(1) == sqrt(2)", "import the names"),
    ("def ref(x):\n  return x\nexpected = ref(3)\nassert f(3) == expected", "the test's own code"),
    ("total = 0\nfor i in range(3):\n  total += f(i)\nassert total == 3", "the test's own code"),
    ("x = 1\nx += f(2)\nassert x == 3", "the test's own code"),
    ("r = sorted(f(3))\nr.append(1)\nassert r == [1]", "cannot read it"),
  ],
)
def test_tests_judged_inside_are_rejected_with_the_reason(test, why):
  with pytest.raises(ValueError, match="test 0") as e:
    split_test(test, "test 0")
  assert why in str(e.value), e.value


def test_extraction_is_linear_and_keeps_its_meaning():
  text = "```python\n" + "\n" * 32000  # unclosed: the old regex backtracked over it quadratically
  assert extract_code(text) == text
  code = "def f():\n  return 1\n"
  assert extract_code("x\n```python\n" + code + "```" + "\n" * 32000) == code
  assert extract_code("```\nA\n```\nthen\n```py\n" + code + "```\n```json\n{}\n```") == code
  # Counted work, not time: the scan visits each fence once, so a 100x longer input costs 100x the steps.
  steps = []
  real_find = str.find

  class Counting(str):
    def find(self, *a):
      steps.append(1)
      return real_find(self, *a)

  for n in (1000, 100000):
    steps.clear()
    extract_code(Counting("```py\n" + "\n" * n + "```\n" * 50))
    assert len(steps) <= 2 * 50 + 4, (n, len(steps))


def test_program_values_cannot_make_the_grader_allocate():
  s = split_test("assert solve(10) % 7 == 3 and [0] * n() == [0] and 'a' * n() != '' and 2 ** n() > 1")
  budget = expr.Budget()
  for values in (["%01000000000d", 1, 1, 1], [3, 10**9, 1, 1], [3, 1, 10**9, 1], [3, 1, 1, 10**9]):
    from k2jax.sandbox.code import _grade

    tracemalloc.start()
    ok, why = _grade(s, ("values", values), budget)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not ok and peak < 2**20, (values, why, peak)
    assert ("numbers only" in why or "grader limit" in why) and "sandbox's" not in why.split("not the")[0], why


@needs_isolation
def test_the_percent_attack_is_a_clear_failure_without_caller_memory():
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  tracemalloc.start()
  r = run_tests("def solve(n):\n    return '%01000000000d'\n", ["assert solve(10) % 7 == 3"], CFG)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert r.reward == 0.0 and "mod on a str" in r.reason and "memory limit" not in r.reason, r
  assert peak < 16 * 2**20, peak
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 2**10, "grew by >= 64 MiB"  # KiB


@needs_isolation
def test_grader_limit_names_the_caller_cap_not_the_sandbox():
  cfg = CodeRewardConfig(CFG.sandbox, max_check_items=1000)
  r = run_tests("def f():\n    return 'ab' * 400\n", ["assert f() * 3 != ''"], cfg)
  assert r.reward == 0.0 and "grader limit (max_check_items=1000, the caller's cap" in r.reason, r
  assert "memory limit (" not in r.reason, r
  # Values cross only within the report cap, and ints only up to 4300 digits.
  r = run_tests("def f():\n    return 10 ** 5000\n", ["assert f() > 0"], CFG)
  assert r.reward == 0.0, r


def test_grader_side_failures_never_blame_the_sandbox(monkeypatch):
  from k2jax.sandbox import code

  s = split_test("import math as m\nassert m.sqrt(f()) == m.sqrt(4) and 'é'.encode('utf-8') == b'\\xc3\\xa9'")
  assert code._grade(s, ("values", [4]), expr.Budget()) == (True, "")
  with pytest.raises(ValueError, match="punycode is quadratic|utf-8, ascii"):
    split_test("assert f() == 'x'.encode('punycode')")

  def out_of_memory(self, node):
    raise MemoryError

  monkeypatch.setattr(expr.Evaluator, "__call__", out_of_memory)
  ok, why = code._grade(s, ("values", [4]), expr.Budget())
  assert not ok and why.startswith("the grader ran out of memory") and "not the sandbox's" in why, why


def test_comprehensions_are_evaluated_here_with_a_budget():
  from k2jax.sandbox.code import _grade

  budget = expr.Budget(max_items=10000)
  cases = [
    ("assert f([1, 2, 3]) == [x * 2 for x in [1, 2, 3]]", [[2, 4, 6]], True),
    ("assert all(x > 0 for x in f(3))", [[1, 2]], True),
    ("assert all(x > 0 for x in f(3))", [[1, -2]], False),
    ("assert {k: v for k, v in f()} == {i: i * i for i in range(3)}", [[[0, 0], [1, 1], [2, 4]]], True),
    ("assert sum(x * x for x in f() if x % 2) == 10", [[1, 3, 4]], True),
  ]
  for test, values, want in cases:
    s = split_test(test)
    assert s.steps == (("eval", s.steps[0][1]),) and s.steps[0][1].startswith("f("), s.steps
    assert _grade(s, ("values", values), budget)[0] is want, test
  s = split_test("assert [x * 50 for x in f()] != []")
  ok, why = _grade(s, ("values", [["ab" * 50] * 200]), budget)  # each element fits, the list does not
  assert not ok and "grader limit" in why and "comprehension's result" in why, why
  with pytest.raises(ValueError, match="grader cap"):
    split_test("assert f() == [i for i in range(10**9)]")


@needs_isolation
def test_a_judgment_assigned_before_the_assert_is_made_here():
  """`ok = s(3) == 2**40; assert ok` would let the program report ok=True: it is split like an assert."""
  tests = ["ok = s(40) == 2**40\nassert ok", "r = sorted(s(3))\nn = len(r)\nassert r == [0, 1, 2] and n == 3"]
  s = split_test(tests[0])
  assert s.steps == (("eval", "s(40)"),), s.steps
  good = run_tests("def s(n):\n    return 2 ** n if n == 40 else list(range(n))[::-1]\n", tests, CFG)
  assert good.reward == 1.0, good
  forged = "import os\nfd = int(os.environ['K2JAX_REPORT_FD'])\n"
  forged += (
    "for i in range(2):\n    os.write(fd, ('{\"test\": %d, \"values\": [true, true]}\\n' % i).encode())\nos._exit(0)\n"
  )
  bad = run_tests(forged, tests, CFG)
  assert bad.reward == 0.0, bad


def test_a_returned_string_cannot_pose_as_a_sandbox_limit():
  assert runner.limit_named("AssertionError: got '[Errno 11] x'", CFG.sandbox) is None
  assert runner.limit_named("BlockingIOError: [Errno 11] Resource temporarily unavailable", CFG.sandbox).startswith(
    "process limit"
  )
