"""`launch/rl.py --config=configs/rl.py:swe_tiny` end to end, as a user runs it: it starts its own "swe" env
service, trains on batches mixing SWE episodes (bash and the editor in sandboxed workspaces of the committed
toy tasks, graded in a fresh sandbox) with arithmetic, and leaves no workspace, env worker dir or sandbox
process behind. Checked from the files it leaves: per-task metrics, and tool results never trained."""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from k2jax.data.tokenizer import load_tokenizer
from k2jax.sandbox.runner import isolation_error
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_ISOLATED = isolation_error()
# One compiled RL run of the tiny model (warm start, RL step, engine at 1,024 tokens): minutes on 2 cores.
pytestmark = [
  pytest.mark.slow,
  pytest.mark.timeout(2400),
  pytest.mark.skipif(NOT_ISOLATED is not None, reason=f"the sandbox cannot isolate code here: {NOT_ISOLATED}"),
]


def _leftovers(tmp):
  return set(glob.glob(os.path.join(tmp, "k2jax-envworker-*")) + glob.glob(os.path.join(tmp, "k2jax-swe-ws-*")))


def _sandbox_processes(tmp):
  """This run's sandbox launchers and env workers: their command line or environment names the run's TMPDIR
  (the suite runs other launchers beside this one, in other workers)."""
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
      with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read().decode(errors="replace")
    except OSError:
      continue
    if ("k2jax-sandbox-io-" in cmd or "k2jax.agentic.envs --env=swe" in cmd) and (tmp in cmd or tmp in environ):
      out.append(cmd)
  return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("swe_rl")
  # The run's own TMPDIR, so that what other tests running beside it leave in /tmp is not counted (CI once saw
  # another worker's env worker dir here). 0755: the sandbox's uid must traverse it to reach its io dir.
  tmp = tempfile.mkdtemp(prefix="k2jax-swe-launch-test-")
  os.chmod(tmp, 0o755)
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
  env["TMPDIR"] = tmp
  env["XLA_FLAGS"] = xla_flags()  # one CPU device, as on a user's machine (the suite fakes 8)
  proc = subprocess.run(
    [sys.executable, "launch/rl.py", "--config=configs/rl.py:swe_tiny", f"--workdir={workdir}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=2300,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  yield workdir, proc, _leftovers(tmp), tmp
  shutil.rmtree(tmp, ignore_errors=True)


def _read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_iterations_complete_with_swe_and_arith_in_every_batch(run):
  workdir, proc, _, _ = run
  records = [r for r in _read(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") != "warm_start"]
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    assert r["num_samples/swe"] == 2.0 and r["num_samples/arith"] == 2.0
    assert 0.0 <= r["reward_mean/swe"] <= 1.0
    # K2's pass rate beside resolved, for the episodes that reached grading (an episode cut by the token
    # budget ends before it)
    for key in ("rollout_pass_rate/swe", "rollout_resolved/swe"):
      assert key not in r or 0.0 <= r[key] <= 1.0
  assert any("rollout_pass_rate/swe" in r for r in records)  # episodes reached grading (at their turn limit)
  assert '"step": 2' in proc.stdout


def test_tool_results_are_masked_and_nothing_is_left_behind(run):
  workdir, _, new_dirs, tmp = run
  tok = load_tokenizer()
  sp = tok.special_ids
  header = [sp["<|im_assistant|>"], *tok.encode("assistant"), sp["<|im_middle|>"]]
  samples = [s for s in _read(os.path.join(workdir, "rollouts.jsonl")) if s["task"] == "swe"]
  assert len(samples) == 4
  tool_tokens = 0
  for s in samples:
    P, tokens, mask = s["prompt_length"], s["tokens"], s["loss_mask"]
    assert not any(mask[:P]) and len(tokens) - P <= 160
    i = P
    while i < len(tokens):
      if tokens[i] in (sp["<|im_system|>"], sp["<|im_user|>"]):  # a tool result starts
        j = i
        while j < len(tokens) and tokens[j : j + len(header)] != header:
          j += 1
        assert not any(mask[i : j + len(header)]), tok.decode(tokens[i : j + len(header)])
        tool_tokens += j + len(header) - i
        i = j + len(header)
      else:
        i += 1
  assert tool_tokens > 0  # the warm start taught the call format: episodes reached tool results
  assert new_dirs == set()  # workspaces and env worker temp dirs are all gone
  # Processes of a stopped worker die with it (the sandbox launcher's PDEATHSIG); one the worker was
  # forking at that moment still has to exec the launcher to learn it: a few ms, allowed 10 s here.
  deadline = time.monotonic() + 10
  while (left := _sandbox_processes(tmp)) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert left == []
