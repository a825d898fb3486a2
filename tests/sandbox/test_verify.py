"""The dataset-format code verifier: every published test format grades a right program
1.0 and a wrong one 0.0 on rows shaped like the published ones; comparisons, limits and failures per case;
expected outputs never reach the solution's sandbox; trusted test code runs in a sandbox of its own.

Tests that run programs need the sandbox's namespaces and skip, naming why, where the kernel refuses them.
"""

import base64
import json
import pickle
import subprocess
import sys
import zlib

import pytest

from k2jax.sandbox import runner, verify as verify_mod
from k2jax.sandbox.code import CodeRewardConfig
from k2jax.sandbox.compare import compare_output, values_equal
from k2jax.sandbox.verify import parse_row, verify

CFG = CodeRewardConfig(case_time_s=2.0)
NOT_ISOLATED = runner.isolation_error()
needs_isolation = pytest.mark.skipif(
  NOT_ISOLATED is not None, reason=f"this machine cannot create the sandbox's namespaces: {NOT_ISOLATED}"
)

ADD_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"
MUL_STDIN = "a, b = map(int, input().split())\nprint(a * b)\n"
APPS_STDIN = {"input_output": json.dumps({"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7\n", "5\n"]})}
LCB_STDIN = {
  "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
  "private_test_cases": json.dumps([{"input": "3 4\n", "output": "7\n", "testtype": "stdin"}]),
  "metadata": "{}",
}
CODECONTESTS = {
  "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
  "private_tests": {"input": ["3 4\n"], "output": ["7\n"]},
  "generated_tests": {"input": ["0 0\n"], "output": ["0\n"]},
}
TWO_SUM_SOLUTION = """
class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i
"""
TWO_SUM_WRONG = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"
LCB_FUNCTIONAL = {
  "public_test_cases": json.dumps(
    [
      {"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"},
      {"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional"},
    ]
  ),
  "private_test_cases": "",
  "metadata": json.dumps({"func_name": "twoSum"}),
}
APPS_CALL = {
  "input_output": {
    "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
    "outputs": [[[0, 1]], [[1, 2]]],
    "fn_name": "twoSum",
  }
}
HUMANEVAL_ROW = {
  "task_id": "Test/0",
  "prompt": (
    "import math\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\n"
    "def find_zero(xs):\n    '''A zero of the odd-degree polynomial xs.'''\n"
  ),
  "test": (
    "import math, random\nMETADATA = {}\n\ndef check(candidate):\n    rng = random.Random(42)\n"
    "    for _ in range(30):\n        coeffs = [rng.randint(-5, 5) or 1 for _ in range(2 * rng.randint(1, 3))]\n"
    "        x = candidate(coeffs)\n        assert math.fabs(poly(coeffs, x)) < 1e-4\n"
  ),
  "entry_point": "find_zero",
}
FIND_ZERO = """
def find_zero(xs):
    lo, hi = -1.0, 1.0
    while poly(xs, lo) * poly(xs, hi) > 0:
        lo, hi = lo * 2.0, hi * 2.0
    while hi - lo > 1e-10:
        mid = (lo + hi) / 2.0
        if poly(xs, mid) * poly(xs, lo) > 0:
            lo = mid
        else:
            hi = mid
    return lo
"""
MBPP_ROW = {
  "task_id": 900,
  "text": "Sum a linked list.",
  "code": "",
  "test_setup_code": "class Node:\n    def __init__(self, v, nxt=None):\n        self.v, self.nxt = v, nxt\n",
  "test_list": [
    "assert list_sum(Node(1, Node(2, Node(3)))) == 6",
    "assert list_sum(Node(5)) == 5",
    "assert build(3).v == 0 and build(3).nxt.nxt.v == 2",
  ],
  "challenge_test_list": [],
}
MBPP_SOLUTION = """
def list_sum(node):
    total = 0
    while node is not None:
        total, node = total + node.v, node.nxt
    return total

def build(n):
    head = None
    for v in reversed(range(n)):
        head = Node(v, head)
    return head
"""


