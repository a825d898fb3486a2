"""Learner parts without a model: config boundary errors, the sample checks, the task, the PTX set."""

import importlib.util
import json
import os

import numpy as np
import pytest

from k2jax.data.tokenizer import load_tokenizer
from k2jax.model.config import ConfigError
from k2jax.rl import batching
from k2jax.rl.rollout_batch import RolloutBatch
from k2jax.rl.learner import from_config_dict
from k2jax.rl.ptx import PTXConfig, PTXSet
from k2jax.grading.base import Completion
from k2jax.rl.tasks import ArithmeticTask, ArithmeticTaskConfig, MathJsonlTask, exact_answer_reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("rl_config_file", os.path.join(ROOT, "configs", "rl.py"))
rl_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rl_configs)


def _config(**overrides):
  c = rl_configs.get_config("tiny")
  c.unlock()
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


def test_config_boundary(tmp_path):
  lc = from_config_dict(_config(), str(tmp_path), (3841,))
  assert lc.rows == 128 and lc.rollout.stop_token_ids == (3841,) and lc.engine_url == ""
  assert lc.sync.root == os.path.join(str(tmp_path), "weights") and lc.ptx is not None
  assert from_config_dict(_config(**{"loss.ptx_coef": 0.0}), str(tmp_path), (1,)).ptx is None
  for overrides, key in (
    ({"rollout.engine_url": "ftp://x"}, "rollout.engine_url"),
    ({"rollout.worker_urls": "http://a:1"}, "rollout.worker_urls"),
    ({"train.seq_len": 100000}, "train.seq_len"),
    ({"optim.updates_per_batch": 0}, "optim.updates_per_batch"),
    ({"model.init_from": str(tmp_path / "nothing")}, "model.init_from"),
    ({"task.kind": "chess"}, "task.kind"),
    ({"task.kind": "math_jsonl", "task.path": "/nope.jsonl"}, "task.path"),
    ({"task.kind": "math_jsonl", "task.path": __file__}, "warm_start.steps"),
    ({"rollout.engine": "vllm"}, "rollout.engine"),
    ({"rollout.engine": "sglang_jax_colocated", "rollout.engine_url": "http://a:1"}, "rollout.engine"),
  ):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
      from_config_dict(_config(**overrides), str(tmp_path), (1,))
  sgl = {"rollout.engine": "sglang_jax_colocated", "sglang_jax.precompile_bs_paddings": "1,8"}
  lc = from_config_dict(_config(**sgl), str(tmp_path), (1,))
  assert lc.rollout_engine == "sglang_jax_colocated" and lc.sglang_jax.precompile_bs_paddings == (1, 8)
  assert lc.sglang_jax.precompile_token_paddings == (256,) and lc.sglang_jax.device == "cpu"
  with pytest.raises(ValueError, match="old_logprobs"):
    from_config_dict(_config(**{"loss.old_logprobs": "magic"}), str(tmp_path), (1,))
  with pytest.raises(ValueError, match="target_groups"):
    from_config_dict(_config(**{"rollout.launch_groups": 4}), str(tmp_path), (1,))


def test_mesh_levels_reach_the_trainer(tmp_path):
  """Stages are refused (the RL update does not pipeline); the DCN level reaches the mesh builder: on one
  process (one slice) two slices cannot form, where a flat mesh would have hidden the layout."""
  from k2jax import sharding
  from k2jax.rl.learner import Learner

  tok = load_tokenizer()
  task = ArithmeticTask(ArithmeticTaskConfig(1, 1, 0, 8, seed=3, template="{a}+{b}"), tok.encode, tok.eos_id)
  with pytest.raises(ConfigError, match=r"mesh.stage / mesh.dcn_stage: 2 / 1: the RL update runs"):
    Learner(from_config_dict(_config(**{"mesh.stage": 2}), str(tmp_path), (1,)), str(tmp_path), task, None)
  with pytest.raises(sharding.ShardingError, match=r"2 slices asked for, the devices form 1"):
    Learner(from_config_dict(_config(**{"mesh.dcn_data": 2}), str(tmp_path), (1,)), str(tmp_path), task, None)


def _batch():
  """Two samples: prompt [5, 6] + response [7, 8] and prompt [5] + response [9]."""
  tokens = np.array([[5, 6, 7, 8], [5, 9, 0, 0]], np.int32)
  return RolloutBatch(
    tokens_BT=tokens,
    segment_ids_BT=(np.arange(4) < np.array([[4], [2]])).astype(np.int32),
    loss_mask_BT=np.array([[0, 0, 1, 1], [0, 1, 0, 0]], np.float32),
    engine_logprobs_BT=np.array([[0, 0, -0.5, -1.0], [0, -0.1, 0, 0]], np.float32),
    weight_versions_BT=np.array([[-1, -1, 3, 3], [-1, 2, -1, -1]], np.int32),
    rewards_B=np.array([1.0, 0.0], np.float32),
    group_ids_B=np.array([0, 0], np.int32),
    prompt_lengths_B=np.array([2, 1], np.int32),
    response_lengths_B=np.array([2, 1], np.int32),
    truncated_B=np.zeros(2, bool),
    tasks=("arith", "arith"),
    iteration=0,
    temperature=1.0,
  )


