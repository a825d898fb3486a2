"""Rollout manager: over-sampling stops at M groups, partial rollouts keep every token, budgets, staleness."""

import threading

import numpy as np
import pytest

from k2jax.engine.base import Engine
from k2jax.engine.fake import FakeEngine, FakeEngineConfig, token_at
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.grading.base import Prompt, RewardResult, per_sample
from k2jax.rl.rollout import RolloutConfig, RolloutManager, TemperatureSchedule

from tests.engine.fake_sglang_server import FakeSglangServer

P = 3  # prompt length
CFG = FakeEngineConfig(per_token_latency_s=1e-3, eos_id=1)


def _prompts(lengths, task="default"):
  """Prompt i has input_ids (i+2, 7, 7); `lengths[i]` is the response length of all its samples."""
  return [Prompt(f"p{i}", task, (i + 2, 7, 7)) for i in range(len(lengths))]


def _engine(lengths, cfg=CFG):
  def length_fn(req):
    return lengths[req.input_ids[0] - 2] - (len(req.input_ids) - P)

  return FakeEngine(cfg, length_fn)


class Recording(Engine):
  """Wraps an engine and records every request."""

  def __init__(self, inner):
    self.inner, self.requests, self._lock = inner, [], threading.Lock()

  def generate(self, request):
    with self._lock:
      self.requests.append(request)
    return self.inner.generate(request)

  def abort(self, rids):
    self.inner.abort(rids)

  def update_weights(self, model_path, weight_version):
    self.inner.update_weights(model_path, weight_version)


def _len_reward(prompt, c):
  return RewardResult(float(len(c.output_ids)), "length")


def _expected_tokens(sample_seed, n, eos=True):
  ids = [token_at(sample_seed, P + i, CFG) for i in range(n)]
  if eos:
    ids[-1] = CFG.eos_id
  return ids


def test_oversampling_stops_at_m_and_partial_tokens_resume_without_loss():
  lengths = [20, 20, 20, 300, 300, 300] + [20] * 30
  engine = Recording(_engine(lengths))
  cfg = RolloutConfig(
    group_size=2, target_groups=3, launch_groups=6, max_staleness=100, task_budgets=(("default", 1000),)
  )
  mgr = RolloutManager(cfg, engine, iter(_prompts(lengths)), per_sample(_len_reward))
  batch, stats = mgr.collect(weight_version=0)
  assert batch.num_groups == 3 and stats["groups_complete"] >= 3
  assert sorted(set(batch.tasks)) == ["default"] and set(batch.response_lengths_B) == {20}
  long_groups = [g for g in mgr.buffered_groups if g.prompt.prompt_id in ("p3", "p4", "p5")]
  assert len(long_groups) == 3 and stats["partial_tokens_kept"] > 0
  kept = {(g.uid, s.index): list(s.output_ids) for g in long_groups for s in g.samples}
  assert sum(map(len, kept.values())) == stats["partial_tokens_kept"]
  seen_long = {}
  for version in range(1, 40):
    engine.update_weights(f"/w/{version}", version)
    batch, stats = mgr.collect(weight_version=version)
    assert batch.num_groups == 3
    for b in range(batch.tokens_BT.shape[0]):
      pid = batch.tokens_BT[b, 0] - 2
      if lengths[pid] == 300:
        seen_long[b, version] = batch
    if len(seen_long) == 6:
      break
  assert len(seen_long) == 6, "long groups never completed"
  for (b, version), bt in seen_long.items():
    R = bt.response_lengths_B[b]
    assert R == 300
    seed = next(
      s.seed for g in long_groups for s in g.samples if g.prompt.input_ids[0] == bt.tokens_BT[b, 0] and s.index == b % 2
    )
    np.testing.assert_array_equal(bt.tokens_BT[b, P : P + R], _expected_tokens(seed, R))
    versions = bt.weight_versions_BT[b, P : P + R]
    assert versions[0] == 0 and versions[-1] >= 1 and np.all(np.diff(versions) >= 0)
    assert np.all(bt.engine_logprobs_BT[b, P : P + R] < 0) and bt.loss_mask_BT[b].sum() == R
  # Every resumed request continued exactly where the previous segment ended.
  for (uid, k), prefix in kept.items():
    g = next(g for g in long_groups if g.uid == uid)
    assert g.samples[k].output_ids[: len(prefix)] == prefix


def test_synchronous_mode_waits_for_all_and_drops_nothing():
  lengths = [5, 50, 5, 50]
  cfg = RolloutConfig(group_size=3, target_groups=4, launch_groups=4, partial_rollout=False)
  mgr = RolloutManager(cfg, _engine(lengths), iter(_prompts(lengths)), per_sample(_len_reward))
  batch, stats = mgr.collect(0)
  assert batch.tokens_BT.shape[0] == 12 and stats["samples_aborted"] == 0
  np.testing.assert_array_equal(batch.group_ids_B, np.repeat(np.arange(4), 3))
  np.testing.assert_array_equal(batch.rewards_B, batch.response_lengths_B)
  # Groups 0 and 2 finish first, yet the batch holds the groups in launch order (a run's rows must not
  # depend on which thread reports first).
  np.testing.assert_array_equal(batch.tokens_BT[:, 0], np.repeat([2, 3, 4, 5], 3))