def _prompt(source):
  return source


# ---- no sandbox needed -------------------------------------------------------------------------------------
def test_compare_modes_prefix_and_tolerance():
  assert compare_output("3\n7\n", "3\n7\n", "exact", 1e-6)[0]
  assert not compare_output("3\n7", "3\n7\n", "exact", 1e-6)[0]
  assert compare_output("  3 \n7  \n\n", "3\n7\n", "lines", 0)[0]
  assert not compare_output("3 4\n", "3  4\n", "lines", 0)[0]  # LiveCodeBench strips lines, not inside them
  assert compare_output("3 4\n", "3  4\n", "tokens", 0)[0]
  for mode in ("exact", "lines", "tokens"):  # a correct prefix of the output fails, whichever the mode
    assert not compare_output("1\n2\n", "1\n2\n3\n", mode, 1e-6)[0], mode
    assert not compare_output("1 2", "1 2 3", mode, 1e-6)[0], mode
    assert not compare_output("", "1\n", mode, 1e-6)[0], mode
  assert compare_output("0.3333333\n", "0.333333333\n", "tokens", 1e-6)[0]
  assert not compare_output("0.3333\n", "0.333333333\n", "tokens", 1e-6)[0]
  assert compare_output("1000000.5\n", "1000000.0\n", "tokens", 1e-6)[0]  # relative: 0.5 <= 1e-6 * 1e6
  assert not compare_output("1000002.5\n", "1000000.0\n", "tokens", 1e-6)[0]
  assert compare_output("1.00\n", "1\n", "tokens", 0)[0] and not compare_output("1.01\n", "1\n", "tokens", 0)[0]
  assert (
    not compare_output("nan\n", "0\n", "tokens", 1e-6)[0] and not compare_output("inf\n", "1e400\n", "tokens", 1)[0]
  )
  assert not compare_output("YES\n", "yes\n", "tokens", 1e-6)[0]


def test_values_equal_is_plain_and_toleranced():
  assert values_equal((1, 2), [1, 2], 0) and values_equal([0.1 + 0.2], [0.3], 1e-9)
  assert not values_equal([0.31], [0.3], 1e-6) and not values_equal(True, 1, 0) and not values_equal("1", 1, 0)
  assert values_equal({"a": [1.0]}, {"a": [1]}, 1e-9) and not values_equal({"a": 1}, {"b": 1}, 0)


