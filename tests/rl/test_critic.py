"""Closed-loop critic refinement (k2jax/rl/critic.py): pairs, the rubric reward's format, the held-out split,
the agreement metric, the critic term of the RL update, the config."""

import importlib.util
import os

import numpy as np
import pytest

from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import load_tokenizer
from k2jax.model.config import ConfigError
from k2jax.rl import critic as C
from k2jax.grading.base import Completion, Prompt, RewardResult
from k2jax.grading.contract import EngineJudge
from k2jax.grading.rubric import RubricRewardConfig, format_rubrics, parse_verdict, rubric_group_reward
from k2jax.rl.rollout_batch import RolloutBatch, pad_token_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = load_tokenizer()
RUBRIC = RubricRewardConfig()
RUBRICS = format_rubrics(RUBRIC, ())


def _prompt(b: int) -> Prompt:
  text = f"1+{b}"
  return Prompt(f"arith/{b}", "arith", tuple(TOK.encode(text)), text, {"answer": str(b + 1)})


def _completion(text: str) -> Completion:
  return Completion(tuple(TOK.encode(text)) + (TOK.eos_id,), text, "stop", False)


def _exact(prompt, completions):
  return [RewardResult(float(c.text == prompt.data["answer"]), "") for c in completions]


def _batch(groups) -> RolloutBatch:
  """The RolloutBatch the rollout manager builds from (prompt, completions) groups."""
  rows, gids = [], []
  for g, (p, cs) in enumerate(groups):
    for c in cs:
      P, R = len(p.input_ids), len(c.output_ids)
      rows.append((list(p.input_ids) + list(c.output_ids), [0.0] * P + [1.0] * R, [0.0] * (P + R), [-1] * P + [0] * R))
      gids.append(g)
  arrays = pad_token_rows(rows, pad_id=0)
  lengths = [(len(p.input_ids), len(c.output_ids)) for p, cs in groups for c in cs]
  return RolloutBatch(
    **arrays,
    rewards_B=np.zeros(len(rows), np.float32),
    group_ids_B=np.array(gids, np.int32),
    prompt_lengths_B=np.array([p for p, _ in lengths], np.int32),
    response_lengths_B=np.array([r for _, r in lengths], np.int32),
    truncated_B=np.zeros(len(rows), bool),
    tasks=tuple("arith" for _ in rows),
    iteration=0,
    temperature=1.0,
  )


def _refiner(**kw):
  config = C.CriticConfig(**{"coef": 1.0, "batch_size": 8, "seq_len": 400, "eval_pairs": 4, **kw})
  return C.CriticRefiner(config, TOK, RUBRIC, {"arith": "exact", "chat": "rubric"})


def _scored(refiner, groups):
  reward = refiner.recording(_exact)
  for p, cs in groups:
    reward(p, cs)
  return _batch(groups)


def test_pairs_only_from_different_rewards():
  texts = ["5", "3", "5", "7", "2"]
  pairs = C.group_pairs(_prompt(4), texts, [1.0, 0.0, 1.0, 0.0, 0.5], RUBRICS)
  # 1.0 vs 0.0: 2 x 2; 1.0 vs 0.5: 2; 0.5 vs 0.0: 2. The two "5" (equal rewards) and equal rewards never pair.
  assert len(pairs) == 8
  assert all(p.better_reward > p.worse_reward and p.better != p.worse for p in pairs)
  assert sorted((p.better, p.worse) for p in pairs) == sorted(
    [("5", "3"), ("5", "7"), ("5", "3"), ("5", "7"), ("5", "2"), ("5", "2"), ("2", "3"), ("2", "7")]
  )
  # Same text, different rewards (e.g. one was cut by the budget): the judge cannot tell them apart.
  assert C.group_pairs(_prompt(4), ["5", "5"], [1.0, 0.0], RUBRICS) == []
  assert C.group_pairs(_prompt(4), ["3", "7"], [0.0, 0.0], RUBRICS) == []


