"""The RL learner end to end on the tiny model with the embedded engine (one compiled run shared by all tests).

The module fixture runs configs/rl.py:tiny, shortened, once; the tests then check what it wrote (metrics,
checkpoints, `k2jax.load`), the rising reward, weight sync into the engine, and that bad samples never
reach the gradient. Tests that change the learner's state run last.
"""

import dataclasses
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k2jax
from k2jax.data.tokenizer import load_tokenizer
from k2jax.rl import batching
from k2jax.engine.base import GenerateRequest, SamplingParams
from k2jax.engine.http import HttpEngine
from k2jax.engine.routed import RoutedEngine
from k2jax.rl.learner import Learner, from_config_dict
from k2jax.rl.rollout_engine import make_engine
from k2jax.rl.tasks import ArithmeticTask, strip_stop

from tests.engine.fake_sglang_server import FakeSglangServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("rl_config_file", os.path.join(ROOT, "configs", "rl.py"))
rl_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rl_configs)

ITERATIONS = 40
# One compiled RL run (~2 min on 2 cores) shared by the module; its hundreds of steps run at LLVM level 1.
pytestmark = [pytest.mark.slow, pytest.mark.optimized]


def _config(**overrides):
  c = rl_configs.get_config("tiny")
  c.unlock()
  c.iterations, c.eval.every, c.checkpoint.every = ITERATIONS, 20, 15
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  c.lock()
  return c


def _learner(config, workdir):
  tok = load_tokenizer()
  lc = from_config_dict(config, str(workdir), (tok.eos_id,))
  task = ArithmeticTask(lc.task, tok.encode, tok.eos_id)
  return Learner(lc, str(workdir), task, strip_stop(tok.decode, lc.rollout.stop_token_ids))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("rl")
  learner = _learner(_config(), workdir)
  learner.train()
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  yield learner, workdir, records
  learner.close()


def test_metrics_and_checkpoints(run):
  learner, workdir, records = run
  warm, rl = records[0], records[1:]
  assert warm["phase"] == "warm_start" and warm["loss"] < warm["warm_start_loss_first"]
  assert [r["step"] for r in rl] == list(range(1, ITERATIONS + 1))
  for key in (
    "reward_mean",
    "reward_std",
    "response_length_mean",
    "truncation_rate",
    "qk_clipped_heads",
    "max_attn_logit",
    "staleness_mean",
    "rollout_time_s",
    "train_time_s",
    "sync_time_s",
    "trainer_idle_fraction",
    "dropped_samples",
    "rl_loss",
    "ptx_loss",
    "weight_version",
    "updates_dropped",
    "updates_nonfinite",
    "dropped_updates",
    "nonfinite_updates",
    "rollout_reward_timeouts",
  ):
    assert all(np.isfinite(r[key]) for r in rl), key
  # Drops (no signal) and non-finite skips are counted apart; together they are the steps not applied.
  assert [r["dropped_updates"] for r in rl] == np.cumsum([r["updates_dropped"] for r in rl]).tolist()
  assert rl[-1]["skipped_steps"] == rl[-1]["dropped_updates"] + rl[-1]["nonfinite_updates"]
  assert all(r["dropped_samples"] == 0 and r["samples_trained"] == learner.lc.rows for r in rl)
  assert all(0 < r["trainer_idle_fraction"] < 1 for r in rl)
  # Every update is pushed: versions rise by one per iteration and the engine serves the newest.
  versions = [r["weight_version"] for r in rl]
  assert versions == list(range(versions[0], versions[0] + ITERATIONS))
  assert learner.engine.weight_version == learner.sync.version == versions[-1]
  # Checkpoints every 15 iterations and at the end (keep 2); `k2jax.load(W)` gives the trained model.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")), key=int) == ["30", "40"]
  loaded = k2jax.load(str(workdir))
  np.testing.assert_array_equal(np.asarray(loaded.lm_head.w[...]), np.asarray(learner.state.params["lm_head"]["w"]))


