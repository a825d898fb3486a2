"""Two local CPU processes (4 fake devices each) form one 8-device mesh and compute the loss of
one process on the whole batch. Uses jax.distributed with gloo CPU collectives."""

import functools
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest
from sharding_helpers import batch, next_token_loss, split_params, tiny_model_state

WORKER = pathlib.Path(__file__).parent / "two_process_worker.py"
REPO = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_compute_the_single_process_loss(tmp_path):
  port = _free_port()
  env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  env.pop("XLA_FLAGS", None)
  outs = [tmp_path / f"p{i}.json" for i in range(2)]
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), str(port), str(i), str(outs[i])],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=600)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  results = [json.loads(o.read_text()) for o in outs]
  assert [r["rows"] for r in results] == [[0, 4], [4, 8]]  # each process loaded only its rows

  graphdef, state = tiny_model_state(16)
  gd, params, rest = split_params(graphdef, state)
  want = float(jax.jit(functools.partial(next_token_loss, gd))(params, rest, batch()[0]))
  for r in results:
    assert abs(r["loss"] - want) <= 1e-5 * abs(want), (r, want)


def test_initialize_argument_errors_and_single_process_default():
  from k2jax import distributed

  assert distributed.initialize(env={}) is False  # nothing set, no cluster: single process
  with pytest.raises(ValueError, match="num_processes, process_id missing"):
    distributed.initialize(env={"K2JAX_COORDINATOR": "10.0.0.1:1234"})
  with pytest.raises(ValueError, match="process_id=2 is not in \\[0, 2\\)"):
    distributed.initialize("10.0.0.1:1234", 2, 2, env={})
  with pytest.raises(ValueError, match="K2JAX_NUM_PROCESSES='two' is not an integer"):
    distributed.initialize(env={"K2JAX_NUM_PROCESSES": "two"})
  with pytest.raises(ValueError, match="needs host:port"):
    distributed.initialize(env={"K2JAX_COORDINATOR": "10.0.0.1", "K2JAX_NUM_PROCESSES": "2", "K2JAX_PROCESS_ID": "0"})


def test_compiled_together_compiles_then_meets_once_per_signature(monkeypatch):
  """With several processes each new argument signature is compiled before the barrier and run after it
  (no second compile); a signature seen before runs straight away. One process: no barrier at all."""
  import numpy as np
  from jax._src import monitoring

  from k2jax import distributed

  events: list[str] = []

  def on_compile(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      events.append("compile")

  monitoring.register_event_duration_secs_listener(on_compile)
  monkeypatch.setattr(distributed, "barrier", lambda what, **kw: events.append(f"barrier {what}"))
  traced = []
  fn = distributed.compiled_together(jax.jit(lambda x: traced.append(x.shape) or x * 2), "double")
  ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731  host inputs: no compile of their own
  try:
    np.testing.assert_array_equal(np.asarray(fn(ones(3))), 2 * ones(3))  # one process: jit itself
    assert events == ["compile"]
    events.clear()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    np.testing.assert_array_equal(np.asarray(fn(ones(4))), 2 * ones(4))
    assert events == ["compile", "barrier compiled double"]
    fn(3 * ones(4))
    assert events == ["compile", "barrier compiled double"]  # seen: no compile, no barrier
    fn(ones(2, 2))
    assert events[2:] == ["compile", "barrier compiled double"]
    assert traced == [(3,), (4,), (2, 2)]  # each signature traced once
    assert "mul" in fn.lower(ones(5)).as_text()  # the jitted function's own attributes pass through
  finally:
    monitoring.unregister_event_duration_listener(on_compile)


def test_barrier_is_a_no_op_with_one_process():
  from k2jax import distributed

  distributed.barrier("alone", timeout_s=0.001)