@pytest.mark.parametrize(
  "row,field",
  [
    ({"input_output": "{not json"}, "input_output"),
    ({"input_output": {"inputs": ["1"], "outputs": []}}, "input_output"),
    ({"input_output": {"inputs": "1", "outputs": ["1"]}}, "input_output.inputs"),
    ({"input_output": {"inputs": [["1"]], "outputs": ["1"], "fn_name": "not a name"}}, "input_output.fn_name"),
    ({"input_output": {"inputs": [3], "outputs": ["1"]}}, "input_output.inputs"),
    ({"public_test_cases": "[{\"input\": 1, \"output\": \"2\"}]"}, "public_test_cases"),
    ({"public_test_cases": "[{\"input\": \"1\", \"output\": \"2\", \"testtype\": \"rpc\"}]"}, "public_test_cases"),
    (
      {"public_test_cases": json.dumps([{"input": "1", "output": "2", "testtype": "functional"}])},
      "metadata.func_name",
    ),
    ({"private_test_cases": "not-base64!!"}, "private_test_cases"),
    ({"public_tests": {"input": ["1"], "output": "2"}}, "public_tests"),
    ({"test": "def check(candidate):\n  pass", "entry_point": "f(x)"}, "entry_point"),
    ({"test": "assert f(1) == 2", "entry_point": "f"}, "test"),
    ({"test": "def check(candidate):\n  pass", "entry_point": "f", "prompt": "def f(:"}, "prompt"),
    ({"test_list": []}, "test_list"),
    ({"test_list": ["assert f(1) == 2"], "test_setup_code": "def ("}, "test_setup_code"),
    ({"test_list": ["assert 1 == 1"]}, "test_list"),
    ({"input_output": {"inputs": ["1"], "outputs": ["1"]}, "checker": 3}, "checker"),
    ({"prompt": "hi"}, "input_output"),
    ({"test": "def test_a():\n  assert 1"}, "test"),
    ({"test": "from solution import f\n"}, "test"),
  ],
)
def test_malformed_rows_name_the_field(row, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    parse_row(row)


def test_lcb_lite_private_cases_decode_without_building_objects():
  cases = [{"input": "3 4\n", "output": "7\n", "testtype": "stdin"}]
  lite = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()
  p = parse_row({"public_test_cases": "[]", "private_test_cases": lite, "metadata": "{}"})
  assert p.kind == "stdin" and p.inputs == ("3 4\n",) and p.expected == ("7\n",)

  class Boom:
    def __reduce__(self):
      return (print, ("pwned",))

  evil = base64.b64encode(zlib.compress(pickle.dumps(Boom()))).decode()
  with pytest.raises(ValueError, match="private_test_cases.*refusing to build builtins.print"):
    parse_row({"private_test_cases": evil})
  evil = base64.b64encode(zlib.compress(pickle.dumps(__import__("os").getcwd))).decode()  # a bare global
  with pytest.raises(ValueError, match="private_test_cases.*refusing to build posix.getcwd"):
    parse_row({"private_test_cases": evil})
  not_text = base64.b64encode(zlib.compress(pickle.dumps(cases))).decode()  # plain data, but not the JSON string
  with pytest.raises(ValueError, match="private_test_cases.*the pickle holds a list, not the JSON string"):
    parse_row({"private_test_cases": not_text})


# ---- through the sandbox -----------------------------------------------------------------------------------
@needs_isolation
@pytest.mark.parametrize("row", [APPS_STDIN, LCB_STDIN, CODECONTESTS], ids=["apps", "livecodebench", "codecontests"])
def test_stdin_formats_right_and_wrong(row):
  g = verify(ADD_STDIN, row, CFG)
  assert g.reward == 1.0, g.reason
  assert verify(MUL_STDIN, row, CFG).reward == 0.0 or row is CODECONTESTS  # 0 * 0 == 0 + 0 passes one case
  assert verify(MUL_STDIN, CODECONTESTS, CFG).reward == pytest.approx(1 / 3)
  assert "pidns" in g.info["layers"]


@needs_isolation
@pytest.mark.parametrize("row", [LCB_FUNCTIONAL, APPS_CALL], ids=["livecodebench", "apps"])
def test_call_based_formats_right_and_wrong(row):
  g = verify(TWO_SUM_SOLUTION, row, CFG)
  assert g.reward == 1.0, g.reason
  assert verify(TWO_SUM_WRONG, row, CFG).reward == 0.5  # [0, 1] is right for the first case only
  top_level = "def twoSum(nums, target):\n    return [i for i in range(len(nums)) for j in range(i) if 0][:0]\n"
  assert verify(top_level, row, CFG).reward == 0.0


@needs_isolation
def test_float_answers_within_tolerance_pass_outside_fail():
  row = {"input_output": {"inputs": ["3\n", "7\n"], "outputs": ["0.333333333\n", "0.142857143\n"]}}
  assert verify("print(1 / int(input()))", row, CFG).reward == 1.0
  assert verify("print(round(1 / int(input()), 4))", row, CFG).reward == 0.0
  strict = CodeRewardConfig(case_time_s=2.0, compare="exact")
  assert verify("print(1 / int(input()))", row, strict).reward == 0.0
  call = {"input_output": {"inputs": [[3]], "outputs": [0.3333333333], "fn_name": "inv"}}
  assert verify("def inv(n):\n    return 1 / n\n", call, CFG).reward == 1.0
  assert verify("def inv(n):\n    return 0.333\n", call, CFG).reward == 0.0


@needs_isolation
def test_prefix_of_the_output_fails():
  row = {"input_output": {"inputs": ["3\n"], "outputs": ["1\n2\n3\n"]}}
  assert verify("n = int(input())\nfor i in range(n): print(i + 1)", row, CFG).reward == 1.0
  assert verify("n = int(input())\nfor i in range(n - 1): print(i + 1)", row, CFG).reward == 0.0
  assert verify("print(1)\nprint(2)", row, CFG).reward == 0.0


@needs_isolation
def test_timeout_crash_and_exit_fail_only_their_cases():
  cases = ["1\n", "2\n", "3\n", "4\n", "5\n", "6\n"]
  row = {"input_output": {"inputs": cases, "outputs": [f"{int(c) * 2}\n" for c in cases]}}
  program = """
import os, sys
n = int(input())
if n == 2:
    while True: pass                     # CPU-bound past the deadline
if n == 3:
    raise RuntimeError("boom")           # a crash
if n == 4:
    sys.exit(0)                          # exit 0 before the answer
if n == 5:
    import time; time.sleep(60)          # sleeps past the deadline
if n == 6:
    os._exit(0)                          # hard exit before the answer
print(n * 2)
"""
  cfg = CodeRewardConfig(case_time_s=1.0)
  g = verify(program, row, cfg)
  assert g.reward == pytest.approx(1 / 6), g.reason
  outcomes = g.info["outcomes"]
  assert outcomes[0] == (True, "")
  assert "timed out" in outcomes[1][1] and "timed out" in outcomes[4][1]
  assert "exit status 1: RuntimeError: boom" in outcomes[2][1]
  assert outcomes[3] == (False, "0 output lines, 1 expected") or not outcomes[3][0]
  assert not outcomes[5][0]
  # Printing the answer and then exiting 0 is a right answer (competitive code does it).
  assert verify("import sys\nprint(int(input()) * 2)\nsys.exit(0)", row, cfg).reward == 1.0


@needs_isolation
def test_stop_at_first_failure_is_all_or_nothing_and_stops_after_a_crash():
  row = {"input_output": {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}}
  stop = CodeRewardConfig(case_time_s=2.0, stop_at_first_failure=True)
  crash_at_2 = "n = int(input())\nassert n != 2\nprint(n)"
  assert verify("print(input())", row, stop).reward == 1.0
  g = verify(crash_at_2, row, stop)
  assert g.reward == 0.0 and "not run: stopped after case 1" in g.info["outcomes"][2][1], g.info["outcomes"]
  assert verify(crash_at_2, row, CFG).reward == pytest.approx(2 / 3)


@needs_isolation
def test_checker_program_for_several_right_answers():
  checker = (
    "def check(input, output, expected):\n"
    "    n = int(input)\n    a, b = map(int, output.split())\n    return a + b == n and a >= 0 and b >= 0\n"
  )
  row = {"input_output": {"inputs": ["5\n", "8\n"], "outputs": ["0 5\n", "4 4\n"]}, "checker": checker}
  assert verify("n = int(input())\nprint(1, n - 1)", row, CFG).reward == 1.0  # neither equals the expected text
  assert verify("n = int(input())\nprint(1, n)", row, CFG).reward == 0.0
  assert verify("print(0, 5)", row, CFG).reward == 0.5


@needs_isolation
def test_expected_outputs_never_enter_the_solution_sandbox(monkeypatch):
  seen = []
  real = verify_mod.run_python

  def spy(files, entry, config=runner.SandboxConfig(), stdin=""):
    seen.append(dict(files))
    return real(files, entry, config, stdin)

  monkeypatch.setattr(verify_mod, "run_python", spy)
  marker = "EXPECTED_7f3a9c"
  row = {"input_output": {"inputs": ["x\n"], "outputs": [marker + "\n"]}}
  leak = (
    "import os\nfor d, _, names in os.walk('/'):\n"
    "    for n in names:\n        p = os.path.join(d, n)\n"
    "        try:\n            t = open(p, errors='ignore').read(1 << 20)\n"
    "        except Exception:\n            continue\n"
    "        if 'EXPECTED_' in t and 'leak' not in t:  # not this very source\n"
    "            print(t[t.index('EXPECTED_'):][:15]); raise SystemExit\n"
  )
  g = verify(leak, row, CodeRewardConfig(case_time_s=5.0))
  assert g.reward == 0.0, g.reason
  assert seen and not any(marker in text for files in seen for text in files.values())


@needs_isolation
def test_humaneval_row_runs_trusted_loops_helpers_and_randomness_in_its_own_process():
  row = HUMANEVAL_ROW
  assert verify(row["prompt"] + FIND_ZERO, row, CFG).reward == 1.0
  assert verify(row["prompt"] + "    return None\n", row, CFG).reward == 0.0
  # A completion that redefines the trusted helper cannot change what the test computes with it.
  forge = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n"
  assert verify(row["prompt"] + forge, row, CFG).reward == 0.0


@needs_isolation
@pytest.mark.parametrize(
  "body",
  [
    "import os\ndef find_zero(xs):\n    os._exit(0)\n",
    "import sys\ndef find_zero(xs):\n    sys.exit(0)\n",
    "import sys\nsys.exit(0)\n",
    "import os\nos.kill(1, 9)\n",
    "class E:\n    def __eq__(self, o): return True\n    def __lt__(self, o): return True\n"
    "    def __abs__(self): return 0\n    def __float__(self): return 0.0\ndef find_zero(xs):\n    return E()\n",
    "import os\ndef find_zero(xs):\n    fd = os.open('/k2jax-chan/results', os.O_WRONLY)\n"
    "    os.write(fd, b'{\"id\": 1, \"ok\": 1.0}\\n' * 50)\n    return 123456.0\n",
    "def find_zero(xs):\n    while True: pass\n",
    "def find_zero(xs):\n    raise AssertionError('pass')\n",
  ],
  ids=["os._exit", "sys.exit-in-call", "sys.exit-at-load", "kill-pid1", "always-equal", "forge-pipe", "loop", "raise"],
)
def test_solution_cannot_reach_the_verdict(body):
  g = verify(HUMANEVAL_ROW["prompt"] + body, HUMANEVAL_ROW, CodeRewardConfig(case_time_s=2.0))
  assert g.reward == 0.0, (g.reason, g.info)
  assert "infra_error" not in g.info


@needs_isolation
def test_mbpp_setup_code_and_its_objects_cross_as_plain_data():
  assert verify(MBPP_SOLUTION, MBPP_ROW, CFG).reward == 1.0
  wrong = MBPP_SOLUTION.replace("total + node.v", "total + 2 * node.v")
  g = verify(wrong, MBPP_ROW, CFG)
  assert g.reward == pytest.approx(1 / 3), g.info["outcomes"]
  crashes_second = "def list_sum(node):\n    if node.nxt is None:\n        raise SystemExit(0)\n    return 6\n" + (
    MBPP_SOLUTION.split("def build")[0].replace("def list_sum", "def _unused")
    + "def build"
    + MBPP_SOLUTION.split("def build")[1]
  )
  g = verify(crashes_second, MBPP_ROW, CFG)
  assert [ok for ok, _ in g.info["outcomes"]] == [True, False, True], g.info["outcomes"]


@needs_isolation
def test_a_missing_function_and_a_syntax_error_fail_every_case():
  assert verify("def other(): pass", MBPP_ROW, CFG).reward == 0.0
  g = verify("def f(:", APPS_STDIN, CFG)
  assert g.reward == 0.0 and "does not compile" in g.reason
  assert verify("def f(:", HUMANEVAL_ROW, CFG).reward == 0.0


@needs_isolation
def test_a_sandbox_that_cannot_start_is_masked_never_zero(monkeypatch):
  def refuse(files, entry, config=None, stdin=""):
    raise runner.SandboxUnavailable("no user namespaces here")

  monkeypatch.setattr(verify_mod, "run_python", refuse)
  for row, code in ((APPS_STDIN, ADD_STDIN), (HUMANEVAL_ROW, FIND_ZERO), (MBPP_ROW, MBPP_SOLUTION)):
    g = verify(code, row, CFG)
    assert g.reward != g.reward and "no user namespaces" in g.info["infra_error"], g  # NaN: masked


@needs_isolation
@pytest.mark.parametrize("refused", ["serve", "module"], ids=["solution-side", "test-side"])
def test_one_side_failing_to_start_unblocks_the_other(monkeypatch, refused):
  real, ran = verify_mod.run_python, []

  def one_side_refused(files, entry, config=None, stdin=""):
    if f'"mode": "{refused}"' in files["plan.json"]:
      raise runner.SandboxUnavailable(f"the {refused} sandbox is refused")
    ran.append(real(files, entry, config, stdin))
    return ran[-1]

  monkeypatch.setattr(verify_mod, "run_python", one_side_refused)
  g = verify(FIND_ZERO, HUMANEVAL_ROW, CFG)
  assert g.reward != g.reward and "refused" in g.info["infra_error"]
  (other,) = ran
  assert not other.timed_out and other.reason == "ok", other  # it ended on the grader's stop line, not its deadline


@needs_isolation
def test_many_cases_share_one_sandbox_launch(monkeypatch):
  launches = []
  real = verify_mod.run_python
  monkeypatch.setattr(verify_mod, "run_python", lambda f, e, c, s="": launches.append(1) or real(f, e, c, s))
  n = 40
  row = {"input_output": {"inputs": [f"{i} {i}\n" for i in range(n)], "outputs": [f"{2 * i}\n" for i in range(n)]}}
  g = verify(ADD_STDIN, row, CFG)
  assert g.reward == 1.0 and len(launches) == 1


@needs_isolation
@pytest.mark.slow  # a fresh interpreter importing k2jax (jax): ~10 s of CPU
def test_python_O_strips_no_check():
  script = (
    "import json, sys\nfrom k2jax.sandbox.verify import verify\nfrom k2jax.sandbox.code import CodeRewardConfig\n"
    "cfg = CodeRewardConfig(case_time_s=2.0)\n"
    "print(sys.flags.optimize, json.dumps([verify(c, row, cfg).reward for row, c in json.loads(sys.argv[1])]))\n"
  )
  mbpp = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
  jobs = [
    (mbpp, "def add(a, b):\n    return a + b\n"),
    (mbpp, "def add(a, b):\n    return 0\n"),
    (HUMANEVAL_ROW, HUMANEVAL_ROW["prompt"] + FIND_ZERO),
    (HUMANEVAL_ROW, HUMANEVAL_ROW["prompt"] + "    return None\n"),
    (APPS_STDIN, ADD_STDIN),
    (APPS_STDIN, MUL_STDIN),
  ]
  out = subprocess.run(
    [sys.executable, "-O", "-c", script, json.dumps(jobs)], capture_output=True, text=True, check=True
  )
  flag, rewards = out.stdout.split(" ", 1)
  assert flag == "1" and json.loads(rewards) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], out


