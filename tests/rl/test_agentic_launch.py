"""`launch/rl.py --config=configs/rl.py:agentic_tiny` end to end, as a user runs it: a subprocess that starts
its own sim_tools env service, trains on mixed batches of six task types (each reward kind of the contract
in every batch, per-task budgets) and writes every sample's tokens and loss mask (log.rollouts). Checked from
the files it leaves: per-task reward keys in metrics.jsonl, and tool results inside episodes never trained."""

import json
import os
import subprocess
import sys

import pytest

from k2jax.data.tokenizer import load_tokenizer
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = {"math": 12, "code": 16, "instruction": 12, "judge": 8, "rubric": 8, "sim_tools": 128}  # name -> budget

# One compiled RL run of the tiny model (warm start, RL step, engine): 11-16 min measured on 2 cores under a
# load average of ~20 (other jobs compiling), hence the timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("agentic_rl")
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
  env["XLA_FLAGS"] = xla_flags()  # one CPU device, as on a user's machine (the suite fakes 8)
  proc = subprocess.run(
    [sys.executable, "launch/rl.py", "--config=configs/rl.py:agentic_tiny", f"--workdir={workdir}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=2300,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return workdir, proc


def test_iterations_complete_with_every_reward_kind_in_every_batch(run):
  workdir, proc = run
  records = [r for r in _read(os.path.join(workdir, "metrics.jsonl")) if r.get("phase") != "warm_start"]
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    for task in TASKS:  # one group of K=2 samples of each task type per batch
      assert r[f"num_samples/{task}"] == 2.0, (task, r)
      assert 0.0 <= r[f"reward_mean/{task}"] <= 1.0
    assert r["num_samples"] == 12.0 and r["dropped_samples"] == 0
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
  assert '"step": 2' in proc.stdout


def test_budgets_and_tool_results_are_masked_out(run):
  workdir, _ = run
  tok = load_tokenizer()
  sp = tok.special_ids
  header = [sp["<|im_assistant|>"], *tok.encode("assistant"), sp["<|im_middle|>"]]
  samples = _read(os.path.join(workdir, "rollouts.jsonl"))
  assert sorted({s["task"] for s in samples}) == sorted(TASKS) and len(samples) == 24
  tool_tokens = trained_after_tool = 0
  for s in samples:
    P, tokens, mask = s["prompt_length"], s["tokens"], s["loss_mask"]
    assert not any(mask[:P]) and mask[P] == 1  # the prompt is never trained; the response starts generated
    assert len(tokens) - P <= TASKS[s["task"]]  # the task's token budget bounds the whole response
    if s["task"] != "sim_tools":
      assert all(mask[P:])  # single-turn: every response token was generated
      continue
    i = P
    while i < len(tokens):
      if tokens[i] in (sp["<|im_system|>"], sp["<|im_user|>"]):  # a tool result (or user turn) starts
        j = i
        while j < len(tokens) and tokens[j : j + len(header)] != header:
          j += 1
        span = mask[i : j + len(header)]
        assert not any(span), tok.decode(tokens[i : j + len(header)])
        tool_tokens += len(span)
        trained_after_tool += sum(mask[j + len(header) :])
        i = j + len(header)
      else:
        i += 1
  # The warm start taught the tool-call format, so episodes reached tool results, and the policy's turns
  # after them are trained.
  assert tool_tokens > 0 and trained_after_tool > 0
