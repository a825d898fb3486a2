"""Partial rollouts against k2jax's own server: aborted at whatever point and resumed, a seeded sample is
token for token the uninterrupted request (sampling is keyed by (seed, position))."""

import threading

from k2jax.engine.base import EngineCapabilities, GenerateRequest, SamplingParams
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.grading.base import Prompt, RewardResult
from k2jax.rl.rollout import RolloutConfig, RolloutManager

BUDGET = 32


def test_handshake_names_k2jax_and_its_capabilities(served):
  caps = HttpEngine(HttpEngineConfig(served.server.url)).capabilities()
  assert caps == EngineCapabilities("k2jax", caps.server_version, ("disk",), True, True, True)
  assert caps.server_version


def test_resumed_request_continues_like_the_uninterrupted_one(served):
  client = HttpEngine(HttpEngineConfig(served.server.url))
  prompt = (11, 12, 13, 14)
  sampling = SamplingParams(max_new_tokens=BUDGET, temperature=1.0, seed=1234)
  full = client.generate(GenerateRequest("full", prompt, sampling))
  n = len(full.output_ids)
  for cut in (1, n // 3, n - 1):
    rest = client.generate(
      GenerateRequest(
        f"rest-{cut}",
        prompt + full.output_ids[:cut],
        SamplingParams(max_new_tokens=BUDGET - cut, temperature=1.0, seed=1234),
      )
    )
    assert full.output_ids[:cut] + rest.output_ids == full.output_ids
    for a, b in zip(rest.output_logprobs, full.output_logprobs[cut:]):
      assert abs(a - b) < 1e-4  # prefill of the resumed prefix vs the original decode steps


def test_partial_rollout_aborted_anywhere_resumes_exactly(served):
  """Over-sampled groups are aborted wherever they are when the first group completes; each later batch
  resumes them from prompt + generated. Every finished sample equals its uninterrupted seeded request."""
  client = HttpEngine(HttpEngineConfig(served.server.url, generate_timeout_s=120))
  prompts = [Prompt(f"p{i}", "default", (20 + i, 7, 8)) for i in range(4)]
  got, lock = {}, threading.Lock()

  def reward(prompt, completions):
    with lock:
      got[prompt.prompt_id] = [c.output_ids for c in completions]
    return [RewardResult(1.0, "ok") for _ in completions]

  cfg = RolloutConfig(
    group_size=2, target_groups=1, launch_groups=4, task_budgets=(("default", BUDGET),), max_concurrency=8
  )
  manager = RolloutManager(cfg, client, iter(prompts), reward)
  kept = 0
  try:
    for _ in range(4):
      _, stats = manager.collect(served.engine.weight_version)
      kept += stats["partial_tokens_kept"]
  finally:
    manager.close()
  assert sorted(got) == [p.prompt_id for p in prompts]
  assert kept > 0  # some samples really were cut mid-way and resumed
  for uid, p in enumerate(prompts):  # groups are numbered in draw order; sample k's seed is uid * K + k
    for k, tokens in enumerate(got[p.prompt_id]):
      ref = client.generate(
        GenerateRequest(f"ref-{uid}-{k}", p.input_ids, SamplingParams(BUDGET, temperature=1.0, seed=uid * 2 + k))
      )
      assert tokens == ref.output_ids, (p.prompt_id, k)
