"""`launch/serve.py` as 2 JAX processes x 2 fake CPU devices serves, over HTTP to process 0, the same
greedy generations as one process x 4 devices (same tp_ep mesh): continuous batching (6 prompts, 4 slots)
and prefix reuse (a second round on the same prompts); after `/update_weights_from_disk` to process 0 (a whole
HF directory, then a weight-sync delta of a few tensors), which every process reads its own shards of, the
same generations as the one-process server given the same updates; and both processes exit when process 0
is stopped."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # three JAX processes, each compiling its steps
PROMPTS = [[5, 9, 12, 7], [5, 9, 12, 7, 30], [100, 2], [44, 45, 46, 47, 48, 49], [5, 9], [3000, 17, 17]]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(model: str, port: int, devices: int, log, *extra) -> subprocess.Popen:
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=xla_flags(devices),
    PYTHONPATH=ROOT,
  )
  cmd = [sys.executable, os.path.join(ROOT, "launch/serve.py"), f"--model={model}", f"--port={port}"]
  cmd += ["--sharding=tp_ep", "--mesh=expert:2,tensor:2", "--max_running_requests=4", "--max_seq_len=32"]
  cmd += ["--tokenizer=none", "--noprecompile", *extra]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_healthy(url: str, procs: list, logs: list) -> None:
  deadline = time.monotonic() + 600
  while True:
    try:
      urllib.request.urlopen(url + "/health", timeout=120).read()
      return
    except OSError:
      if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
        text = "\n".join(open(f.name).read()[-3000:] for f in logs)
        pytest.fail(f"serve.py did not come up (rc {[p.poll() for p in procs]}):\n{text}")
      time.sleep(1)


def _generate(url: str) -> list[tuple[list[int], list[float]]]:
  body = {
    "input_ids": PROMPTS,
    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    "return_logprob": True,
  }
  req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=300) as r:
    outs = json.loads(r.read())
  return [
    (
      [t for _, t, _ in o["meta_info"]["output_token_logprobs"]],
      [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
    )
    for o in outs
  ]


def _update(url: str, path: str, version: int) -> None:
  body = json.dumps({"model_path": path, "weight_version": str(version)}).encode()
  req = urllib.request.Request(url + "/update_weights_from_disk", body, {"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=300) as r:
    out = json.loads(r.read())
  assert out["success"] and out["weight_version"] == str(version), out


def _delta(src: str, dst: str) -> str:
  """A weight-sync directory (index, no config.json) with a few of `src`'s tensors: experts 0-3 of layer 1
  (expert-sharded: each process reads only its own) and layer 0's attention output (tensor-sharded)."""
  from safetensors.numpy import load_file, save_file

  tensors = {}
  for name in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
    for k, v in load_file(os.path.join(src, name)).items():
      if any(f"layers.1.mlp.experts.{e}." in k for e in range(4)) or k == "model.layers.0.self_attn.o_proj.weight":
        tensors[k] = v
  os.makedirs(dst)
  save_file(tensors, os.path.join(dst, "model-p00000-00001.safetensors"))
  with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": dict.fromkeys(tensors, "model-p00000-00001.safetensors")}, f)
  return dst


def _same(got, want) -> None:
  for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
    assert tokens == want_tokens and len(tokens) == 8
    np.testing.assert_allclose(lps, want_lps, atol=1e-5)


def _stop(procs: list) -> list:
  """SIGTERM to process 0 only: the others must leave with it. Returns the exit codes."""
  procs[0].send_signal(signal.SIGTERM)
  codes = []
  for p in procs:
    try:
      codes.append(p.wait(timeout=120))
    except subprocess.TimeoutExpired:
      p.kill()  # an orphan: fail, but leave nothing running
      p.wait()
      codes.append("orphan")
  return codes


def test_two_processes_serve_what_one_process_serves(tmp_path):
  from flax import nnx

  import k2jax
  from k2jax.model import K2Model, presets

  model, other, third = (str(tmp_path / n) for n in ("hf", "other", "third"))
  for seed, path in ((3, model), (4, other), (5, third)):
    k2jax.save_hf(K2Model(presets.get("tiny"), rngs=nnx.Rngs(seed)), path)
  delta = _delta(third, str(tmp_path / "delta"))
  logs = [open(tmp_path / f"{name}.log", "w") for name in ("one", "p0", "p1")]
  one_port, port, coord = _free_port(), _free_port(), _free_port()
  root = f"--weights_root={tmp_path}"
  procs = [_start(model, one_port, 4, logs[0], root)]
  dist = [f"--coordinator_address=127.0.0.1:{coord}", "--num_processes=2", root]
  procs += [_start(model, port, 2, logs[1 + i], *dist, f"--process_id={i}") for i in range(2)]
  try:
    one_url, url = f"http://127.0.0.1:{one_port}", f"http://127.0.0.1:{port}"
    _wait_healthy(one_url, procs[:1], logs[:1])
    _wait_healthy(url, procs[1:], logs[1:])
    want = _generate(one_url)
    for _ in range(2):  # the second round reuses the finished rows (prefix cache) on both sides
      _same(_generate(url), want)
    assert "follows process 0's engine" in open(logs[2].name).read()
    for version, path in ((1, other), (2, delta)):  # a whole HF directory, then a delta over it
      _update(one_url, path, version)
      _update(url, path, version)
      new = _generate(one_url)
      assert new != want  # the update changed what is served
      _same(_generate(url), new)
      want = new
    assert _stop(procs[1:]) == [0, 0]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for f in logs:
      f.close()