def test_format_equals_the_rubric_rewards():
  """The judge chat of a critic example is exactly what the rubric reward sends its judge; the trained tokens
  are the verdict the rubric reward parses (and the judge's stop token), after EngineJudge's rendered prompt."""
  seen = []

  class Judge:
    def text(self, messages):
      seen.append(messages)
      return "[[A]]"

  prompt, cs = _prompt(4), [_completion("5"), _completion("3")]
  rubric_group_reward(Judge(), RubricRewardConfig(both_orders=True, max_parallel=1))(prompt, cs)
  pair = C.group_pairs(prompt, [c.text for c in cs], [1.0, 0.0], RUBRICS)[0]
  assert (pair.better, pair.worse) == ("5", "3")
  first = C.verdict_messages(pair, better_first=True)
  second = C.verdict_messages(pair, better_first=False)
  assert sorted([first[:-1], second[:-1]], key=str) == sorted(seen, key=str)  # (5, 3) and (3, 5): both orders
  assert first[:-1] == seen[0] and parse_verdict(first[-1]["content"]) == "A"
  assert parse_verdict(second[-1]["content"]) == "B"  # the better answer shown second
  assert parse_verdict(C.verdict_messages(pair, True, verdict_correct=False)[-1]["content"]) == "B"
  rows = C.render_rows(TOK, [first], 1, 400)
  judge_ids, _ = render_chat(seen[0], tokenizer=TOK, add_generation_prompt=True)  # what EngineJudge sends
  n = int(rows["segment_ids_BT"][0].sum())
  assert rows["tokens_BT"][0, : len(judge_ids)].tolist() == judge_ids
  trained = rows["tokens_BT"][0][rows["loss_mask_BT"][0] > 0].tolist()
  assert len(judge_ids) + len(trained) == n and rows["loss_mask_BT"][0, : len(judge_ids)].sum() == 0
  stop = EngineJudge(None, TOK)._stop
  assert trained[-1] in stop and TOK.decode(trained[:-1]) == "[[A]]"
  with pytest.raises(ValueError, match="critic.seq_len=50"):
    C.render_rows(TOK, [first], 1, 50)


def test_task_rubrics_replace_the_rubric_rewards():
  """`critic.rubrics` ('|'-separated) are the only rubrics the critic's examples show (none mandatory), the
  prompt's own rubrics after them; the layout stays the rubric reward's, a few dozen tokens instead of ~300."""
  refiner = _refiner(rubrics="The answer is the correct number. | No words, only the number.")
  p4 = Prompt("arith/4", "arith", tuple(TOK.encode("1+4")), "1+4", {"answer": "5", "rubrics": ["Be exact."]})
  groups = [(_prompt(2), [_completion("3"), _completion("7")]), (p4, [_completion("5"), _completion("9")])]
  pairs = refiner.take(_scored(refiner, groups))
  assert [p.rubrics for p in pairs] == [
    "- The answer is the correct number.\n- No words, only the number.",
    "- The answer is the correct number.\n- No words, only the number.\n- Be exact.",
  ]
  short = render_chat(C.verdict_messages(pairs[0], True), tokenizer=TOK)[0]
  default = C.group_pairs(_prompt(2), ["3", "7"], [1.0, 0.0], RUBRICS)[0]
  full = render_chat(C.verdict_messages(default, True), tokenizer=TOK)[0]
  assert len(short) < 160 < 300 < len(full)
  assert C.verdict_messages(pairs[0], True)[0]["content"] == C.verdict_messages(default, True)[0]["content"].replace(
    RUBRICS, pairs[0].rubrics
  )
  with pytest.raises(ValueError, match="CriticConfig.rubrics"):
    C.CriticConfig(coef=1.0, rubrics=" | ")


