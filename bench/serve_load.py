"""The HTTP server under load: requests/s, p50/p99 latency and errors at 32, 128 and 256 concurrent clients,
and under attack: innocent requests' p99 latency while each hostile client runs, over their p99 alone.

    python bench/serve_load.py [--mix=load,hostile,starve] [--requests=512] [--new_tokens=8] [--reps=5]

Each level sends --requests `/generate` calls (tiny model, --new_tokens sampled tokens each) from that
many client threads. The baseline, run in the same process and interleaved with the HTTP runs (A B A B
...), submits the same requests straight to the engine without HTTP. Prints key=value lines:
  c{C}_requests_per_sec, c{C}_p50_s, c{C}_p99_s, c{C}_errors   (medians over --reps, [min, max] spread)
  c{C}_http_over_direct_throughput                              (HTTP requests/s over in-process requests/s)
  errors_at_256=, p99_over_p50_at_128=
The hostile mix: --innocents client threads each send --innocent_requests
8-token `/generate` calls while one attack runs; conditions interleave per repetition (alone, attack 1,
attack 2, ...). Prints per attack:
  {attack}_innocent_p99_under_attack_over_alone=   (median over --reps of p99 under attack / p99 alone)
  {attack}_innocent_p99_s=, {attack}_innocent_errors=, {attack}_attack_replies= (status: count)
and alone_innocent_p99_s=, max_batch_latency_s= (a maximal batch's latency while innocents run).
The starve mix (its own server: --starve_slots slots, context for the flood): one client (127.0.0.1) keeps
--flood concurrent `/generate` requests of 4 prompt tokens and --flood_tokens new tokens (ignore_eos) in
flight, and another client (127.0.0.2, another peer on the loopback) sends 4-token requests of
--innocent_tokens new tokens; alone and under the flood interleave per repetition. Prints:
  starve_innocent_under_flood_over_alone=   (median over --reps of the innocent's median latency
                                             under the flood / alone, [min, max])
  starve_innocent_alone_s=, starve_innocent_under_flood_s=, starve_flood_in_flight=
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import http.client
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
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
_MIX = flags.DEFINE_list("mix", ["load", "hostile", "starve"], "what to run: load, hostile, starve")
_INNOCENTS = flags.DEFINE_integer("innocents", 4, "innocent client threads in the hostile mix")
_INNOCENT_REQUESTS = flags.DEFINE_integer("innocent_requests", 30, "requests per innocent thread per condition")
_ATTACKS = flags.DEFINE_list(
  "attacks",
  ["max_batch", "stop_strings", "prompt_bytes", "idle_connections", "rid_reuse", "bad_weights"],
  "attacks of the hostile mix",
)
_IDLE = flags.DEFINE_integer("idle_connections", 20_000, "connections the idle/partial-header attack holds")
_HOLD = flags.DEFINE_string("hold_connections", None, "internal: URL,N -- hold N partial-header connections")
_FLOOD = flags.DEFINE_integer("flood", 64, "starve mix: concurrent requests of the flooding client")
_FLOOD_TOKENS = flags.DEFINE_integer("flood_tokens", 1000, "starve mix: new tokens per flood request")
_INNOCENT_TOKENS = flags.DEFINE_integer("innocent_tokens", 8, "starve mix: new tokens per innocent request")
_STARVE_SLOTS = flags.DEFINE_integer("starve_slots", 8, "starve mix: the server's engine slots")
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


# ---- the hostile mix ----------------------------------------------------------------------------------------
def innocent_run(url: str, threads: int, per_thread: int) -> dict:
  """`threads` clients, each sending `per_thread` 8-token requests back to back: p99 latency and errors."""

  def client(i: int):
    session, out = requests.Session(), []
    for j in range(per_thread):
      body = {"input_ids": [7, 1 + (i + j) % 90, 3], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
      t0 = time.perf_counter()
      try:
        r = session.post(f"{url}/generate", json=body, timeout=600)
        ok = r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8
      except requests.RequestException:
        ok = False
      out.append((ok, time.perf_counter() - t0))
    return out

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    results = [x for part in pool.map(client, range(threads)) for x in part]
  lat = sorted(s for _, s in results)
  return {"p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "errors": sum(not ok for ok, _ in results)}


class _Loop:
  """An attacker thread repeating `step(session)` until stopped; counts reply statuses."""

  def __init__(self, step, threads: int = 1):
    self.step, self.stop, self.replies = step, threading.Event(), collections.Counter()
    self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

  def _run(self):
    session = requests.Session()
    while not self.stop.is_set():
      try:
        self.replies[self.step(session)] += 1
      except requests.RequestException as e:
        self.replies[type(e).__name__] += 1

  def __enter__(self):
    for t in self.threads:
      t.start()
    time.sleep(0.5)  # the attack is under way before the innocents start
    return self

  def __exit__(self, *exc):
    self.stop.set()
    for t in self.threads:
      t.join()


def _max_batch(server: Server, latencies: list):
  max_len = server.engine.config.max_seq_len
  n = server.caps.max_batch_size
  body = {"input_ids": [[1, 2, 3, 4 + i % 50] for i in range(n)], "sampling_params": {"max_new_tokens": max_len - 4}}
  body["sampling_params"]["ignore_eos"] = True

  def step(session):
    t0 = time.perf_counter()
    r = session.post(f"{server.url}/generate", json=body, timeout=600)
    latencies.append(time.perf_counter() - t0)
    return r.status_code

  return _Loop(step)


def _raw_poster(url: str, route: str, data: bytes):
  return lambda session: session.post(f"{url}/{route}", data=data, timeout=600).status_code


def _stop_strings(server: Server):
  # The probe's body: 1.2M stop strings, 15 MB (under the default 16 MiB body cap, over the count cap).
  data = json.dumps({"input_ids": [1, 2], "sampling_params": {"stop": ["abcdefghi"] * 1_200_000}}).encode()
  return _Loop(_raw_poster(server.url, "generate", data))


def _prompt_bytes(server: Server):
  # Text just under the prompt-bytes cap: tokenized on the event loop, then refused as too many tokens.
  words = " ".join(f"w{i % 9973}" for i in range(server.caps.max_prompt_bytes // 6))
  return _Loop(_raw_poster(server.url, "generate", json.dumps({"text": words}).encode()))


def _rid_reuse(server: Server):
  body = {"input_ids": [5, 6, 7], "rid": "victim", "stream": True}
  body["sampling_params"] = {"max_new_tokens": server.engine.config.max_seq_len - 4, "ignore_eos": True}

  def step(session):
    with session.post(f"{server.url}/generate", json=body, stream=True, timeout=600) as r:
      for _ in r.iter_lines():
        pass  # the victim itself streams to the end (200); its reusers get 409
      return r.status_code

  return _Loop(step, threads=3)


def _bad_weights(server: Server, sync: str):
  bad = os.path.join(sync, "bad")
  os.makedirs(bad, exist_ok=True)
  header = json.dumps({"lm_head.weight": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 1 << 40]}}).encode()
  with open(os.path.join(bad, "m.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + b"\0" * 64)
  with open(os.path.join(bad, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": {"lm_head.weight": "m.safetensors"}}, f)
  data = json.dumps({"model_path": bad}).encode()
  return _Loop(_raw_poster(server.url, "update_weights_from_disk", data))


class _IdleConnections:
  """`total` connections that send part of a request's headers and never finish, held by child processes
  (each has its own fd limit); evicted or timed-out ones are reopened at once."""

  def __init__(self, server: Server, total: int):
    self.server, self.total, self.replies = server, total, collections.Counter()
    self.open_max, self._stop = 0, threading.Event()

  def _sample(self):  # the most connections the server held open at once during the run
    while not self._stop.wait(0.05):
      self.open_max = max(self.open_max, self.server.connections.open)

  def __enter__(self):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    per = max(1, min(self.total, hard - 256))
    counts = [per] * (self.total // per) + ([self.total % per] if self.total % per else [])
    me = [sys.executable, os.path.abspath(__file__)]
    self.kids = [
      subprocess.Popen(
        [*me, f"--hold_connections={self.server.url},{n}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
      )
      for n in counts
    ]
    for kid in self.kids:
      line = kid.stdout.readline().split()
      assert line and line[0] == b"holding", "attacker did not start"
      self.replies["opened"] += int(line[1])
    self._sampler = threading.Thread(target=self._sample, daemon=True)
    self._sampler.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._sampler.join()
    for kid in self.kids:
      kid.stdin.close()
    for kid in self.kids:
      kid.wait(60)


def hold_connections() -> None:
  """Child of `_IdleConnections`: holds N partial-header connections until stdin closes; prints
  `holding <k>` once k = N are open at the same time (or after 120 s)."""
  url, n = _HOLD.value.rsplit(",", 1)
  host, port = url.removeprefix("http://").rsplit(":", 1)
  os.nice(19)  # a real attacker is on another machine: its own CPU must not count against the server
  _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
  held = [0]

  async def one(connecting: asyncio.Semaphore):
    while True:
      async with connecting:  # connect in waves that fit the listen backlog
        try:
          reader, writer = await asyncio.open_connection(host, int(port))
          writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        except OSError:
          await asyncio.sleep(0.1)
          continue
      held[0] += 1
      with contextlib.suppress(OSError):
        await reader.read()  # until the server closes it (evicted, or its headers are late)
      held[0] -= 1
      writer.close()

  async def run():
    connecting = asyncio.Semaphore(256)
    tasks = [asyncio.create_task(one(connecting)) for _ in range(int(n))]
    deadline = time.monotonic() + 120
    while held[0] < int(n) and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    print("holding", held[0], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

  asyncio.run(run())


def hostile_mix(server: Server, sync: str, threads: int, per_thread: int, idle: int, reps: int) -> None:
  batch_latency: list[float] = []
  everything = {
    "max_batch": lambda: _max_batch(server, batch_latency),
    "stop_strings": lambda: _stop_strings(server),
    "prompt_bytes": lambda: _prompt_bytes(server),
    "idle_connections": lambda: _IdleConnections(server, idle),
    "rid_reuse": lambda: _rid_reuse(server),
    "bad_weights": lambda: _bad_weights(server, sync),
  }
  attacks = {name: everything[name] for name in _ATTACKS.value}
  open_max: list[int] = []
  alone, under, replies = [], collections.defaultdict(list), collections.defaultdict(collections.Counter)
  for rep in range(reps):
    alone.append(innocent_run(server.url, threads, per_thread))
    for name, attack in attacks.items():
      with attack() as a:
        under[name].append(innocent_run(server.url, threads, per_thread))
      replies[name].update(a.replies)
      if isinstance(a, _IdleConnections):
        open_max.append(a.open_max)
      print(f"rep {rep} {name}: p99 {under[name][-1]['p99']:.3f} s, alone {alone[-1]['p99']:.3f} s", file=sys.stderr)
  print(f"alone_innocent_p99_s={_fmt([r['p99'] for r in alone])}")
  print(f"alone_innocent_errors={sum(r['errors'] for r in alone)}")
  for name, runs in under.items():
    ratio = [u["p99"] / a["p99"] for u, a in zip(runs, alone)]
    print(f"{name}_innocent_p99_under_attack_over_alone={_fmt(ratio)}")
    print(f"{name}_innocent_p99_s={_fmt([r['p99'] for r in runs])}")
    print(f"{name}_innocent_errors={sum(r['errors'] for r in runs)}")
    print(f"{name}_attack_replies={dict(replies[name])}")
  if open_max:
    print(f"idle_connections_server_open={_fmt(open_max)} (most open at once per rep)")
  if batch_latency:
    print(f"max_batch_latency_s={_fmt(batch_latency)} ({server.caps.max_batch_size} prompts)")
  guard = server.connections
  print(f"connections_limit={guard.limit} evicted={guard.evicted} header_timeouts={guard.timed_out}")


# ---- the starve mix --------------------------------------------------------------------------------------
def _post_from(url: str, source: str, body: dict) -> tuple[int, float]:
  """POST /generate from the loopback address `source` (a peer of its own): (status, seconds)."""
  host, port = url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=3600, source_address=(source, 0))
  t0 = time.perf_counter()
  try:
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r.status, time.perf_counter() - t0
  finally:
    conn.close()


def _innocent(url: str, n: int) -> float:
  """Median latency of `n` innocent requests sent one after another from 127.0.0.2."""
  sp = {"max_new_tokens": _INNOCENT_TOKENS.value, "ignore_eos": True}
  lat = []
  for i in range(n):
    status, s = _post_from(url, "127.0.0.2", {"input_ids": [9, 8, 7, 6 + i], "sampling_params": sp})
    assert status == 200, status
    lat.append(s)
  return statistics.median(lat)


def starve_mix(reps: int) -> None:
  """The flood of one client against another client's small requests (module docstring)."""
  flood, tokens = _FLOOD.value, _FLOOD_TOKENS.value
  with tempfile.TemporaryDirectory() as tmp:
    max_len = 8 + max(tokens, _INNOCENT_TOKENS.value)
    k2jax.save_hf(K2Model(presets.get("tiny", max_position_embeddings=max_len), rngs=nnx.Rngs(0)), tmp)
    # Compiled on demand (every prefill bucket up to max_len took 226 s here); the warm-up rep (-1, not
    # counted) compiles what the measured ones use: the innocent's prefill, the flood's batched prefills.
    config = EngineConfig(max_slots=_STARVE_SLOTS.value, max_seq_len=max_len, precompile=False)
    server = Server(tmp, engine_config=config, port=0).start()
    try:
      alone, under, in_flight = [], [], []
      for rep in range(-1, reps):
        alone.append(_innocent(server.url, 3))
        body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        with concurrent.futures.ThreadPoolExecutor(flood) as pool:
          futures = [pool.submit(_post_from, server.url, "127.0.0.1", body) for _ in range(flood)]
          deadline = time.monotonic() + 300
          while server.fair.client_load("peer:127.0.0.1")[0] < flood and time.monotonic() < deadline:
            time.sleep(0.01)
          in_flight.append(server.fair.client_load("peer:127.0.0.1")[0])
          under.append(_innocent(server.url, 3))
          requests.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=60).raise_for_status()
          statuses = collections.Counter(f.result()[0] for f in futures)
        print(
          f"rep {rep}: alone {alone[-1]:.3f} s, under flood {under[-1]:.3f} s, flood {dict(statuses)}", file=sys.stderr
        )
        if rep < 0:  # the warm-up
          alone, under, in_flight = [], [], []
      ratio = [u / a for u, a in zip(under, alone)]
      print(f"starve_innocent_under_flood_over_alone={_fmt(ratio)}")
      print(f"starve_innocent_alone_s={_fmt(alone)}")
      print(f"starve_innocent_under_flood_s={_fmt(under)}")
      print(f"starve_flood_in_flight={_fmt(in_flight)} (of {flood} requests x {tokens} tokens, one peer)")
    finally:
      server.close()


