"""docs/pretraining.md "The whole recipe": scripts/recipe.sh pretrains the tiny K2, SFTs it on "max of four
digits", RLs it on the train split and evaluates it with launch/eval.py on a held-out split never trained on.

The fast tests check the data: the shipped splits are what scripts/recipe_data.py generates, no held-out prompt
appears in the SFT or RL training files, and the recipe's presets train on those files and evaluate on the
held-out one only. The slow test runs the whole recipe and asserts that RL lifts held-out pass@1.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "recipe")
sys.path.insert(0, ROOT)

from configs import k2 as k2_configs
from configs import rl as rl_configs
from tests.xla_flags import xla_flags

# Sampled pass@1 (8 samples per prompt at temperature 1, what RL optimises) on the 200 held-out prompts must rise by
# at least this much from the SFT model to the RL model; measured on a 2-core CPU: docs/results.md has the numbers.
SAMPLED_MARGIN = 0.03  # measured +0.083, +0.064, +0.054 in three runs; each pass@1's stderr is ~0.02
GREEDY_SLACK = 0.1


def _jsonl(name):
  with open(os.path.join(DATA, name), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _training_prompts():
  sft = [m["content"] for r in _jsonl("sft_train.jsonl") for m in r["messages"] if m["role"] == "user"]
  rl = [r["prompt"] for r in _jsonl("rl_train.jsonl")]
  return sft, rl


def test_shipped_splits_are_the_generators():
  out = subprocess.run(
    [sys.executable, "scripts/recipe_data.py", "--check"], cwd=ROOT, capture_output=True, text=True, check=False
  )
  assert out.returncode == 0, out.stderr


def test_no_held_out_prompt_is_in_a_training_file():
  held = [r["prompt"] for r in _jsonl("heldout.jsonl")]
  sft, rl = _training_prompts()
  assert len(held) == len(set(held)) == 200 and len(set(sft)) == 2000 and len(set(rl)) == 1000
  assert not set(held) & set(sft) and not set(held) & set(rl)
  # Not even as a substring of a training file's text (every prompt is "max D D D D": equal length, so a held-out
  # prompt inside a training line would be a training prompt; this reads the raw bytes to be sure).
  for name in ("sft_train.jsonl", "rl_train.jsonl"):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
      text = f.read()
    assert not [p for p in held if f'"{p}"' in text], name
  # The answers are the rule's: the largest digit.
  for r in _jsonl("heldout.jsonl") + _jsonl("rl_train.jsonl"):
    assert r["answer"] == max(r["prompt"].split()[1:])


def test_recipe_presets_train_on_the_train_splits_and_evaluate_the_held_out_one():
  assert k2_configs.get_config("recipe_sft").data.path == os.path.join(DATA, "sft_train.jsonl")
  assert k2_configs.get_config("recipe_pretrain").data.path == ""  # the bundled corpus: no task data
  rl = rl_configs.get_config("recipe")
  assert {name: t.path for name, t in rl.tasks.items()} == {"maxdigit": os.path.join(DATA, "rl_train.jsonl")}
  assert rl.warm_start.steps == 0 and rl.loss.ptx_coef == 0.0  # nothing else is trained on
  assert {t.path for t in rl.eval.tasks.values()} == {os.path.join(DATA, "heldout.jsonl")}


@pytest.mark.slow  # the whole recipe: pretrain, SFT, RL and three evaluations (~5 min on 2 loaded cores)
@pytest.mark.timeout(3000)  # pytest.ini's 900 s cut it at RL iteration 10 with 4 other jobs on the 2 cores
def test_rl_lifts_held_out_pass_at_1(tmp_path):
  workdir = tmp_path / "recipe"
  # One CPU device, as a user runs the script, at the optimised level (the suite's 8 fake devices at level 0 made
  # it ~1.7x the CPU time: its ~1000 steps are execution-bound; tests/xla_flags.py).
  env = {**os.environ, "PYTHON": sys.executable, "XLA_FLAGS": xla_flags(optimize=True)}
  # RL's in-loop evaluation at iterations 0 and 40 only (the recipe's every 20 adds one at 20, 1800 answers the
  # test does not read).
  env["RECIPE_RL_ARGS"] = "--config.eval.every=40"
  out = subprocess.run(
    ["bash", "scripts/recipe.sh", str(workdir)], cwd=ROOT, env=env, capture_output=True, text=True, check=False
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  with open(workdir / "summary.json") as f:
    s = json.load(f)
  printed = dict(line.split("=", 1) for line in out.stdout.splitlines() if line.startswith(("heldout_", "wall_s_")))
  assert {k: float(v) for k, v in printed.items()} == pytest.approx(s)
  # SFT taught the task (the pretrained model answers almost nothing right) ...
  assert s["heldout_pass@1_greedy_pretrain"] < 0.2 < s["heldout_pass@1_greedy_sft"]
  # ... and RL on the train split lifts the held-out split's pass@1 by the stated margin (sampled, as RL samples).
  assert s["heldout_pass@1_sampled_rl"] > s["heldout_pass@1_sampled_sft"] + SAMPLED_MARGIN, s
  # Greedy pass@1 is not the claim: measured +0.02, -0.035, -0.05 in three runs (docs/results.md). RL must not undo the SFT,
  # as RL at lr 3e-3 did (0.90 -> 0.62).
  assert s["heldout_pass@1_greedy_rl"] > s["heldout_pass@1_greedy_sft"] - GREEDY_SLACK, s
  # Every held-out prompt was scored, 8 samples each for the sampled evaluation.
  for stage in ("sft", "rl"):
    with open(workdir / f"eval_{stage}" / "report.json") as f:
      tasks = json.load(f)["tasks"]
    assert tasks["heldout_sampled"]["num_docs"] == 200 and tasks["heldout_sampled"]["n"] == 8
    assert tasks["heldout"]["num_docs"] == 200 and tasks["heldout"]["n"] == 1
  # RL's own log: the reward rose, and its in-loop held-out evaluations end where launch/eval.py's does.
  with open(workdir / "rl" / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
  assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10, rewards
  assert rows[-1]["eval/heldout/pass@1"] == pytest.approx(s["heldout_pass@1_greedy_rl"])
  # The sampled task has the same name in both, so the same seeds: the same 1600 answers (measured equal; a
  # few samples may flip on last-bit logit differences between the two engines).
  assert rows[-1]["eval/heldout_sampled/pass@1"] == pytest.approx(s["heldout_pass@1_sampled_rl"], abs=2e-3)
  for name in ("sft", "rl"):
    assert (workdir / name / "curves.png").stat().st_size > 10_000