def test_heldout_pairs_are_never_trained_on():
  refiner = _refiner(heldout_fraction=0.3)
  all_wrong = [str(d) for d in range(10)]
  heldout_keys, train_keys, evaluated = set(), set(), 0
  for it in range(6):
    groups = [(_prompt(b), [_completion(t) for t in [str(b + 1)] + all_wrong[it : it + 4]]) for b in range(9)]
    train, evals, info = refiner.prepare(_scored(refiner, groups), it)
    assert info["critic_pairs"] > 0 and 0 < info["critic_pairs_heldout"] < info["critic_pairs"]
    # Decode every train row back to its pair: no train row is a held-out pair (in either order).
    for r in range(info["critic_train_rows"]):
      text = TOK.decode(train["tokens_BT"][r][train["segment_ids_BT"][r] > 0].tolist())
      train_keys.add(_key_of(text))
    for r in range(0, 4 * info["eval_pairs"], 4):
      text = TOK.decode(evals["tokens_BT"][r][evals["segment_ids_BT"][r] > 0].tolist())
      heldout_keys.add(_key_of(text))
    evaluated += info["eval_pairs"]
    assert info["critic_train_rows"] == 8 and train["loss_mask_BT"].sum() > 0
  assert evaluated > 0 and heldout_keys and train_keys and not (heldout_keys & train_keys)
  # The split is a function of the content alone: the same pairs are held out in every order and call.
  pairs = C.group_pairs(_prompt(2), ["3", "1", "4", "8", "0", "9"], [1, 0, 0, 0, 0, 0], RUBRICS)
  frac = np.mean([C.is_heldout(p, 0.3) for p in pairs])
  swapped = [C.Pair(p.task, p.question, p.rubrics, p.worse, p.better, 0.0, 1.0) for p in pairs]
  assert [C.is_heldout(p, 0.3) for p in pairs] == [C.is_heldout(p, 0.3) for p in swapped]
  many = [C.Pair("t", f"q{i}", "", "a", "b", 1.0, 0.0) for i in range(4000)]
  assert abs(np.mean([C.is_heldout(p, 0.3) for p in many]) - 0.3) < 0.03, frac


def _key_of(rendered: str) -> tuple:
  """(question, {answer A, answer B}) of a rendered judge chat."""
  question = rendered.split("[Prompt]\n")[1].split("\n[Rubrics]")[0]
  a = rendered.split("[Answer A]\n")[1].split("\n[Answer B]")[0]
  b = rendered.split("[Answer B]\n")[1].split("\nReason briefly")[0]
  return question, frozenset((a, b))


def test_pairs_unique_and_replayed_from_earlier_batches():
  """A group with one wrong answer gives K-1 copies of one pair: trained as one. Rows are drawn from the batch's
  unique training pairs and up to `replay_pairs` of earlier batches' (newest kept); held-out pairs never enter."""
  refiner = _refiner(heldout_fraction=0.3, replay_pairs=5, batch_size=64)
  groups = [(_prompt(b), [_completion(t) for t in [str(b + 1), "0", "9"]]) for b in range(1, 8)]
  _, _, info = refiner.prepare(_scored(refiner, groups), 0)
  first = [p for p in refiner._replay.values()]
  assert info["critic_pairs_replayed"] == 0 and len(first) == 5  # 5 newest of the batch's training pairs
  assert not any(C.is_heldout(p, 0.3) for p in first)
  # The next batch: one group, one wrong answer among four right ones -> 4 copies of one pair.
  b = next(
    b for b in range(20, 60) if not C.is_heldout(C.group_pairs(_prompt(b), [str(b + 1), "x"], [1, 0], "")[0], 0.3)
  )
  dup = [(_prompt(b), [_completion(t) for t in [str(b + 1)] * 4 + ["x"]])]
  train, _, info = refiner.prepare(_scored(refiner, dup), 1)
  assert info["critic_pairs"] == 4 and info["critic_pairs_unique"] == 1 and info["critic_pairs_replayed"] == 5
  assert info["critic_train_rows"] == 2 * (1 + 5)  # both orders of the batch's pair and of the 5 replayed
  seen = set()
  for r in range(info["critic_train_rows"]):
    text = TOK.decode(train["tokens_BT"][r][train["segment_ids_BT"][r] > 0].tolist())
    seen.add(_key_of(text))
  assert len(seen) == 6 and (f"1+{b}", frozenset((str(b + 1), "x"))) in seen
  assert len(refiner._replay) == 5 and list(refiner._replay.values())[-1].worse == "x"  # newest last
  assert first[0].key not in refiner._replay  # the oldest went
  # replay_pairs=0: the batch's pairs only
  off = _refiner(replay_pairs=0, batch_size=64)
  off.prepare(_scored(off, groups), 0)
  _, _, info = off.prepare(_scored(off, dup), 1)
  assert info["critic_pairs_replayed"] == 0 and info["critic_train_rows"] == 2 and not off._replay


