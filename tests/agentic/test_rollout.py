"""Multi-turn rollouts: the trained ids are exactly the engine's generated ids, turn by turn; tool results
and user turns are masked out; the same holds through the env service and through the served tiny model."""

import threading

import numpy as np

from k2jax.agentic.rollout import MultiTurnConfig, MultiTurnRunner, to_rollout_batch
from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import load_tokenizer
from k2jax.engine.base import Engine, GenerateResult
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.rl.envs import EnvService, RemoteEnvConfig, RemoteEnvironment
from k2jax.rl.envs.simulated import SimToolsEnv

TASK = {
  "id": "t",
  "instruction": "Finalise the report.",
  "state": {"files": {"r.txt": "draft"}},
  "checks": [{"kind": "file_equals", "name": "r.txt", "text": "final"}, {"kind": "answer_contains", "text": "done"}],
  "followups": ["Sure?"],
}
SCRIPT = [
  'Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>'
  '{"name": "r.txt"}<|tool_call_end|><|tool_call_begin|>functions.write_file:1<|tool_call_argument_begin|>'
  '{"name": "r.txt", "text": "final"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
  "It is fin",  # cut by the length limit: the runner closes the turn
  "Yes, done.<|im_end|>",
]


class Recording(Engine):
  """Wraps an engine (or a script) and records every request/result pair per rid."""

  def __init__(self, inner=None, script=None):
    self.inner, self.script, self.calls, self._lock = inner, script, {}, threading.Lock()

  def generate(self, request):
    if self.inner is not None:
      res = self.inner.generate(request)
    else:
      turn = int(request.rid.rsplit("-t", 1)[1])
      out = tuple(self.script[turn])
      res = GenerateResult(
        request.rid,
        out,
        tuple(-0.5 for _ in out),
        (3,) * len(out),
        "stop" if out[-1] == TOK.special_ids["<|im_end|>"] else "length",
        len(request.input_ids),
      )
    with self._lock:
      self.calls[request.rid] = (request, res)
    return res

  def abort(self, rids):
    pass

  def update_weights(self, model_path, weight_version):
    pass


TOK = load_tokenizer()


def check_trajectory(traj, engine, rid):
  gen = [engine.calls[f"{rid}-t{i}"] for i in range(len(traj.turns))]
  for turn, (req, res) in zip(traj.turns, gen):
    assert req.input_ids == tuple(traj.tokens[: turn.start])  # token-in: the whole history, as is
    assert turn.output_ids == res.output_ids  # token-out: kept exactly
    assert traj.tokens[turn.start : turn.start + len(res.output_ids)] == list(res.output_ids)
    assert all(traj.loss_mask[turn.start : turn.start + len(res.output_ids)])
  trained = [t for t, m in zip(traj.tokens, traj.loss_mask) if m]
  assert trained == [t for _, res in gen for t in res.output_ids]  # nothing else is trained


def scripted_run(env_factory):
  engine = Recording(script=[TOK.encode_with_specials(s) for s in SCRIPT])
  runner = MultiTurnRunner(engine, TOK, env_factory, MultiTurnConfig(max_turns=5))
  return engine, runner.run_episode(TASK, "ep")


def test_scripted_episode_token_identity_and_masks():
  engine, traj = scripted_run(SimToolsEnv)
  assert traj.end == "env_done" and traj.reward == 1.0 and len(traj.turns) == 3
  check_trajectory(traj, engine, "ep")
  # Between turn 0 and turn 1 sit exactly the rendered tool results + the next assistant header.
  t0, t1 = traj.turns[0], traj.turns[1]
  between = traj.tokens[t0.start + len(t0.output_ids) : t1.start]
  tool_msgs = [
    {"role": "tool", "tool_call_id": "functions.read_file:0", "name": "read_file", "content": "draft"},
    {"role": "tool", "tool_call_id": "functions.write_file:1", "name": "write_file", "content": '{"written": "r.txt"}'},
  ]
  assert between == render_chat(tool_msgs, tokenizer=TOK, add_generation_prompt=True)[0]
  # The length-cut turn got a closing <|im_end|> that is not trained.
  end = t1.start + len(t1.output_ids)
  assert traj.tokens[end] == TOK.special_ids["<|im_end|>"] and traj.loss_mask[end] == 0
  batch = to_rollout_batch([traj, traj])
  assert batch.loss_mask_BT.sum() == 2 * sum(len(t.output_ids) for t in traj.turns)
  assert (batch.engine_logprobs_BT[batch.loss_mask_BT == 0] == 0).all()
  assert (batch.weight_versions_BT[batch.loss_mask_BT > 0] == 3).all() and batch.rewards_B.tolist() == [1.0, 1.0]


def test_scripted_episode_through_env_service():
  service = EnvService("sim_tools").start()
  try:
    engine, traj = scripted_run(lambda: RemoteEnvironment(RemoteEnvConfig(service.url)))
    _, local = scripted_run(SimToolsEnv)
    assert traj.tokens == local.tokens and traj.reward == 1.0
    check_trajectory(traj, engine, "ep")
  finally:
    service.close()


def test_served_tiny_model_many_episodes(tiny_server):
  engine = Recording(inner=HttpEngine(HttpEngineConfig(tiny_server.url)))
  tasks = [
    {**TASK, "id": f"t{i}", "followups": ["More?", "And?"], "tools": ["read_file", "list_files"]} for i in range(6)
  ]
  runner = MultiTurnRunner(
    engine, TOK, SimToolsEnv, MultiTurnConfig(max_turns=3, max_new_tokens_per_turn=8, concurrency=6)
  )
  trajs = runner.run(tasks)
  assert all(not t.failed for t in trajs) and sum(len(t.turns) for t in trajs) >= 12
  for i, traj in enumerate(trajs):
    check_trajectory(traj, engine, f"ep-{i}")
  batch = to_rollout_batch(trajs)
  assert np.isfinite(batch.engine_logprobs_BT).all() and (batch.engine_logprobs_BT <= 0).all()


def test_rollout_batch_feeds_the_k2_objective():
  """The learner's objective sees exactly the generated tokens: with log pi = log pi_old + d on every
  trained token, L = mean_i (r_i - rbar - tau * d * M)^2 where M counts generated tokens only."""
  import jax.numpy as jnp
  from k2jax.rl.algo import K2LossConfig, k2_objective

  engine, traj = scripted_run(SimToolsEnv)
  _, traj2 = scripted_run(SimToolsEnv)
  traj2.reward = 0.0
  batch = to_rollout_batch([traj, traj2], group_ids=[0, 0])
  d, M = 0.01, sum(len(t.output_ids) for t in traj.turns)
  old = jnp.asarray(batch.engine_logprobs_BT)
  loss, _ = k2_objective(
    K2LossConfig(tau=1.0),
    old + d * jnp.asarray(batch.loss_mask_BT),
    old,
    jnp.asarray(batch.loss_mask_BT),
    jnp.asarray(batch.rewards_B),
    jnp.asarray(batch.group_ids_B),
    num_groups=1,
  )
  assert M < len(traj.tokens) - traj.prompt_length  # there are masked (tool/user) tokens
  want = ((0.5 - d * M) ** 2 + (-0.5 - d * M) ** 2) / 2
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