def main(argv):
  del argv
  if _HOLD.value:  # a child process of the idle-connection attack
    return hold_connections()
  if "starve" in _MIX.value:
    starve_mix(_REPS.value)
    if not set(_MIX.value) & {"load", "hostile"}:
      return None
  with tempfile.TemporaryDirectory() as tmp:
    model, sync = os.path.join(tmp, "model"), os.path.join(tmp, "sync")
    os.makedirs(sync, mode=0o700)
    k2jax.save_hf(K2Model(presets.get("tiny", max_position_embeddings=64), rngs=nnx.Rngs(0)), model)
    config = EngineConfig(max_slots=16, max_seq_len=64, precompile=True)
    server = Server(model, engine_config=config, port=0, weights_root=sync).start()
    try:
      http_run(server, 8, 32, _NEW.value)  # compile every prefill bucket and the decode step
      direct_run(server, 32, _NEW.value)
      if "load" in _MIX.value:
        _load(server)
      if "hostile" in _MIX.value:
        hostile_mix(server, sync, _INNOCENTS.value, _INNOCENT_REQUESTS.value, _IDLE.value, _REPS.value)
    finally:
      server.close()


def _load(server: Server) -> None:
  n, new = _REQUESTS.value, _NEW.value
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


if __name__ == "__main__":
  app.run(main)