@needs_isolation
def test_eval_grading_uses_the_verifier_exit_status_decides_nothing():
  from k2jax.eval.grading import grade
  from k2jax.eval.tasks import Doc

  he = Doc("T/0", HUMANEVAL_ROW["prompt"], "", {k: HUMANEVAL_ROW[k] for k in ("prompt", "test", "entry_point")})
  assert grade("humaneval", "he", he, FIND_ZERO.split("\n", 2)[2], "stop", CFG).score == 1.0  # the body only
  for hack in ("    import os; os._exit(0)\n", "    import sys; sys.exit(0)\n"):
    v = grade("humaneval", "he", he, hack, "stop", CFG)
    assert v.score == 0.0, v
  mbpp = Doc("900", "", "", {"tests": MBPP_ROW["test_list"], "setup": MBPP_ROW["test_setup_code"]})
  assert grade("mbpp", "m", mbpp, f"```python\n{MBPP_SOLUTION}```", "stop", CFG).score == 1.0
  assert grade("mbpp", "m", mbpp, "import os\nos._exit(0)\n", "stop", CFG).score == 0.0
  generic = Doc("g", "", "", {"tests": APPS_STDIN})
  assert grade("answer.code", "c", generic, f"```python\n{ADD_STDIN}```", "stop", CFG).score == 1.0