@pytest.mark.parametrize(
  "corrupt, check",
  [
    (lambda b: b.loss_mask_BT.__setitem__((0, 3), 0.0), "span"),  # logprobs one short of the response
    (lambda b: b.engine_logprobs_BT.__setitem__((0, 2), np.nan), "logprob"),
    (lambda b: b.engine_logprobs_BT.__setitem__((0, 2), 0.5), "logprob"),
    (lambda b: b.engine_logprobs_BT.__setitem__((0, 0), -0.3), "logprob"),  # a logprob on a prompt token
    (lambda b: b.weight_versions_BT.__setitem__((0, 3), -1), "version"),
    (lambda b: b.weight_versions_BT.__setitem__((0, 3), 9), "version"),  # newer than the trainer
    (lambda b: b.tokens_BT.__setitem__((0, 1), 4096), "token"),
    (lambda b: b.rewards_B.__setitem__(0, np.inf), "reward"),
  ],
)
def test_each_check_drops_and_counts(corrupt, check):
  batch = _batch()
  corrupt(batch)
  arrays, dropped = batching.to_train_arrays(batch, rows=4, seq_len=8, vocab_size=4096, version=3)
  assert dropped == {"samples": 1, check: 1}
  np.testing.assert_array_equal(arrays["sample_mask_B"], [0, 1, 0, 0])
  assert not arrays["tokens_BT"][0].any() and not arrays["loss_mask_BT"][0].any()
  np.testing.assert_array_equal(arrays["tokens_BT"][1, :2], [5, 9])


def test_engine_logprob_gap_counts_only_trained_tokens_of_the_current_version():
  batch = _batch()
  arrays, _ = batching.to_train_arrays(batch, rows=2, seq_len=4, vocab_size=4096, version=3)
  trainer = arrays["engine_logprobs_BT"].copy()
  trainer[0, 2] -= 3e-5  # a version-3 response token
  trainer[1, 1] += 0.5  # sampled by version 2: pi_old of other weights, not a mismatch
  trainer[0, 1] += 0.7  # a prompt token
  assert batching.engine_logprob_gap(arrays, batch, trainer, 3) == pytest.approx(3e-5, rel=1e-3)
  assert batching.engine_logprob_gap(arrays, batch, trainer, 7) is None


def test_clean_batch_and_too_long():
  arrays, dropped = batching.to_train_arrays(_batch(), rows=4, seq_len=8, vocab_size=4096, version=3)
  assert not dropped and arrays["sample_mask_B"].tolist() == [1, 1, 0, 0]
  np.testing.assert_array_equal(arrays["loss_mask_BT"][0, :4], [0, 0, 1, 1])
  _, dropped = batching.to_train_arrays(_batch(), rows=4, seq_len=3, vocab_size=4096, version=3)
  assert dropped == {"samples": 1, "too_long": 1}
  with pytest.raises(ValueError, match="takes 1 rows"):
    batching.to_train_arrays(_batch(), rows=1, seq_len=8, vocab_size=4096, version=3)
  assert batching.staleness(_batch(), 3) == {
    "unknown_version_token_frac": 0.0,
    "staleness_mean": 1 / 3,
    "staleness_max": 1.0,
    "stale_token_frac": 1 / 3,
  }


def test_task_prompts_reward_and_format_examples():
  tok = load_tokenizer()
  task = ArithmeticTask(ArithmeticTaskConfig(1, 1, 0, 8, seed=3, template="{a}+{b}"), tok.encode, tok.eos_id)
  p = task.prompt(5)
  assert p == task.prompt(5) and p.text == f"1+{int(p.data['answer']) - 1}"
  assert tok.decode(p.input_ids) == p.text and len(task.all_prompts()) == 9
  ok = Completion((), " " + p.data["answer"] + " ", "stop", False)
  assert exact_answer_reward(p, ok).reward == 1.0
  assert exact_answer_reward(p, Completion((), p.data["answer"], "length", True)).reward == 0.0
  assert exact_answer_reward(p, Completion((), "x", "stop", False)).reward == 0.0
  # Warm-start answers are uniform over the answer range, independent of the prompt.
  examples = task.format_examples(2000, np.random.default_rng(0))
  right = sum(tok.decode(r[:-1]) == str(int(tok.decode(q)[2:]) + 1) for q, r in examples)
  assert all(r[-1] == tok.eos_id for _, r in examples)
  assert 0.07 < right / len(examples) < 0.16  # chance = 1/9
  with pytest.raises(ValueError, match="template"):
    ArithmeticTaskConfig(template="{a}")


