"""The RL client against a real sglang-jax server on CPU, serving a k2jax export (the `tiny128` preset).

sglang-jax needs Python >= 3.12 and its own jax/flax pins, so it runs in its own interpreter: set
SGLANG_JAX_PYTHON to a Python that can `import sgl_jax` (docs/rl.md "sglang-jax"); without it these tests
skip and say so. The server is started once per module (its compiles take minutes on CPU).
"""

import os
import signal
import socket
import subprocess
import threading
import time

import pytest
from flax import nnx

import k2jax
from k2jax.model import K2Model, presets
from k2jax.engine.base import UNKNOWN_VERSION, EngineIncapable, GenerateRequest, SamplingParams
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.engine.inference import EngineConfig, InferenceEngine

PYTHON = os.environ.get("SGLANG_JAX_PYTHON", "")
pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(not PYTHON, reason="SGLANG_JAX_PYTHON is not set (a Python >= 3.12 with sgl_jax installed)"),
]
PROMPTS = [(11, 12, 13), (400, 7, 9, 31), (5,), (1000, 2000, 3000, 17, 18)]
SMALL_CPU = (
  "--mem-fraction-static 0.1 --max-total-tokens 4096 --max-running-requests 8 --chunked-prefill-size 256 "
  "--context-length 512 --precompile-bs-paddings 8 --precompile-token-paddings 256"
).split()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
  probe = subprocess.run([PYTHON, "-c", "import sgl_jax"], capture_output=True, text=True)
  if probe.returncode:
    pytest.skip(f"{PYTHON} cannot import sgl_jax: {probe.stderr.strip()[-300:]}")
  cfg = presets.get("tiny128", num_hidden_layers=2, max_position_embeddings=512)
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  export = str(tmp_path_factory.mktemp("tiny128_hf"))
  k2jax.save_hf(model, export)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  log = open(os.path.join(export, "server.log"), "w")
  cmd = [PYTHON, "-m", "sgl_jax.launch_server", "--model-path", export, "--host", "127.0.0.1", "--port", str(port)]
  cmd += ["--device", "cpu", "--tp-size", "1", "--dtype", "float32", "--enable-deterministic-sampling"]
  cmd += ["--trust-remote-code", "--skip-server-warmup", "--attention-backend", "native", *SMALL_CPU]
  # One CPU device: the test session's XLA_FLAGS (8 host devices) would not fit its 1x1 mesh.
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
  client = HttpEngine(HttpEngineConfig(f"http://127.0.0.1:{port}", generate_timeout_s=600))
  try:
    deadline = time.monotonic() + 1200
    while not client.health():
      if proc.poll() is not None or time.monotonic() > deadline:
        log.flush()
        pytest.fail(f"sglang-jax did not come up (rc {proc.poll()}):\n{open(log.name).read()[-3000:]}")
      time.sleep(2)
    yield client, model
  finally:  # the launcher leaves its scheduler and detokenizer processes behind: stop its whole group
    os.killpg(proc.pid, signal.SIGTERM)
    try:
      proc.wait(30)
    except subprocess.TimeoutExpired:
      pass
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass  # the whole group is gone already
    log.close()


def test_handshake_knows_sglang_jax_and_rl_refuses_it(live):
  client, _ = live
  caps = client.capabilities()
  assert caps.server == "sglang-jax" and caps.weight_update == () and not caps.reports_weight_version
  assert caps.seeded_sampling and caps.abort  # --enable-deterministic-sampling was passed
  with pytest.raises(EngineIncapable, match="weight update from disk"):
    client.update_weights("/nowhere", 1)


def test_greedy_tokens_equal_k2jax_engine(live):
  client, model = live
  own = InferenceEngine(model, EngineConfig(max_slots=4, max_seq_len=512))
  try:
    for i, prompt in enumerate(PROMPTS):
      res = client.generate(GenerateRequest(f"g{i}", prompt, SamplingParams(max_new_tokens=60, temperature=0.0)))
      ref = own.generate(GenerateRequest(f"g{i}", prompt, SamplingParams(max_new_tokens=60, temperature=0.0)))
      n = len(res.output_ids)
      assert res.output_ids == ref.output_ids[:n]
      assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref.output_logprobs)) < 1e-3
      assert res.weight_versions == (UNKNOWN_VERSION,) * n  # sglang-jax names no version
  finally:
    own.close()
  counts = client.metrics()
  assert counts.get("logprobs_dup_rejected", 0) == 0


def test_seeded_resume_continues_exactly(live):
  client, _ = live
  sampling = SamplingParams(max_new_tokens=40, temperature=1.0, seed=77)
  full = client.generate(GenerateRequest("full", PROMPTS[1], sampling))
  cut = len(full.output_ids) // 2
  rest = client.generate(
    GenerateRequest("rest", PROMPTS[1] + full.output_ids[:cut], SamplingParams(40 - cut, temperature=1.0, seed=77))
  )
  assert full.output_ids[:cut] + rest.output_ids == full.output_ids


def test_queued_requests_aborted_before_prefill_come_back_empty(live):
  """8 running slots (--max-running-requests 8) and 12 requests: the 4 still queued get "Abort before prefill"."""
  client, _ = live
  before = client.metrics().get("abort_before_prefill", 0)
  out = {}

  def run(rid):
    out[rid] = client.generate(GenerateRequest(rid, (5, 6, 7), SamplingParams(max_new_tokens=400, seed=1)))

  threads = [threading.Thread(target=run, args=(f"q{i}",)) for i in range(12)]
  for t in threads:
    t.start()
  time.sleep(3)
  client.abort([f"q{i}" for i in range(12)])
  for t in threads:
    t.join(300)
  assert sorted(out) == sorted(f"q{i}" for i in range(12))
  assert all(r.finish_reason == "abort" for r in out.values())
  empty = sum(1 for r in out.values() if not r.output_ids)
  assert empty >= 1 and client.metrics()["abort_before_prefill"] - before == empty