@needs_isolation
def test_code_reward_takes_dataset_rows_and_keeps_assert_lists():
  from k2jax.grading.base import Completion, Prompt
  from k2jax.grading.code import code_reward

  def reward(tests, text):
    return code_reward(Prompt("p", "code", (), data={"tests": tests}), Completion((), text, "stop", False), CFG)

  assert reward(LCB_FUNCTIONAL, f"```python\n{TWO_SUM_SOLUTION}```").reward == 1.0
  assert reward(LCB_FUNCTIONAL, f"```python\n{TWO_SUM_WRONG}```").reward == 0.5
  assert reward(["assert add(1, 2) == 3"], "def add(a, b):\n    return a + b\n").reward == 1.0
  with pytest.raises(ValueError, match="data\\['tests'\\].*input_output"):
    reward({"input_output": "{"}, "print(1)")


KODCODE_ROW = {
  "question_id": "Kod_1",
  "question": "FizzBuzz and add.",
  "solution": "",
  "test": (
    "from solution import fizz, add\nimport pytest\n\n"
    "def test_fizz():\n    assert fizz(3) == 'Fizz'\n    assert fizz(5) == 'Buzz'\n\n"
    "@pytest.mark.parametrize('a,b,c', [(1, 2, 3), (2, 2, 4)])\ndef test_add(a, b, c):\n    assert add(a, b) == c\n\n"
    "class TestMore:\n    def test_raises(self):\n        with pytest.raises(ValueError):\n            fizz(-1)\n\n"
    "    def test_approx(self):\n        assert add(0.1, 0.2) == pytest.approx(0.3)\n"
  ),
  "test_info": [{"function_name": "fizz"}, {"function_name": "add"}],
}
KODCODE_SOLUTION = (
  "def fizz(n):\n    if n < 0:\n        raise ValueError('negative')\n"
  "    return 'Fizz' if n % 3 == 0 else 'Buzz' if n % 5 == 0 else str(n)\n\ndef add(a, b):\n    return a + b\n"
)