def test_no_partial_rollout_discards_aborted_tokens():
  lengths = [10, 10, 500, 500] + [10] * 10
  cfg = RolloutConfig(group_size=2, target_groups=2, launch_groups=4, partial_rollout=False)
  mgr = RolloutManager(cfg, _engine(lengths), iter(_prompts(lengths)), per_sample(_len_reward))
  _, stats = mgr.collect(0)
  assert stats["tokens_discarded"] > 0 and stats["partial_tokens_kept"] == 0
  assert all(g.complete for g in mgr.buffered_groups)


def test_staleness_bound_restarts_old_samples():
  lengths = [10, 10, 400, 400] + [10] * 10
  cfg = RolloutConfig(group_size=2, target_groups=2, launch_groups=4, max_staleness=0)
  engine = _engine(lengths)
  mgr = RolloutManager(cfg, engine, iter(_prompts(lengths)), per_sample(_len_reward))
  _, stats = mgr.collect(0)
  carried = [s for g in mgr.buffered_groups for s in g.samples if s.output_ids]
  assert carried and stats["partial_tokens_kept"] > 0
  engine.update_weights("/w/1", 1)
  _, stats = mgr.collect(1)
  assert stats["stale_samples_restarted"] == len(carried)
  assert stats["stale_tokens_dropped"] >= sum(1 for _ in carried)
  for g in mgr.buffered_groups:
    for s in g.samples:
      assert all(v >= 1 for v in s.versions)


def test_budget_truncation_penalty_and_temperature_decay():
  lengths = [50, 5, 50, 5] * 3
  engine = Recording(_engine(lengths))
  sched = TemperatureSchedule(initial=1.2, final=0.6, half_life_iterations=1.0)
  cfg = RolloutConfig(
    group_size=2,
    target_groups=2,
    launch_groups=2,
    partial_rollout=True,
    task_budgets=(("math", 20),),
    truncation_penalty=0.5,
    temperature=sched,
  )
  mgr = RolloutManager(
    cfg, engine, iter(_prompts(lengths, task="math")), per_sample(lambda p, c: RewardResult(1.0, "ok"))
  )
  temps = []
  for it in range(3):
    batch, stats = mgr.collect(0)
    temps.append(stats["temperature"])
    long = batch.response_lengths_B == 20
    assert long.any() and (batch.truncated_B == long).all()
    np.testing.assert_allclose(batch.rewards_B, np.where(long, 0.5, 1.0))
  assert temps == pytest.approx([1.2, 0.9, 0.75])
  assert {r.sampling.temperature for r in engine.requests} == set(temps)
  assert max(r.sampling.max_new_tokens for r in engine.requests) == 20
  with pytest.raises(KeyError, match="no budget for task 'code'"):
    cfg.budget("code")


def test_resumed_requests_stay_within_budget():
  lengths = [10, 10, 60, 60] + [10] * 20
  engine = Recording(_engine(lengths))
  cfg = RolloutConfig(group_size=1, target_groups=2, launch_groups=4, task_budgets=(("default", 40),))
  mgr = RolloutManager(cfg, engine, iter(_prompts(lengths)), per_sample(_len_reward))
  for _ in range(12):
    mgr.collect(0)
  for r in engine.requests:
    assert (len(r.input_ids) - P) + r.sampling.max_new_tokens == 40


def test_rollout_over_http_server():
  lengths = [10, 10, 400, 400] + [10] * 10
  with FakeSglangServer(_engine(lengths)) as server:
    eng = HttpEngine(HttpEngineConfig(server.url, generate_timeout_s=10))
    cfg = RolloutConfig(group_size=2, target_groups=2, launch_groups=4, max_concurrency=16)
    mgr = RolloutManager(cfg, eng, iter(_prompts(lengths)), per_sample(_len_reward))
    batch, stats = mgr.collect(0)
    assert batch.num_groups == 2 and set(batch.response_lengths_B) == {10}
    assert sum(not s.done for g in mgr.buffered_groups for s in g.samples) == 4
    assert 1 <= stats["samples_aborted"] <= 4 and stats["partial_tokens_kept"] > 0
    assert server.calls["abort_request"] >= 4
    for g in mgr.buffered_groups:
      for s in g.samples:
        assert s.output_ids == _expected_tokens(s.seed, len(s.output_ids), eos=False)


def test_engine_error_propagates_and_stops_other_requests():
  lengths = [10, 5000, 5000, 5000]

  class Broken(Recording):
    def generate(self, request):
      if request.input_ids[0] == 2:
        raise RuntimeError("engine at http://x exploded")
      return super().generate(request)

  engine = Broken(_engine(lengths))
  cfg = RolloutConfig(group_size=1, target_groups=2, launch_groups=4, task_budgets=(("default", 6000),))
  mgr = RolloutManager(cfg, engine, iter(_prompts(lengths)), per_sample(_len_reward))
  with pytest.raises(RuntimeError, match="exploded"):
    mgr.collect(0)
