"""The lockstep command stream (k2jax.engine.lockstep) between a leader and a follower, over a queue that
stands in for `broadcast_one_to_all`: a command that fails fails on both sides, and the follower keeps
following the leader's recovery instead of leaving the leader's next broadcast with no one to receive it."""

import queue
import threading

import numpy as np

from k2jax.engine import lockstep
from k2jax.engine.runner import _greedy


class _Runner:
  """Records what it runs; a prefill of token 13 fails (on every process alike, as a device error would)."""

  num_slots, max_prefill_tokens = 2, 8

  def __init__(self):
    self.ran = []

  def prefill(self, slots, tokens_AL, starts, sampling):
    self.ran.append(("prefill", [int(s) for s in slots]))
    if (tokens_AL == 13).any():
      raise RuntimeError("poisoned prefill")
    return ("sampled", len(slots))

  def decode(self, tokens_N, positions_N, sampling):
    self.ran.append(("decode", [int(t) for t in tokens_N]))
    return ("sampled", len(tokens_N))


def _pair():
  """A leader and a follower Executor whose broadcast is one queue (the follower blocks on it)."""
  q: queue.Queue = queue.Queue()
  leader = lockstep.Executor(_Runner(), prefix_entries=2, leader=True, processes=2)
  follower = lockstep.Executor(_Runner(), prefix_entries=2, leader=False, processes=2)
  leader._broadcast = lambda msg: q.put(msg.copy()) or msg
  follower._broadcast = lambda msg: q.get(timeout=30)
  return leader, follower


def test_follower_survives_a_failed_command_and_runs_the_leaders_recovery():
  leader, follower = _pair()
  result = {}
  t = threading.Thread(target=lambda: result.setdefault("kind", follower.follow()), daemon=True)
  t.start()
  try:
    leader.prefill([(0, -1, 0, [5, 13]), (1, -1, 0, [7])], _greedy(2))
    raise AssertionError("the poisoned batch should fail on the leader")
  except RuntimeError as e:
    assert "poisoned" in str(e)
  # The leader's recovery (InferenceEngine._prefill): each row alone; the poisoned one fails again.
  for row in ([(0, -1, 0, [5, 13])], [(1, -1, 0, [7])]):
    try:
      leader.prefill(row, _greedy(1))
    except RuntimeError:
      pass
  leader.decode(np.array([3, 4], np.int32), np.array([1, 1], np.int32), _greedy(2))
  leader.close()
  t.join(timeout=30)
  assert not t.is_alive() and result["kind"] == lockstep.CLOSE
  want = [("prefill", [0, 1]), ("prefill", [0]), ("prefill", [1]), ("decode", [3, 4])]
  assert leader.runner.ran == follower.runner.ran == want


def test_update_carries_the_path_version_and_flush_to_every_process():
  leader, follower = _pair()
  calls = {"leader": [], "follower": []}
  leader.on_update = lambda *a: calls["leader"].append(a) or a[1]
  follower.on_update = lambda *a: calls["follower"].append(a) or a[1]
  t = threading.Thread(target=follower.follow, daemon=True)
  t.start()
  path = "/shared/weights/v7/åäö-ünïcode"  # not a multiple of 4 bytes
  assert leader.update(path, 7, flush_cache=False) == 7
  leader.close()
  t.join(timeout=30)
  assert calls["leader"] == calls["follower"] == [(path, 7, False)]
  with np.testing.assert_raises_regex(ValueError, "weights path of .* bytes"):
    leader.update("/" + "x" * 4 * leader._width, 8, flush_cache=True)
