"""The HTTP server under load: requests/s, p50/p99 latency and errors at 32, 128 and 256 concurrent clients.

    python bench/serve_load.py [--requests=512] [--new_tokens=8] [--reps=5]

Each level sends --requests `/generate` calls (tiny model, --new_tokens sampled tokens each) from that
many client threads. The baseline, run in the same process and interleaved with the HTTP runs (A B A B
...), submits the same requests straight to the engine without HTTP. Prints key=value lines:
  c{C}_requests_per_sec, c{C}_p50_s, c{C}_p99_s, c{C}_errors   (medians over --reps, [min, max] spread)
  c{C}_http_over_direct_throughput                              (HTTP requests/s over in-process requests/s)
  errors_at_256=, p99_over_p50_at_128=
"""

from __future__ import annotations

import concurrent.futures
import statistics
import tempfile
import time

import requests
from absl import app, flags
from flax import nnx

import k2jax
from k2jax.model import K2Model, presets
from k2jax.engine import EngineConfig, GenerateRequest, SamplingParams
from k2jax.serve import Server

_REQUESTS = flags.DEFINE_integer("requests", 512, "requests per level and repetition")
_NEW = flags.DEFINE_integer("new_tokens", 8, "tokens sampled per request")
_REPS = flags.DEFINE_integer("reps", 5, "interleaved repetitions per level")
_LEVELS = (32, 128, 256)


def http_run(server: Server, clients: int, n: int, new: int) -> dict:
  session_of = {}

  def one(i: int):
    session = session_of.setdefault(i % clients, requests.Session())
    body = {"input_ids": [1 + i % 97, 2, 3, 4], "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}
    t0 = time.perf_counter()
    try:
      ok = session.post(f"{server.url}/generate", json=body, timeout=600).status_code == 200
    except requests.RequestException:
      ok = False
    return ok, time.perf_counter() - t0

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = list(pool.map(one, range(n)))
  wall = time.perf_counter() - t0
  lat = sorted(s for _, s in results)
  return {
    "rps": n / wall,
    "p50": lat[len(lat) // 2],
    "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    "errors": sum(not ok for ok, _ in results),
  }


def direct_run(server: Server, n: int, new: int) -> float:
  engine = server.engine
  sampling = SamplingParams(max_new_tokens=new, ignore_eos=True)
  t0 = time.perf_counter()
  lives = [engine.submit(GenerateRequest(f"d{i}-{time.time_ns()}", (1 + i % 97, 2, 3, 4), sampling)) for i in range(n)]
  for live in lives:
    engine.wait(live)
  return n / (time.perf_counter() - t0)


def _fmt(values: list[float]) -> str:
  return f"{statistics.median(values):.4g} [{min(values):.4g}, {max(values):.4g}]"


def main(argv):
  del argv
  n, new = _REQUESTS.value, _NEW.value
  with tempfile.TemporaryDirectory() as tmp:
    k2jax.save_hf(K2Model(presets.get("tiny", max_position_embeddings=64), rngs=nnx.Rngs(0)), tmp)
    server = Server(tmp, engine_config=EngineConfig(max_slots=16, max_seq_len=64, precompile=True), port=0).start()
    try:
      http_run(server, 8, 32, new)  # compile every prefill bucket and the decode step
      direct_run(server, 32, new)
      figures = {}
      for clients in _LEVELS:
        runs, direct = [], []
        for _ in range(_REPS.value):
          runs.append(http_run(server, clients, n, new))
          direct.append(direct_run(server, n, new))
        rps, ratio = [r["rps"] for r in runs], [r["rps"] / d for r, d in zip(runs, direct)]
        p50, p99, errors = [r["p50"] for r in runs], [r["p99"] for r in runs], [r["errors"] for r in runs]
        print(f"c{clients}_requests_per_sec={_fmt(rps)}")
        print(f"c{clients}_p50_s={_fmt(p50)}")
        print(f"c{clients}_p99_s={_fmt(p99)}")
        print(f"c{clients}_errors={sum(errors)}")
        print(f"c{clients}_http_over_direct_throughput={_fmt(ratio)}")
        figures[clients] = (sum(errors), [b / a for a, b in zip(p50, p99)])
      print(f"errors_at_256={figures[256][0]}")
      print(f"p99_over_p50_at_128={_fmt(figures[128][1])}")
    finally:
      server.close()


if __name__ == "__main__":
  app.run(main)