@needs_isolation
def test_kodcode_pytest_file_runs_in_the_tests_own_sandbox():
  cfg = CodeRewardConfig(case_time_s=3.0)
  g = verify(KODCODE_SOLUTION, KODCODE_ROW, cfg)
  assert g.reward == 1.0 and g.info["total"] == 5, g.info["outcomes"]  # parametrize: 2 items from one def
  g = verify("def fizz(n):\n    return 'Fizz'\n\ndef add(a, b):\n    return 4\n", KODCODE_ROW, cfg)
  assert [ok for ok, _ in g.info["outcomes"]] == [False, False, True, False, False], g.info["outcomes"]
  # Hacks that beat pytest graders sharing the solution's interpreter: nothing here reaches pytest.
  for hack in (
    "import os\nos._exit(0)\n",
    "import sys\nsys.exit(0)\n",
    "import _pytest.reports as r\nr.TestReport.outcome = 'passed'\ndef fizz(n): return 0\ndef add(a, b): return 0\n",
    "class E:\n    def __eq__(self, o): return True\ndef fizz(n): return E()\ndef add(a, b): return E()\n",
  ):
    g = verify(hack, KODCODE_ROW, cfg)
    assert g.reward == 0.0 and g.info["total"] == 5, (hack, g.reason)


@needs_isolation
def test_nothing_a_case_starts_outlives_it():
  # Case 0 leaves a process in its own session that would write a file later; case 1 looks for it.
  program = """
import os, sys, time
n = int(input())
if n == 0:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(0.5)
            open("flag", "w").write("x")
        os._exit(0)
    print("started")
else:
    time.sleep(1.0)
    print("alive" if os.path.exists("flag") else "gone")
"""
  row = {"input_output": {"inputs": ["0\n", "1\n"], "outputs": ["started\n", "gone\n"]}}
  g = verify(program, row, CodeRewardConfig(case_time_s=3.0))
  assert g.reward == 1.0, g.info["outcomes"]


