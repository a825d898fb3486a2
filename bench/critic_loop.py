"""Closed-loop critic refinement end to end (K2 §3.2.2; k2jax/rl/critic.py) on the tiny model, on CPU.

The real learner (`k2jax.rl.learner.Learner`, configs/rl.py:tiny) runs RL with `critic.coef > 0` and the
judge's short layout (`reward.judge_layout=short`: the prompt, the answers labelled [[A]] / [[B]], "[[A]] or
[[B]]?"). The task is verifiable and one a tiny judge learns in ~200 updates (scripts/critic_probe.py
--format=short --task=zero: held-out agreement 0.5 at 150 SFT steps, 1.0 at 200): "0*b=" (b in 0..9, the
answer is always 0; `ProductTask`). After the format-only warm start the policy answers random digits, so
groups hold right and wrong answers and pairs are plentiful.

The critic learns only while pairs last, i.e. until the policy answers 0 every time (~35 iterations of 4
updates at the tiny preset's loss.tau 0.05: ~140 critic updates, on the plateau at agreement 0.5 throughout).
What buys the judge its updates is K2's own objective: its tau term pulls each sample's log-ratio
log(pi/pi_old) towards (r - mean r) / tau, so with tau = 1 the policy moves at most about a nat on a batch's
samples however many updates it takes, while the critic's verdict NLL (an SFT term, no such bound) learns
from every one. 24 updates per batch: the judge gets 24 steps per iteration. Two things keep what it learnt
once the policy has converged (k2jax/rl/critic.py, rl_step.py): its rows are drawn from the batch's unique
pairs and a replay of earlier batches' (`critic.replay_pairs`; without it, seed 0 went from 1.0 at iteration
8 to 0.548, three iterations of a single pair later), and an update whose batch has no signal (all rewards
equal, no critic rows) is not applied (without that, seed 4 went from 1.0 to 0.5 in its last iteration: 24
Muon steps along stale momentum).
`--task=sum` asks "1+b=" (b in 0..8; configs/rl.py:tiny's own task) instead: the answer b+1 varies with the
question, so on its held-out pairs a judge that prefers one digit scores 0.42-0.58 (on "0*b=", preferring "0"
scores 1.0; tests/rl/test_critic_loop.py). The judge must compare each answer with the question: SFT on
critic rows alone leaves chance after 300-900 steps of 16 rows, and sooner with 32 or 64
(scripts/critic_probe.py --task=sum --batch=32; docs/results.md "The critic"), so this task's defaults are 24
iterations and 64 critic rows. In the loop the judge fits its training pairs (critic_loss ~0.001-0.03) and
leaves chance on 5 of 5 seeds, wavering between iterations: held-out agreement at the end 0.778 [0.611,0.917]
(median [min,max]) with 64 rows, 0.639 [0.556,0.694] with `--critic_batch=32`; the figures are in
docs/results.md.
agreement_before / _after: the learner's `critic_agreement` (both orders of each pair: chance is exactly 0.5)
over every held-out pair of the task (the question, its answer, a wrong digit 0..9; `critic.is_heldout`:
never trained on), with the weights right after the format-only warm start and at the end; by_iteration: the
same before every iteration, then at the end. inloop_before / _after: the
learner's own per-iteration `critic_agreement` (on the batch's held-out pairs, up to 8; NaN when it has
none), mean of the first / last `--window` scored iterations: the same property, noisier (late batches hold
few held-out pairs, and they may run out before the judge learns).

  python bench/critic_loop.py                    # 5 seeds x 12 iterations (24 updates each)
  python bench/critic_loop.py --task=sum         # 1+b=: 5 seeds x 24 iterations, 64 critic rows per update
  python bench/critic_loop.py --reps=3 --iterations=20 --tau=0.05 --updates_per_batch=4

Prints one line per seed and `agreement_before=median [min,max] agreement_after=median [min,max] reps=N ...`
(with `window=`: inloop_before / _after depend on it, the held-out agreements do not). A run is reproducible:
the same command printed the same lines but wall_s on two days, and the rows the critic trains and scores each
iteration do not depend on the order reward threads finish (tests/rl/test_critic.py).

Measured: `python bench/critic_loop.py --task=sum --reps=5 --critic_batch=64` (64 is now the default),
2026-12-07, 2-core AMD EPYC, shared (load1 4-7), jax 0.10.2 (the seeds' lines are in docs/results.md):

  agreement_before=0.500 [0.444,0.500] agreement_after=0.778 [0.611,0.917] reps=5 task=sum iterations=24 updates_per_batch=24 tau=1.0 coef=10.0 critic_batch=64 preset=tiny lr=default
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from k2jax.data.tokenizer import load_tokenizer  # noqa: E402
from k2jax.grading.base import Prompt  # noqa: E402
from k2jax.rl.tasks import ArithmeticTask, strip_stop  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ProductTask(ArithmeticTask):
  """ "{a}*{b}=" with the exact answer a*b (ArithmeticTask's prompts, stream and format-only warm start, whose
  random answers span a_min+b_min .. a_max+b_max: with a = 0 and b in 0..9, every digit)."""

  def _make(self, prompt_id: str, a: int, b: int) -> Prompt:
    text = self.config.template.format(a=a, b=b)
    return Prompt(prompt_id, self.name, tuple(self._encode(text)), text, {"answer": str(a * b)})


# The task each `--task` runs: operand ranges, template, the prompt class (whose `_make` gives the answer) and the
# default iterations. zero: "0*b=" (answer 0 whatever b: a judge that prefers "0" scores 1.0); sum: "1+b="
# (configs/rl.py:tiny's own task, the answer b+1 varies with the question: a judge that prefers one digit
# scores ~0.5 on the held-out pairs).
TASKS = {
  "zero": dict(a=(0, 0), b=(0, 9), template="{a}*{b}=", cls=ProductTask, iterations=12, critic_batch=16),
  "sum": dict(a=(1, 1), b=(0, 8), template="{a}+{b}=", cls=ArithmeticTask, iterations=24, critic_batch=64),
}


def loop_config(
  iterations: int,
  seed: int,
  updates_per_batch: int = 24,
  tau: float = 1.0,
  coef: float = 10.0,
  task: str = "zero",
  preset: str = "tiny",
  lr: float | None = None,
  critic_batch: int | None = None,
):
  """configs/rl.py:tiny with the critic on in the short layout, on `task` (TASKS; see the module docstring);
  `preset` the model (model.preset), `lr` optim.lr (None: the preset's), `critic_batch` critic.batch_size
  (None: the task's, TASKS)."""
  t = TASKS[task]
  critic_batch = t["critic_batch"] if critic_batch is None else critic_batch
  spec = importlib.util.spec_from_file_location("rl_config_critic_loop", os.path.join(ROOT, "configs", "rl.py"))
  rl_configs = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rl_configs)
  c = rl_configs.get_config("tiny")
  c.unlock()
  c.seed, c.iterations = seed, iterations
  (c.task.a_min, c.task.a_max), (c.task.b_min, c.task.b_max), c.task.template = t["a"], t["b"], t["template"]
  c.model.preset = preset
  if lr is not None:
    c.optim.lr = lr
  c.task.seed = seed
  c.reward.judge_layout = "short"
  c.critic.coef, c.critic.batch_size, c.critic.seq_len, c.critic.eval_pairs = coef, critic_batch, 48, 8
  c.optim.updates_per_batch = updates_per_batch  # each update also takes a critic step on the batch's rows
  c.rollout.target_groups = c.rollout.launch_groups = 16
  c.rollout.partial_rollout = False
  c.loss.ptx_coef = 0.0
  c.loss.tau = tau  # bounds the policy's move per batch (see the module docstring), so pairs last
  c.eval.every = 0
  c.checkpoint.every = iterations
  c.lock()
  return c


def heldout_pairs(lc, task: ArithmeticTask) -> list:
  """Every held-out pair of the task's universe (each question, its right answer, a wrong digit 0..9), in the
  judge's short layout: the pairs `critic.is_heldout` keeps out of training in every iteration of every run."""
  from k2jax.rl import critic as C

  out = []
  for a in range(lc.task.a_min, lc.task.a_max + 1):
    for b in range(lc.task.b_min, lc.task.b_max + 1):
      prompt = task._make(f"heldout/{a}/{b}", a, b)  # as the task's stream makes it (the pair's key: task, text)
      right = prompt.data["answer"]
      for w in range(10):
        if str(w) != right:
          out += C.group_pairs(prompt, [right, str(w)], [1.0, 0.0], "", "short")
  return [p for p in out if C.is_heldout(p, lc.critic.heldout_fraction)]


def heldout_agreement(learner, pairs, tok) -> float:
  """critic_agreement (the learner's metric: both orders, chance 0.5) over `pairs` with the current weights."""
  from k2jax.rl import critic as C

  c, s = learner.lc.critic, learner.state
  chats = [C.verdict_messages(p, first, ok) for p in pairs for first in (True, False) for ok in (True, False)]
  seq = []
  for i in range(0, len(chats), c.eval_rows):  # the learner's compiled critic-eval shape
    rows = C.render_rows(tok, chats[i : i + c.eval_rows], c.eval_rows, c.seq_len)
    lp = np.asarray(learner.logprobs_fn(s.params, s.bias, rows["tokens_BT"], rows["segment_ids_BT"]), np.float64)
    seq.append((lp * rows["loss_mask_BT"]).sum(-1)[: len(chats) - i])
  seq = np.concatenate(seq).reshape(-1, 2)
  return C.agreement(seq[:, 0], seq[:, 1])


def run_loop(workdir: str, iterations: int, seed: int, window: int, devices=None, **settings) -> dict:
  """One RL run with the critic: {before, after (held-out agreement over all held-out pairs, after the warm
  start and at the end), trace (the same before every iteration, then at the end), inloop_before,
  inloop_after (the learner's critic_agreement, first / last `window` scored iterations), scored, heldout
  (pairs), records}. `devices`: the learner's (default: all). `settings`: loop_config's keywords (task,
  updates_per_batch, tau, ...)."""
  from k2jax.rl.learner import Learner, from_config_dict

  tok = load_tokenizer()
  lc = from_config_dict(loop_config(iterations, seed, **settings), workdir, (tok.eos_id,))
  task = TASKS[settings.get("task", "zero")]["cls"](lc.task, tok.encode, tok.eos_id)
  pairs = heldout_pairs(lc, task)
  learner = Learner(lc, workdir, task, strip_stop(tok.decode, lc.rollout.stop_token_ids), devices=devices)
  trace = []  # held-out agreement before each iteration, then at the end
  iteration = learner.iteration

  def scores_then_iterates():  # the first iteration starts right after the format-only warm start
    trace.append(heldout_agreement(learner, pairs, tok))
    return iteration()

  learner.iteration = scores_then_iterates
  try:
    learner.train()
    trace.append(heldout_agreement(learner, pairs, tok))
  finally:
    learner.close()
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  rl = [r for r in records if "critic_agreement" in r]
  scored = [r["critic_agreement"] for r in rl if r["critic_agreement"] == r["critic_agreement"]]  # not NaN
  if len(scored) < 2 * window:
    raise RuntimeError(
      f"critic_loop: only {len(scored)} of {len(rl)} iterations scored held-out pairs (< 2 x {window})"
    )
  return {
    "before": trace[0],
    "after": trace[-1],
    "trace": trace,
    "inloop_before": float(np.mean(scored[:window])),
    "inloop_after": float(np.mean(scored[-window:])),
    "scored": len(scored),
    "heldout": len(pairs),
    "records": rl,
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=5, help="seeds 0..reps-1")
  ap.add_argument("--task", choices=sorted(TASKS), default="zero", help="zero: 0*b= (answer 0); sum: 1+b= (b+1)")
  ap.add_argument("--iterations", type=int, default=None, help="RL iterations (default: the task's, TASKS)")
  ap.add_argument("--preset", default="tiny", help="model.preset (k2jax.model.presets)")
  ap.add_argument("--lr", type=float, default=None, help="optim.lr (default: configs/rl.py:tiny's)")
  ap.add_argument("--updates_per_batch", type=int, default=24)
  ap.add_argument("--tau", type=float, default=1.0, help="loss.tau")
  ap.add_argument("--coef", type=float, default=10.0, help="critic.coef")
  ap.add_argument("--critic_batch", type=int, default=None, help="critic.batch_size (default: the task's, TASKS)")
  ap.add_argument("--window", type=int, default=3, help="scored iterations averaged for inloop_before / _after")
  a = ap.parse_args()
  if a.iterations is None:
    a.iterations = TASKS[a.task]["iterations"]
  if a.critic_batch is None:
    a.critic_batch = TASKS[a.task]["critic_batch"]
  before, after = [], []
  for seed in range(a.reps):
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
      settings = dict(updates_per_batch=a.updates_per_batch, tau=a.tau, coef=a.coef, task=a.task, preset=a.preset)
      out = run_loop(d, a.iterations, seed, a.window, lr=a.lr, critic_batch=a.critic_batch, **settings)
    rl = out["records"]
    before.append(out["before"])
    after.append(out["after"])
    print(
      f"seed={seed} agreement_before={out['before']:.3f} agreement_after={out['after']:.3f} "
      f"heldout_pairs={out['heldout']} inloop_before={out['inloop_before']:.3f} "
      f"inloop_after={out['inloop_after']:.3f} scored={out['scored']}/{len(rl)} "
      f"pairs_first={rl[0]['critic_pairs']} pairs_last={rl[-1]['critic_pairs']} "
      f"reward_first={rl[0]['reward_mean']:.3f} reward_last={rl[-1]['reward_mean']:.3f} "
      f"critic_loss_last={rl[-1]['critic_loss']:.3f} wall_s={time.perf_counter() - t0:.0f} "
      f"by_iteration={'/'.join(f'{v:.2f}' for v in out['trace'])}",
      flush=True,
    )
  fmt = lambda v: f"{np.median(v):.3f} [{min(v):.3f},{max(v):.3f}]"  # noqa: E731
  print(
    f"agreement_before={fmt(before)} agreement_after={fmt(after)} reps={a.reps} task={a.task} "
    f"iterations={a.iterations} updates_per_batch={a.updates_per_batch} tau={a.tau} coef={a.coef} "
    f"critic_batch={a.critic_batch} window={a.window} "
    f"preset={a.preset} lr={'default' if a.lr is None else a.lr}"
  )


if __name__ == "__main__":
  main()