def test_reward_rises(run):
  _, _, records = run
  rl = records[1:]
  first = np.mean([r["reward_mean"] for r in rl[:5]])
  last = np.mean([r["reward_mean"] for r in rl[-5:]])
  assert first < 0.25, first  # the warm start alone is near chance (1/9)
  assert last > first + 0.15, (first, last)
  assert records[0]["eval_accuracy"] < rl[-1]["eval_accuracy"]


def test_resume_restores_state(run, tmp_path):
  learner, workdir, _ = run
  again = _learner(_config(), workdir)
  try:
    assert again.meta["iteration"] == ITERATIONS and again.meta["warm_start_done"]
    assert again.meta["dropped_updates"] == learner.meta["dropped_updates"]
    assert again.sync.version == learner.sync.version
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), again.state.params, learner.state.params)
    assert all(jax.tree.leaves(same))
    assert again.train() == {}  # nothing left to do; the engine got the restored weights
    assert again.engine.weight_version == learner.sync.version + 1
  finally:
    again.close()


def test_engine_logprobs_match_trainer(run):
  """loss.old_logprobs='engine' is sound here: the engine's sampling logprobs (temperature 1) equal the
  trainer's recomputation on every token sampled with the current weights."""
  learner, _, records = run
  lc = learner.lc
  batch, _ = learner.manager.collect(learner.sync.version)
  arrays, dropped = batching.to_train_arrays(
    batch, rows=lc.rows, seq_len=lc.seq_len, vocab_size=lc.model.vocab_size, version=learner.sync.version
  )
  assert not dropped
  lp = np.asarray(
    learner.logprobs_fn(learner.state.params, learner.state.bias, arrays["tokens_BT"], arrays["segment_ids_BT"])
  )
  versions = np.full(arrays["tokens_BT"].shape, -1)
  versions[: len(batch.rewards_B), : batch.tokens_BT.shape[1]] = batch.weight_versions_BT[:, : lc.seq_len]
  current = (arrays["loss_mask_BT"] > 0) & (versions == learner.sync.version)
  assert current.sum() > lc.rows  # most tokens are fresh (a few resume from the previous version)
  np.testing.assert_allclose(lp[current], arrays["engine_logprobs_BT"][current], atol=2e-4)
  gaps = [r["engine_logprob_max_abs_diff"] for r in records if "reward_mean" in r]  # the same, logged per iteration
  assert len(gaps) == ITERATIONS and max(gaps) <= 2e-4


def test_engine_url_switch(run):
  """One flag picks an HTTP engine (SGLang); with worker URLs, a router client that controls each worker."""
  learner, workdir, _ = run
  with FakeSglangServer(learner.engine) as server:
    lc = from_config_dict(_config(**{"rollout.engine_url": server.url}), str(workdir), (3841,))
    engine = make_engine(lc, learner.state, learner.decode)
    assert isinstance(engine, HttpEngine)
    lc = from_config_dict(
      _config(**{"rollout.engine_url": server.url, "rollout.worker_urls": f"{server.url},{server.url}"}),
      str(workdir),
      (3841,),
    )
    routed = make_engine(lc, learner.state, learner.decode)
    assert isinstance(routed, RoutedEngine) and len(routed.workers) == 2
    prompt = learner.task.prompt(0)
    res = engine.generate(GenerateRequest("url/0", prompt.input_ids, SamplingParams(max_new_tokens=3)))
    assert 1 <= len(res.output_ids) <= 3 and res.weight_versions[0] == learner.engine.weight_version
    routed.close()