def test_only_batch_groups_of_verifiable_tasks():
  refiner = _refiner()
  groups = [(_prompt(4), [_completion("5"), _completion("3")])]
  chat = Prompt("chat/0", "chat", (7, 8), "hi", {})
  refiner.recording(lambda p, cs: [RewardResult(float(i), "") for i in range(len(cs))])(
    chat, [_completion("a"), _completion("b")]
  )
  refiner.recording(_exact)(_prompt(6), [_completion("7"), _completion("1")])  # scored, not in this batch
  assert [(p.better, p.worse) for p in refiner.take(_scored(refiner, groups))] == [("5", "3")]
  assert refiner.take(_batch(groups)) == []  # taken once
  with pytest.raises(ValueError, match="no task of .* has a verifiable reward"):
    C.CriticRefiner(C.CriticConfig(coef=1.0), TOK, RUBRIC, {"chat": "rubric"})


def test_rows_depend_on_the_batch_not_on_the_order_groups_were_scored():
  """Reward threads record groups in whatever order they finish: the train rows, the held-out rows scored and the
  counts of every iteration are the same whatever that order (the batch's own order, uid, decides), so two runs
  of one seed log the same critic_agreement."""
  batches = []
  for it in range(4):  # four iterations: the replay carries each one's pairs into the next
    groups = [
      (_prompt(b), [_completion(t) for t in [str(b + 1), str((b + it) % 10), "x", str(9 - b)]]) for b in range(9)
    ]
    batches.append(groups + [groups[2]])  # one group twice (same prompt, same answers): its pairs once
  runs = []
  for order in (None, 1, 2):
    refiner, out = _refiner(heldout_fraction=0.3, batch_size=16, eval_pairs=3, replay_pairs=12), []
    for it, groups in enumerate(batches):
      scored = (
        list(groups)
        if order is None
        else [groups[i] for i in np.random.default_rng([order, it]).permutation(len(groups))]
      )
      reward = refiner.recording(_exact)
      for p, cs in scored:
        reward(p, cs)
      train, evals, info = refiner.prepare(_batch(groups), it)
      out.append((train, evals, info))
    runs.append(out)
  first = runs[0]
  assert sum(info["eval_pairs"] for _, _, info in first) > 0 and all(i["critic_train_rows"] == 16 for *_, i in first)
  assert first[-1][2]["critic_pairs_replayed"] > 0  # the replay took part
  for other in runs[1:]:
    for (t0, e0, i0), (t1, e1, i1) in zip(first, other):
      assert i0 == i1
      for k in t0:
        np.testing.assert_array_equal(t0[k], t1[k])
        np.testing.assert_array_equal(e0[k], e1[k])


