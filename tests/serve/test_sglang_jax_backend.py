"""`launch/serve.py --backend=sglang_jax` as the remote RL engine: `launch/rl.py` against it over HTTP.

sglang-jax needs Python >= 3.12 and its own pins, so it is usually not importable in the suite's
interpreter. There these tests skip and say why, and `test_under_sglang_jax_python` runs this file under
SGLANG_JAX_PYTHON (a Python that can `import sgl_jax`, docs/rl.md "sglang-jax") when it is set.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_SGL = importlib.util.find_spec("sgl_jax") is not None
PYTHON = os.environ.get("SGLANG_JAX_PYTHON", "")
WHY = (
  f"sgl_jax is not importable in Python {sys.version_info.major}.{sys.version_info.minor} (sglang-jax needs "
  ">= 3.12, docs/rl.md 'sglang-jax'); set SGLANG_JAX_PYTHON to run these tests under such a Python"
)
needs_sgl = pytest.mark.skipif(not HAVE_SGL, reason=WHY)
pytestmark = pytest.mark.slow
# One CPU device for sglang-jax's 1x1 mesh and the learner's (the suite's conftest fakes 8).
ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
ENV["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"


@pytest.mark.skipif(HAVE_SGL or not PYTHON, reason="sgl_jax runs here directly" if HAVE_SGL else WHY)
def test_under_sglang_jax_python():
  cmd = [PYTHON, "-m", "pytest", "-q", "-x", "-rs", os.path.abspath(__file__), "-k", "not under_sglang_jax_python"]
  proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1800, check=False)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _get(url: str) -> dict:
  with urllib.request.urlopen(url, timeout=30) as r:
    return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """`launch/serve.py --backend=sglang_jax` on a random-init `tiny128` export (the learner's architecture)."""
  from flax import nnx

  import k2jax
  from k2jax.model import K2Model, presets

  root = tmp_path_factory.mktemp("fleet")
  export = str(root / "tiny128-hf")
  k2jax.save_hf(K2Model(presets.get("tiny128"), rngs=nnx.Rngs(7)), export)
  port = _free_port()
  cmd = [sys.executable, os.path.join(REPO, "launch/serve.py"), f"--model={export}", f"--port={port}"]
  cmd += ["--backend=sglang_jax", "--max_seq_len=512", "--max_running_requests=8", f"--weights_root={root}"]
  log = open(root / "server.log", "w")
  proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 1200
    while True:
      try:
        urllib.request.urlopen(url + "/health", timeout=30).read()
        break
      except OSError:
        if proc.poll() is not None or time.monotonic() > deadline:
          log.flush()
          pytest.fail(f"serve.py did not come up (rc {proc.poll()}):\n{open(log.name).read()[-4000:]}")
        time.sleep(2)
    yield url, root
  finally:  # sglang-jax may leave threads or children behind: stop the whole group
    try:
      os.killpg(proc.pid, signal.SIGTERM)
      proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
      pass
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    log.close()


@needs_sgl
def test_handshake_names_the_backend_and_its_weight_updates(server):
  from k2jax.engine.http import HttpEngine, HttpEngineConfig

  url, _ = server
  info = _get(url + "/get_server_info")
  assert info["engine"] == "k2jax" and info["backend"] == "sglang-jax"
  caps = HttpEngine(HttpEngineConfig(url)).capabilities()
  assert caps.weight_update == ("disk",) and caps.reports_weight_version and caps.abort and caps.seeded_sampling
  assert "sglang-jax backend" in caps.server_version


@needs_sgl
def test_rl_launch_over_http_confirms_every_version_and_matches_trainer_logprobs(server):
  """3 RL iterations; every trained token carries a version the server confirmed; the server's logprobs of
  tokens sampled with the trainer's current weights equal the trainer's recomputation within 1e-4."""
  url, root = server
  workdir = root / "rl"
  flags = {
    "rollout.engine_url": url,
    "sync.root": str(root / "weights"),
    "model.preset": "tiny128",
    "iterations": 3,
    "warm_start.steps": 2,
    "rollout.target_groups": 4,
    "rollout.launch_groups": 5,
    "rollout.group_size": 4,
    "ptx.batch_size": 4,
    "eval.every": 0,
    "checkpoint.every": 3,
  }
  cmd = [sys.executable, os.path.join(REPO, "launch/rl.py"), "--config=configs/rl.py:tiny", f"--workdir={workdir}"]
  cmd += [f"--config.{k}={v}" for k, v in flags.items()]
  proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1500, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  its = [r for r in records if r.get("phase") != "warm_start"]
  assert [r["step"] for r in its] == [1, 2, 3]
  versions = [r["weight_version"] for r in its]
  assert versions == sorted(versions) and len(set(versions)) == 3
  for r in its:
    assert r["unknown_version_token_frac"] == 0.0, r
    assert r["engine_logprob_max_abs_diff"] <= 1e-4, r
  # The server serves the last pushed version.
  assert _get(url + "/get_model_info")["weight_version"] == str(versions[-1])