def test_weight_sync_changes_engine_outputs(run):
  """A push bumps the engine's version, and it then serves exactly the trainer's new weights."""
  learner, _, _ = run
  lc = learner.lc
  prompt = learner.task.prompt(1)
  greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
  before = learner.engine.generate(GenerateRequest("sync/before", prompt.input_ids, greedy))
  version = learner.sync.version
  params = learner.state.params
  learner.state = learner.state._replace(params={**params, "lm_head": {"w": params["lm_head"]["w"] * 3.0}})
  assert learner._push() == version + 1
  assert not os.path.exists(learner.lc.sync.root)  # the embedded engine got device arrays: no file
  after = learner.engine.generate(GenerateRequest("sync/after", prompt.input_ids, greedy))
  assert learner.engine.weight_version == version + 1 and after.weight_versions == (version + 1,)
  assert abs(after.output_logprobs[0] - before.output_logprobs[0]) > 1e-3
  # The engine's logprob of its token equals the trainer's recomputation with the pushed weights.
  tokens = np.zeros((lc.rows, lc.seq_len), np.int32)
  segments = np.zeros_like(tokens)
  ids = list(prompt.input_ids) + list(after.output_ids)
  tokens[0, : len(ids)], segments[0, : len(ids)] = ids, 1
  lp = learner.logprobs_fn(learner.state.params, learner.state.bias, tokens, segments)
  np.testing.assert_allclose(float(lp[0, len(ids) - 1]), after.output_logprobs[0], atol=1e-4)


def test_bad_samples_are_dropped_and_counted(run):
  learner, _, records = run
  lc = learner.lc
  batch, _ = learner.manager.collect(learner.sync.version)
  # Sample 0's logprob list is one entry short of its response (the sglang-jax class of bug, assembled).
  end = int(batch.prompt_lengths_B[0] + batch.response_lengths_B[0]) - 1
  mask, lp = batch.loss_mask_BT.copy(), batch.engine_logprobs_BT.copy()
  mask[0, end], lp[0, end] = 0.0, 0.0
  bad = dataclasses.replace(batch, loss_mask_BT=mask, engine_logprobs_BT=lp)
  arrays, dropped = batching.to_train_arrays(
    bad, rows=lc.rows, seq_len=lc.seq_len, vocab_size=lc.model.vocab_size, version=learner.sync.version
  )
  assert dropped["samples"] == 1 and dropped["span"] == 1 and arrays["sample_mask_B"][0] == 0
  # Its content cannot move the weights: garbage in the bad row gives the same update (up to the
  # summation order of the MoE expert gradients, which depends on how all tokens sort by expert).
  garbage = dict(arrays, tokens_BT=arrays["tokens_BT"].copy(), rewards_B=arrays["rewards_B"].copy())
  garbage["tokens_BT"][0] = 7
  garbage["rewards_B"][0] = 1e6
  # On the mesh as the learner places them (host arrays would be another input signature: a 14 s compile)
  arrays, garbage, ptx = (learner._on_mesh(a) for a in (arrays, garbage, learner.ptx.batch(0)))
  old = learner.logprobs_fn(learner.state.params, learner.state.bias, arrays["tokens_BT"], arrays["segment_ids_BT"])
  copy = lambda: jax.tree.map(jnp.copy, learner.state)
  s1, m1 = learner.rl_step(copy(), arrays, old, ptx)
  s2, m2 = learner.rl_step(copy(), garbage, old, ptx)
  assert float(m1["samples_trained"]) == lc.rows - 1
  assert float(m1["loss"]) == float(m2["loss"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), s1.params, s2.params)
  # Through the learner: the iteration's metrics count the dropped sample.
  learner.manager.collect = lambda version: (bad, {})
  rec = learner.iteration()
  assert rec["dropped_samples"] == 1 and rec["dropped_span"] == 1 and rec["samples_trained"] == lc.rows - 1


def test_embedded_engine_rejects_foreign_tensors(run, tmp_path):
  from safetensors.numpy import save_file

  learner, _, _ = run
  for name, tensor, match in (
    ("model.layers.99.mlp.gate.weight", np.zeros((8, 64), np.float32), "not a parameter"),
    ("lm_head.weight", np.zeros((5, 64), np.float32), "has shape"),
  ):
    d = tmp_path / name.replace(".", "_")
    d.mkdir()
    save_file({name: tensor}, str(d / "model-00001-of-00001.safetensors"))
    (d / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors"}})
    )
    version = learner.engine.weight_version
    with pytest.raises(ValueError, match=match):
      learner.engine.update_weights(str(d), version + 1)
    assert learner.engine.weight_version == version