def test_agreement_by_hand():
  assert C.agreement([-1.0, -2.0, -3.0, -4.0], [-2.0, -1.0, -3.0, -9.0]) == pytest.approx((1 + 0 + 0.5 + 1) / 4)
  assert np.isnan(C.agreement([], []))
  # Through `metrics`: 2 held-out pairs, rows [better-first: correct, wrong, worse-first: correct, wrong].
  refiner = _refiner()
  evals = {"loss_mask_BT": np.zeros((16, 5), np.float32)}
  evals["loss_mask_BT"][:8, 2:4] = 1.0  # the verdict tokens of the 8 real rows
  lp = np.full((16, 5), -9.0, np.float32)
  lp[:8, 2:4] = np.array(
    [[-0.1, -0.1], [-1.0, -1.0], [-2.0, -2.0], [-0.5, -0.5], [-0.2, -0.3], [-0.2, -0.3]] + [[-1, -1]] * 2
  )
  # sequence log-probs: pair 0: (-0.2 vs -2.0) agree, (-4.0 vs -1.0) disagree; pair 1: (-0.5 vs -0.5) tie, (-2 vs -2) tie
  m = refiner.metrics(evals, {"critic_pairs": 5, "eval_pairs": 2}, lp)
  assert m["critic_agreement"] == pytest.approx((1 + 0 + 0.5 + 0.5) / 4)
  assert m["critic_margin"] == pytest.approx(((-0.2 + 2.0) + (-4.0 + 1.0) + 0 + 0) / 4)
  assert m["critic_pairs_scored"] == 2 and m["critic_pairs"] == 5
  # A judge blind to content, or always naming one position, is at chance exactly: both orders are scored.
  lp_a = np.zeros((16, 5), np.float32)
  lp_a[0::4, 2], lp_a[1::4, 2], lp_a[2::4, 2], lp_a[3::4, 2] = -0.1, -2.0, -2.0, -0.1  # "[[A]]" always likelier
  assert refiner.metrics(evals, {"eval_pairs": 2}, lp_a)["critic_agreement"] == 0.5


def test_config_section():
  from k2jax.rl.learner import from_config_dict

  spec = importlib.util.spec_from_file_location("rl_config_file_critic", os.path.join(ROOT, "configs", "rl.py"))
  rl_configs = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rl_configs)
  c = rl_configs.get_config("tiny")
  assert from_config_dict(c, "/tmp/w", (TOK.eos_id,)).critic is None  # off by default
  c.unlock()
  c.critic.coef, c.critic.batch_size = 0.5, 8
  lc = from_config_dict(c, "/tmp/w", (TOK.eos_id,))
  assert lc.critic == C.CriticConfig(coef=0.5, batch_size=8, seq_len=512, heldout_fraction=0.2, eval_pairs=8, seed=0)
  c.critic.rubrics = "The answer is correct.|Only the number."
  assert from_config_dict(c, "/tmp/w", (TOK.eos_id,)).critic.rubric_list == (
    "The answer is correct.",
    "Only the number.",
  )
  c.critic.heldout_fraction = 1.0
  with pytest.raises(ConfigError, match="critic.heldout_fraction"):
    from_config_dict(c, "/tmp/w", (TOK.eos_id,))