@needs_isolation
def test_competitive_and_leetcode_idioms_run():
  threaded = """
import sys, threading
def main():
    sys.setrecursionlimit(100000)
    def depth(k):
        return 0 if k == 0 else 1 + depth(k - 1)
    print(depth(int(input())))
threading.stack_size(1 << 26)
t = threading.Thread(target=main)
t.start()
t.join()
"""
  row = {"input_output": {"inputs": ["20000\n"], "outputs": ["20000\n"]}}
  assert verify(threaded, row, CodeRewardConfig(case_time_s=5.0)).reward == 1.0
  annotated = TWO_SUM_SOLUTION.replace("(self, nums, target)", "(self, nums: List[int], target: int) -> List[int]")
  assert verify(annotated, LCB_FUNCTIONAL, CFG).reward == 1.0  # List without an import, as on LeetCode


@needs_isolation
def test_verify_batch_shares_one_test_sandbox_and_keeps_each_verdict(monkeypatch):
  from k2jax.sandbox.verify import verify_batch

  launches = []
  real = verify_mod.run_python
  monkeypatch.setattr(
    verify_mod,
    "run_python",
    lambda f, e, c, s="": launches.append(json.loads(f["plan.json"])["mode"]) or real(f, e, c, s),
  )
  jobs = [
    (HUMANEVAL_ROW["prompt"] + FIND_ZERO, HUMANEVAL_ROW),
    (HUMANEVAL_ROW["prompt"] + "    return None\n", HUMANEVAL_ROW),
    (MBPP_SOLUTION, MBPP_ROW),
    ("import os\nos._exit(0)\n", MBPP_ROW),
    (ADD_STDIN, APPS_STDIN),
    (HUMANEVAL_ROW["prompt"] + "import os\nos.kill(1, 9)\n", HUMANEVAL_ROW),
  ]
  graded = verify_batch(jobs, CFG, max_workers=3)
  assert [g.reward for g in graded] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], [g.reason for g in graded]
  assert sorted(launches) == ["batch", "serve", "serve", "serve", "serve", "serve", "stdin"]