def test_ptx_set(tmp_path):
  tok = load_tokenizer()
  path = tmp_path / "ptx.jsonl"
  path.write_text(
    "\n".join(
      json.dumps(r)
      for r in (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
        {"text": "plain text record"},
        {"text": "x"},
      )
    )
    + "\n"
  )
  ptx = PTXSet(PTXConfig(str(path), num_samples=8, batch_size=3, seq_len=64), tok)
  assert len(ptx) == 2  # the one-token record cannot be trained on
  b = ptx.batch(0)
  assert b["tokens_BT"].shape == (3, 64) and (b["tokens_BT"][0] == b["tokens_BT"][2]).all()
  chat_mask = b["loss_mask_BT"][0]
  assert 0 < chat_mask.sum() < b["segment_ids_BT"][0].sum()  # assistant tokens only
  assert b["loss_mask_BT"][1].sum() == b["segment_ids_BT"][1].sum() - 1
  bundled = PTXSet(PTXConfig("bundled", num_samples=4, batch_size=2, seq_len=16), tok)
  assert len(bundled) == 4 and bundled.mask_NT.sum() == 4 * 15
  path.write_text('{"neither": 1}\n')
  with pytest.raises(ValueError, match=r"ptx.jsonl:1: record has neither"):
    PTXSet(PTXConfig(str(path)), tok)


def test_math_jsonl_task(tmp_path):
  tok = load_tokenizer()
  path = tmp_path / "math.jsonl"
  path.write_text(
    '{"id": "q1", "question": "What is 2+3?", "answer": "5"}\n\n'
    '{"question": "Half of 1?", "answer": "\\\\frac{1}{2}", "system": "Box the answer."}\n'
  )
  task = MathJsonlTask(str(path), tok)
  p0, p1, p2 = task.prompt(0), task.prompt(1), task.prompt(2)
  assert p0.prompt_id == "math/q1/0" and p2.input_ids == p0.input_ids and p0.task == "math"
  assert tok.decode(p0.input_ids).endswith("assistant<|im_middle|>") and "What is 2+3?" in tok.decode(p0.input_ids)
  assert "Box the answer." in tok.decode(p1.input_ids) and len(task.all_prompts()) == 2
  assert task.reward(p1, Completion((), "so \\boxed{0.5}", "stop", False)).reward == 1.0
  assert task.reward(p0, Completion((), "\\boxed{6}", "stop", False)).reward == 0.0
  with pytest.raises(ValueError, match="warm start"):
    task.format_examples(1, np.random.default_rng(0))
  path.write_text('{"question": "no answer"}\n')
  with pytest.raises(ValueError, match=r"math.jsonl:1: a math record needs \[.answer.\]"):
    MathJsonlTask(str(path), tok)


def test_multi_turn_holes_are_kept_but_mask_outside_the_response_is_dropped():
  """Multi-turn samples mask tool results inside the response span: that is not a bad sample."""
  tokens = np.array([[5, 6, 7, 8, 9, 10]], np.int32)
  batch = RolloutBatch(
    tokens_BT=tokens,
    segment_ids_BT=np.ones((1, 6), np.int32),
    loss_mask_BT=np.array([[0, 1, 1, 0, 0, 1]], np.float32),  # turn 1, tool result, turn 2
    engine_logprobs_BT=np.array([[0, -0.2, -0.3, 0, 0, -0.1]], np.float32),
    weight_versions_BT=np.array([[-1, 3, 3, -1, -1, 3]], np.int32),
    rewards_B=np.array([1.0], np.float32),
    group_ids_B=np.array([0], np.int32),
    prompt_lengths_B=np.array([1], np.int32),
    response_lengths_B=np.array([5], np.int32),
    truncated_B=np.zeros(1, bool),
    tasks=("agent",),
    iteration=0,
    temperature=1.0,
  )
  assert batching.sample_problems(batch, 0, vocab_size=4096, seq_len=8, version=3) == []
  batch.loss_mask_BT[0, 0] = 1.0  # a prompt token in the loss
  assert "span" in batching.sample_problems(batch, 0, vocab_size=4096, seq_len=8, version=3)


def test_dry_run_1t_prints_the_pod_memory_plan():
  """configs/rl.py:1t: K2 itself, its RL update sharded as pretraining (EP 8 x FSDP 64) on v5p-1024."""
  from k2jax.rl.plan import dry_run

  lines = dict(line.split("=", 1) for line in dry_run(rl_configs.get_config("1t")).splitlines())
  assert int(lines["params_total"]) > 1.0e12 and int(lines["params_activated"]) > 3.0e10
  assert lines["topology"] == "v5p-1024" and lines["mesh"] == "data=1,fsdp=64,expert=8,tensor=1"
  assert lines["rules_preset"] == "fsdp_ep" and int(lines["num_devices"]) == 512
  # One forward/backward holds the 512 rollout rows and the 512 PTX rows of 4096 tokens: 8192 per chip.
  assert int(lines["batch_per_device_tokens"]) == 8192
  assert lines["fits"] == "True" and float(lines["total_gib_per_device"]) < 95
