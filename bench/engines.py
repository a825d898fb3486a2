"""k2jax's engine vs sglang-jax on the same exported model and prompts, both over SGLang's `/generate`.

Run: python bench/engines.py [--sglang_jax_python=PY] [--new_tokens=32] [--reps=5]
Exports the `tiny128` preset (128-wide heads: what sglang-jax's CPU attention loads) with `k2jax.save_hf`,
serves it with k2jax's server (its in-process engine behind HTTP, in this process) and, when
`--sglang_jax_python` names a Python with `sgl_jax` installed, with `sgl_jax.launch_server --device cpu`.
Both get the same load from the same client: C concurrent non-streaming requests (C = 1, 8, 32),
`ignore_eos` so every request decodes `new_tokens` tokens. Per C: decode tokens/s = generated tokens /
wall time; time to first token = latency of a 1-token request under the same concurrency. Engines are
measured interleaved, `reps` times; medians with [min, max]. Prints key=value lines, and
`embedded_over_sglang_jax_tokens_per_sec=` at C = 32. Also the seconds one `/update_weights_from_disk`
of the whole export takes on k2jax's server (sglang-jax's server has no weight-update route), and, under
`--sglang_jax_python`, the seconds one weight update of the colocated sglang-jax engine
(`k2jax.engine.sglang_jax`, in-process, device to device) takes vs a disk round trip of the same weights
(`k2jax.save_hf`, then the same engine loads the export), interleaved `reps` times, and what a relaunch of
sglang-jax costs (the engine's start on an architecture-only directory, compiles included).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from flax import nnx

import k2jax
from k2jax.model import K2Model, presets
from k2jax.transport import RetryPolicy, call_json
from k2jax.engine.inference import EngineConfig
from k2jax.serve import Server

CONCURRENCY = (1, 8, 32)
SMALL_CPU = (
  "--mem-fraction-static 0.1 --max-total-tokens 8192 --max-running-requests 32 --chunked-prefill-size 256 "
  "--context-length 512 --precompile-bs-paddings 1 8 32 --precompile-token-paddings 256"
).split()


_calls = itertools.count()
MALFORMED: dict[str, int] = {}  # per URL: replies whose output_ids are fewer than the finish reason claims


def one_round(url: str, concurrency: int, new_tokens: int, round_id: int) -> tuple[float, int]:
  """Wall seconds and tokens received for `concurrency` simultaneous requests of `new_tokens` tokens each.

  sglang-jax sometimes answers a non-streaming request with fewer `output_ids` than it generated (finish
  `length` 16 with 11 ids, reference §2.6): such replies are counted in MALFORMED and only the ids received
  count as tokens, so its rate is not inflated.
  """

  def request(i: int) -> int:
    payload = {
      "input_ids": [11 + i % 50, 12, 13, 14 + round_id % 7],
      "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
      "rid": f"b{next(_calls)}",
    }
    body = call_json(f"{url}/generate", payload, timeout_s=600, retry=RetryPolicy(max_retries=0))
    n = len(body["output_ids"])
    if n != new_tokens:
      MALFORMED[url] = MALFORMED.get(url, 0) + 1
    return n

  t0 = time.perf_counter()
  with ThreadPoolExecutor(concurrency) as pool:
    received = sum(pool.map(request, range(concurrency)))
  return time.perf_counter() - t0, received


def start_sglang_jax(python: str, model: str) -> tuple[subprocess.Popen, str]:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [python, "-m", "sgl_jax.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port)]
  cmd += [
    "--device",
    "cpu",
    "--tp-size",
    "1",
    "--dtype",
    "float32",
    "--skip-server-warmup",
    "--attention-backend",
    "native",
    *SMALL_CPU,
  ]
  log = open(os.path.join(model, "sglang_jax.log"), "w")
  # One CPU device: the test session's XLA_FLAGS (8 host devices) would not fit its 1x1 mesh.
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 1800
  while True:
    try:
      call_json(f"{url}/health", None, timeout_s=5, retry=RetryPolicy(max_retries=0), parse_json=False)
      return proc, url
    except Exception:
      if proc.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"sglang-jax did not start; see {log.name}")
      time.sleep(2)


def colocated_updates(reps: int) -> None:
  """Under a Python with sgl_jax: weight-update seconds of the colocated engine, device to device vs via disk."""
  from k2jax.engine.sglang_jax import SglangJaxEngine, write_model_dir

  model = K2Model(presets.get("tiny128", max_position_embeddings=512), rngs=nnx.Rngs(0))
  state = nnx.to_pure_dict(nnx.state(model))
  root = tempfile.mkdtemp(prefix="bench-colocated-")
  export = os.path.join(root, "push")
  t0 = time.perf_counter()
  engine = SglangJaxEngine(model.cfg, write_model_dir(model.cfg, os.path.join(root, "arch")))
  start = time.perf_counter() - t0
  engine.update_weights_from_params(state, 1)  # compiles the per-leaf copies
  k2jax.save_hf(model, export)
  engine.update_weights(export, 2)
  device, disk = [], []
  for rep in range(reps):
    t0 = time.perf_counter()
    engine.update_weights_from_params(state, 3 + 2 * rep)
    device.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    k2jax.save_hf(model, export)
    engine.update_weights(export, 4 + 2 * rep)
    disk.append(time.perf_counter() - t0)
  ratios = [b / a for a, b in zip(device, disk)]
  print(f"sglang_jax_colocated_update_s={np.median(device):.4f} [{min(device):.4f}, {max(device):.4f}]")
  print(f"sglang_jax_disk_roundtrip_update_s={np.median(disk):.4f} [{min(disk):.4f}, {max(disk):.4f}]")
  print(f"disk_roundtrip_over_colocated_update={np.median(ratios):.1f} [{min(ratios):.1f}, {max(ratios):.1f}]")
  print(f"sglang_jax_relaunch_s={start:.1f} (one engine start, compiles included)")
  engine.close()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sglang_jax_python", default=os.environ.get("SGLANG_JAX_PYTHON", ""))
  p.add_argument("--new_tokens", type=int, default=32)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--colocated_updates_only", action="store_true", help="(internal) run under the sgl_jax Python")
  args = p.parse_args()
  if args.colocated_updates_only:
    colocated_updates(args.reps)
    return

  export = tempfile.mkdtemp(prefix="bench-engines-")
  k2jax.save_hf(K2Model(presets.get("tiny128", max_position_embeddings=512), rngs=nnx.Rngs(0)), export)
  server = Server(export, engine_config=EngineConfig(max_slots=32, max_seq_len=512), port=0).start()
  engines = {"embedded": server.url}
  proc = None
  if args.sglang_jax_python:
    proc, engines["sglang_jax"] = start_sglang_jax(args.sglang_jax_python, export)
  else:
    print("sglang_jax=not_run (no --sglang_jax_python / SGLANG_JAX_PYTHON)")
  try:
    for url in engines.values():  # compiles and first-touch cost out of the timings
      for c in CONCURRENCY:
        one_round(url, c, args.new_tokens, -1)
        one_round(url, c, 1, -1)
    tps = {(e, c): [] for e in engines for c in CONCURRENCY}
    ttft = {(e, c): [] for e in engines for c in CONCURRENCY}
    for rep in range(args.reps):
      for c in CONCURRENCY:
        for name, url in engines.items():
          wall, received = one_round(url, c, args.new_tokens, rep)
          tps[name, c].append(received / wall)
          ttft[name, c].append(one_round(url, c, 1, rep)[0])
    for (name, c), v in tps.items():
      t = ttft[name, c]
      print(f"{name}_c{c}_tokens_per_sec={np.median(v):.1f} [{min(v):.1f}, {max(v):.1f}]")
      print(f"{name}_c{c}_ttft_s={np.median(t):.4f} [{min(t):.4f}, {max(t):.4f}]")
    for name, url in engines.items():
      print(f"{name}_short_replies={MALFORMED.get(url, 0)}")
    if proc is not None:
      ratios = [a / b for a, b in zip(tps["embedded", 32], tps["sglang_jax", 32])]
      print(f"embedded_over_sglang_jax_tokens_per_sec={np.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    updates = []
    for rep in range(args.reps):
      t0 = time.perf_counter()
      body = {"model_path": export, "weight_version": str(rep + 1), "flush_cache": True}
      call_json(f"{server.url}/update_weights_from_disk", body, timeout_s=600, retry=RetryPolicy(max_retries=0))
      updates.append(time.perf_counter() - t0)
    print(f"embedded_update_weights_from_disk_s={np.median(updates):.3f} [{min(updates):.3f}, {max(updates):.3f}]")
    if args.sglang_jax_python:  # sgl_jax is importable only there: run the colocated engine under it
      repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
      env = {**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"}
      env.pop("XLA_FLAGS", None)
      cmd = [args.sglang_jax_python, os.path.abspath(__file__), "--colocated_updates_only", f"--reps={args.reps}"]
      out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
      print(out.stdout, end="")
      if out.returncode:
        print(f"sglang_jax_colocated=failed rc={out.returncode}: {out.stderr[-1500:]}")
  finally:
    server.close()
    if proc is not None:  # the launcher's scheduler and detokenizer children share its process group
      os.killpg(proc.pid, signal.SIGTERM)
      time.sleep(5)
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass  # the whole group is gone already


if __name__ == "__main__":
  main()