def test_rl_step_adds_the_critic_term():
  """loss = K2 objective + coef * token-mean NLL of the critic rows' verdict tokens; gradients flow from it."""
  import jax
  import optax
  from flax import nnx

  from k2jax.model import K2Model, presets
  from k2jax.rl import rl_step
  from k2jax.rl.algo import K2LossConfig, ptx_loss
  from k2jax.train.step import ModelDef, init_state

  cfg = presets.get("tiny", num_hidden_layers=1)
  opt = optax.sgd(0.0)
  make = lambda: K2Model(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  state = init_state(make(), opt)
  mdef = ModelDef.from_model(nnx.eval_shape(make))
  rng = np.random.default_rng(0)
  batch = {
    "tokens_BT": rng.integers(1, 100, (4, 8)).astype(np.int32),
    "segment_ids_BT": np.ones((4, 8), np.int32),
    "loss_mask_BT": np.ones((4, 8), np.float32),
    "rewards_B": np.array([1, 0, 1, 0], np.float32),
    "group_ids_B": np.array([0, 0, 1, 1], np.int32),
    "sample_mask_B": np.ones(4, np.float32),
  }
  critic = {
    "tokens_BT": rng.integers(1, 100, (2, 12)).astype(np.int32),
    "segment_ids_BT": np.ones((2, 12), np.int32),
    "loss_mask_BT": (np.arange(12)[None] >= 9).repeat(2, 0).astype(np.float32),
  }
  lp = rl_step.make_logprobs_fn(mdef)
  old = lp(state.params, state.bias, batch["tokens_BT"], batch["segment_ids_BT"])
  base, _, _ = rl_step.make_rl_grads(mdef, K2LossConfig(), num_groups=2)(state.params, state.bias, batch, old, None)
  grads = rl_step.make_rl_grads(mdef, K2LossConfig(), num_groups=2, critic_coef=0.25)
  loss, aux, g = jax.jit(grads)(state.params, state.bias, batch, old, None, critic)
  nll = ptx_loss(lp(state.params, state.bias, critic["tokens_BT"], critic["segment_ids_BT"]), critic["loss_mask_BT"])
  assert float(aux["critic_loss"]) == pytest.approx(float(nll), rel=1e-5) and float(nll) > 1.0
  assert float(loss) == pytest.approx(float(base) + 0.25 * float(nll), rel=1e-5)
  assert float(np.abs(np.asarray(g["lm_head"]["w"])).max()) > 0
  with pytest.raises(ValueError, match="critic rows are required iff critic_coef > 0"):
    grads(state.params, state.bias, batch, old, None, None)


def test_short_layout_is_the_rubric_rewards_and_the_critics():
  """`RubricRewardConfig.layout='short'`: the judge sees the prompt, the two answers and "[[A]] or [[B]]?" (no
  rubrics), and the critic's training and held-out rows are exactly that chat; unknown layouts are refused."""
  seen = []

  class Judge:
    def text(self, messages):
      seen.append(messages)
      return "[[B]]"

  short = RubricRewardConfig(layout="short", both_orders=False, max_parallel=1)
  prompt, cs = _prompt(4), [_completion("5"), _completion("3")]
  results = rubric_group_reward(Judge(), short)(prompt, cs)
  assert seen == [[{"role": "user", "content": "1+4\n[[A]] 5\n[[B]] 3\n[[A]] or [[B]]?"}]]
  assert [r.reward for r in results] == [0.0, 1.0]
  refiner = C.CriticRefiner(
    C.CriticConfig(coef=1.0, batch_size=4, seq_len=48, eval_pairs=2), TOK, short, {"arith": "exact"}
  )
  pairs = refiner.take(_scored(refiner, [(prompt, cs)]))
  assert [(p.better, p.worse, p.layout) for p in pairs] == [("5", "3", "short")]
  assert C.verdict_messages(pairs[0], True)[:-1] == seen[0]
  assert C.verdict_messages(pairs[0], False)[0]["content"] == "1+4\n[[A]] 3\n[[B]] 5\n[[A]] or [[B]]?"
  ids, _ = render_chat(C.verdict_messages(pairs[0], True), tokenizer=TOK)
  assert len(ids) < 48  # vs 316 in the rubric layout (test_task_rubrics_replace_the_rubric_rewards)
  with pytest.raises(ValueError, match=r"unknown judge layout 'long'; choices: \('rubric', 'short'\)"):
    RubricRewardConfig(layout="long")
  with pytest.raises(ValueError, match="critic.rubrics=.*judge_layout='short'"):
    C.CriticRefiner(C.CriticConfig(coef=1.0, rubrics="Be right."), TOK, short, {"arith": "exact"})


def test_judge_layout_config():
  from k2jax.rl.learner import from_config_dict

  spec = importlib.util.spec_from_file_location("rl_config_file_layout", os.path.join(ROOT, "configs", "rl.py"))
  rl_configs = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rl_configs)
  c = rl_configs.get_config("tiny")
  assert from_config_dict(c, "/tmp/w", (TOK.eos_id,)).task_runtime.reward.rubric.layout == "rubric"  # the default
  c.unlock()
  c.reward.judge_layout = "short"
  assert from_config_dict(c, "/tmp/w", (TOK.eos_id,)).task_runtime.reward.rubric.layout == "short"
  c.reward.judge_layout = "long"
  with pytest.raises(ConfigError, match=r"reward.judge_layout.*one of \('rubric', 'short'\), got 'long'"):
    from_config_dict(c, "/tmp/w", (TOK.eos_id,))