@needs_isolation
@pytest.mark.parametrize("refused", ["serve", "batch"], ids=["one-solution", "test-side"])
def test_verify_batch_masks_what_could_not_start_and_never_hangs(monkeypatch, refused):
  from k2jax.sandbox.verify import verify_batch

  real, ran = verify_mod.run_python, []

  def refuse(files, entry, config=None, stdin=""):
    plan = json.loads(files["plan.json"])
    if plan["mode"] == refused and (refused == "batch" or "return None" in files["solution.py"]):
      raise runner.SandboxUnavailable(f"{refused} refused")
    ran.append(real(files, entry, config, stdin))
    return ran[-1]

  monkeypatch.setattr(verify_mod, "run_python", refuse)
  jobs = [(HUMANEVAL_ROW["prompt"] + b, HUMANEVAL_ROW) for b in (FIND_ZERO, "    return None\n", FIND_ZERO)]
  graded = verify_batch(jobs, CFG, max_workers=2)
  if refused == "serve":
    assert graded[0].reward == 1.0 and graded[2].reward == 1.0, [g.reason for g in graded]
    assert graded[1].reward != graded[1].reward and "refused" in graded[1].info["infra_error"]
  else:
    assert all(g.reward != g.reward and "refused" in g.info["infra_error"] for g in graded)
  assert all(not r.timed_out for r in ran), ran  # every sandbox that ran ended on its own
