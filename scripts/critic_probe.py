"""Can the tiny model learn the critic's judgment at all? SFT on critic examples only (no RL, no policy), from
a fresh random init of `model.preset`, then held-out agreement as the learner logs it (docs/results.md "The
critic").

  python scripts/critic_probe.py --questions=9 --steps=600 --lr=6e-3 [--format=judge|short|mini] [--rubrics=...]
  python scripts/critic_probe.py --format=short --task=zero --questions=10 --seq_len=48   # bench/critic_loop.py's

The pairs are every (right, wrong) digit pair of the tiny RL task's "1+b=" questions, b < `questions` (the
answer is the digit b+1, the wrong one any other digit), split by `critic.is_heldout` as in a run. `judge`
is the critic's real example (k2jax/rl/critic.py: the rubric reward's pairwise prompt, `--rubrics` as
`critic.rubrics`, '' = the rubric reward's own); `short` is the judge's short layout (`reward.judge_layout=short`,
the rubric reward's other choice); `--task=zero` asks "0*b=" (answer 0) instead, `--task=product` "a*b="
(a in [1, `--a_max`], products up to 9: an answer that varies with the question); `mini` is a diagnostic, not a product format: the question
and the two answers with nothing else ("1+3=\\nA: 4\\nB: 7"), the same verdict. Prints, every `every` steps,
the agreement and margin (critic.py's) on the held-out pairs and on 16 training pairs, and the verdict loss.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from k2jax.data.tokenizer import load_tokenizer  # noqa: E402
from k2jax.model import K2Model, presets  # noqa: E402
from k2jax.optim import QKClipSpec, muonclip  # noqa: E402
from k2jax.rl import critic as C  # noqa: E402
from k2jax.rl import rl_step  # noqa: E402
from k2jax.grading.base import Prompt  # noqa: E402
from k2jax.grading.rubric import RubricRewardConfig, format_rubrics  # noqa: E402
from k2jax.train.step import ModelDef, init_state  # noqa: E402

_FORMAT = flags.DEFINE_enum("format", "judge", ["judge", "short", "mini"], "critic example layout (see the docstring)")
_TASK = flags.DEFINE_enum(
  "task", "sum", ["sum", "zero", "product"], "sum: 1+b= (answer b+1); zero: 0*b= (answer 0); product: a*b="
)
_A_MAX = flags.DEFINE_integer("a_max", 1, "product: a in [1, a_max] (products above 9 are left out)")
_RUBRICS = flags.DEFINE_string("rubrics", "The answer is correct.", "as critic.rubrics ('' = the rubric reward's)")
_QUESTIONS = flags.DEFINE_integer("questions", 9, "distinct questions 1+b=, b in [0, questions)")
_STEPS = flags.DEFINE_integer("steps", 300, "SFT steps")
_BATCH = flags.DEFINE_integer("batch", 16, "critic rows per step (as critic.batch_size)")
_LR = flags.DEFINE_float("lr", 3e-3, "MuonClip learning rate (the tiny RL preset's is 3e-3)")
_SEQ = flags.DEFINE_integer("seq_len", 160, "tokens per row (as critic.seq_len)")
_EVERY = flags.DEFINE_integer("every", 50, "print every N steps")
_PRESET = flags.DEFINE_string("preset", "tiny", "model preset")
_SEED = flags.DEFINE_integer("seed", 0, "init and sampling seed")


def _mini_messages(pair: C.Pair, better_first: bool, verdict_correct: bool = True) -> list[dict]:
  a, b = (pair.better, pair.worse) if better_first else (pair.worse, pair.better)
  names_better = "A" if better_first else "B"
  verdict = names_better if verdict_correct else {"A": "B", "B": "A"}[names_better]
  return [
    {"role": "user", "content": f"{pair.question}\nA: {a}\nB: {b}"},
    {"role": "assistant", "content": f"[[{verdict}]]"},
  ]


def main(argv):
  del argv
  tok = load_tokenizer()
  critic = C.CriticConfig(coef=1.0, rubrics=_RUBRICS.value)
  layout = "short" if _FORMAT.value == "short" else "rubric"
  rubric_config = RubricRewardConfig(layout=layout)
  if critic.rubric_list and layout == "rubric":
    rubric_config = RubricRewardConfig(core=critic.rubric_list, prescriptive=(), mandatory=())
  rubrics = format_rubrics(rubric_config, ())
  messages = _mini_messages if _FORMAT.value == "mini" else C.verdict_messages
  pairs = []
  questions = {"sum": [(f"1+{b}=", b + 1) for b in range(_QUESTIONS.value)]}
  questions["zero"] = [(f"0*{b}=", 0) for b in range(_QUESTIONS.value)]
  questions["product"] = [
    (f"{a}*{b}=", a * b) for a in range(1, _A_MAX.value + 1) for b in range(_QUESTIONS.value) if a * b <= 9
  ]
  for question, right in questions[_TASK.value]:
    prompt = Prompt(f"arith/{question}", "arith", (), question, {})
    for w in range(10):
      if w != right:
        pairs += C.group_pairs(prompt, [str(right), str(w)], [1.0, 0.0], rubrics, layout)
  held = [p for p in pairs if C.is_heldout(p, critic.heldout_fraction)]
  train = [p for p in pairs if not C.is_heldout(p, critic.heldout_fraction)]
  if not held:
    raise SystemExit(f"--questions={_QUESTIONS.value}: no held-out pair among {len(pairs)}")
  example = C.render_rows(tok, [messages(train[0], True)], 1, _SEQ.value)
  print(f"pairs: {len(train)} train, {len(held)} held out; {int(example['segment_ids_BT'].sum())} tokens each")

  cfg = presets.get(_PRESET.value)
  schedule = optax.constant_schedule(_LR.value)
  opt = muonclip(schedule, qk_clip_tau=100.0, qk_clip_spec=QKClipSpec.from_config(cfg))
  make = lambda: K2Model(cfg, rngs=nnx.Rngs(_SEED.value))  # noqa: E731
  state = init_state(make(), opt)
  mdef = ModelDef.from_model(nnx.eval_shape(make))
  step = jax.jit(rl_step.make_sft_step(mdef, opt, schedule, qk_clip_tau=100.0))
  logprobs = jax.jit(rl_step.make_logprobs_fn(mdef))

  def eval_rows(ps):
    chats = [messages(p, first, correct) for p in ps for first in (True, False) for correct in (True, False)]
    return C.render_rows(tok, chats, len(chats), _SEQ.value)

  def agreement(rows):
    lp = np.asarray(logprobs(state.params, state.bias, rows["tokens_BT"], rows["segment_ids_BT"]), np.float64)
    seq = (lp * rows["loss_mask_BT"]).sum(-1).reshape(-1, 2)
    return C.agreement(seq[:, 0], seq[:, 1]), float(np.mean(seq[:, 0] - seq[:, 1]))

  held_rows, train_rows = eval_rows(held), eval_rows(train[:16])
  examples = [(p, first) for p in train for first in (True, False)]
  rng = np.random.default_rng(_SEED.value)
  t0, loss = time.time(), float("nan")
  for i in range(_STEPS.value + 1):
    if i % _EVERY.value == 0:
      (ha, hm), (ta, tm) = agreement(held_rows), agreement(train_rows)
      print(
        f"step={i} heldout_agreement={ha:.3f} heldout_margin={hm:.4f} train_agreement={ta:.3f} "
        f"train_margin={tm:.4f} verdict_loss={loss:.4f} time_s={time.time() - t0:.0f}",
        flush=True,
      )
    if i == _STEPS.value:
      break
    picked = rng.permutation(len(examples))[: _BATCH.value]
    rows = C.render_rows(tok, [messages(*examples[j]) for j in picked], _BATCH.value, _SEQ.value)
    state, metrics = step(state, rows["tokens_BT"], rows["segment_ids_BT"], rows["loss_mask_BT"])
    loss = float(metrics["loss"])


if __name__ == "__main__":
  app.run(main)
