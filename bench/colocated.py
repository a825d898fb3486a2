"""Colocated RL iteration vs the same iteration with a separate engine process fed through files.

Run: python bench/colocated.py [--reps 5] [--dir /tmp/bench_colocated]
8 fake CPU devices in this process; the tiny RL config (configs/rl.py:tiny, no warm start; PTX on, so every
update changes every tensor and the remote push cannot skip unchanged ones by CRC) with
16 rollouts of <= 4 tokens per iteration and the trainer on `mesh.fsdp=8`. Two learners, their iterations
interleaved (A B A B ...):
  colocated  the embedded engine on the trainer's 8 devices (`engine.sharding=tp_ep`, expert:4,tensor:2):
             generate (engine resumes, rollouts, pause, KV cache freed), offload (optimizer state to
             pinned_host before generating + back after), update (one K2 RL step), reshard (the new
             weights device to device onto the serving layout; no file)
  remote     `launch/serve.py` in another process (the same 8-device tp_ep engine) driven over HTTP:
             generate, update, push = per-process safetensors of the changed tensors + /update_weights_from_disk
Prints, per phase, median seconds with [min, max] over the reps, and
  colocated_over_remote = colocated iteration / remote iteration (median of per-rep ratios; target <= 0.5)
  cpu_s / colocated_over_remote_cpu: CPU seconds of the iteration, this process and the server's together
             (on a shared host CPU time moves far less with the neighbours' load than wall time)
  file_push_share_of_remote: the remote iteration's push / its whole: the only part colocation removes, so
             with generate and update costing the same on both sides the ratio stays >= 1 - that share
On a CPU host both engines share the same cores and "host memory" is the same RAM: the figures measure
the mechanics (no file round trip, no HTTP), not HBM savings; untested on TPU/GPU.

`--aot=v5p-1024` also compiles `configs/rl.py:1t`'s colocated iteration for that slice (k2jax/rl/aot.py; Python
>= 3.12 with libtpu, else it prints `aot_skipped=` and why) and prints XLA's figures:
  generate_peak_gib_per_device= update_peak_gib_per_device= reshard_bytes_per_device= fits= (+ headroom)
`--aot_only` skips the CPU iterations.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import k2jax  # noqa: E402
from bench.interleave import fmt, load_average, ratio  # noqa: E402
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer  # noqa: E402
from k2jax.model import K2Model, presets  # noqa: E402
from k2jax.rl import learner as learner_lib  # noqa: E402
from k2jax.rl import tasks as tasks_lib  # noqa: E402

SERVING = {"engine.sharding": "tp_ep", "engine.mesh": "expert:4,tensor:2"}
COMMON = {
  "warm_start.steps": 0,
  "rollout.group_size": 4,
  "rollout.target_groups": 4,
  "rollout.launch_groups": 4,
  "rollout.partial_rollout": False,
  "eval.every": 0,
  "engine.max_slots": 16,
  "checkpoint.every": 10**6,
  "iterations": 10**6,
}


def _config(overrides: dict):
  from configs.rl import get_config

  c = get_config("tiny")
  c.unlock()
  for key, value in {**COMMON, **overrides}.items():
    *path, last = key.split(".")
    target = c
    for part in path:
      target = target[part]
    target[last] = value
  c.lock()
  return c


def _learner(config, workdir):
  tok = load_tokenizer(BUNDLED_TOKENIZER)
  task = tasks_lib.make_tasks(config, tok)
  lc = learner_lib.from_config_dict(config, workdir, tasks_lib.stop_ids(task, tok))
  learner = learner_lib.Learner(lc, workdir, task, tasks_lib.strip_stop(tok.decode, lc.rollout.stop_token_ids))
  learner._push(full=True)
  learner.meta["warm_start_done"] = True
  return learner


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _server(model_dir: str, root: str, port: int) -> subprocess.Popen:
  cmd = [sys.executable, os.path.join(ROOT, "launch/serve.py"), f"--model={model_dir}", f"--port={port}"]
  cmd += ["--max_running_requests=16", "--max_seq_len=64", "--tokenizer=none", f"--weights_root={root}"]
  cmd += ["--sharding=tp_ep", "--mesh=expert:4,tensor:2", "--noprecompile"]
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--dir", default="/tmp/bench_colocated")
  ap.add_argument("--aot", default="", help="also compile configs/rl.py:1t for this TPU slice, e.g. v5p-1024")
  ap.add_argument("--aot_only", action="store_true", help="only the --aot figures")
  args = ap.parse_args()
  if not args.aot_only:
    _cpu_iterations(args)
  if args.aot:
    _aot_figures(args.aot)


def _cpu_iterations(args) -> None:
  shutil.rmtree(args.dir, ignore_errors=True)
  os.makedirs(args.dir)
  k2jax.save_hf(K2Model(presets.get("tiny"), rngs=nnx.Rngs(0)), os.path.join(args.dir, "served"))
  port = _free_port()
  server = _server(os.path.join(args.dir, "served"), args.dir, port)
  try:
    colo = _learner(_config(SERVING), os.path.join(args.dir, "colocated"))
    remote = _learner(
      _config({"rollout.engine_url": f"http://127.0.0.1:{port}", "sync.root": os.path.join(args.dir, "weights")}),
      os.path.join(args.dir, "remote"),
    )
    for learner in (colo, remote):  # compiles: every program of an iteration once
      learner.iteration()
    rows = {"colocated": [], "remote": []}
    for _ in range(args.reps):
      for name, learner in (("colocated", colo), ("remote", remote)):
        cpu0 = time.process_time() + _cpu_seconds(server.pid)
        rec = learner.iteration()
        rec["cpu_s"] = time.process_time() + _cpu_seconds(server.pid) - cpu0
        rows[name].append(rec)
    _report(rows, args.reps)
    colo.close()
    remote.close()
  finally:
    server.terminate()
    server.wait(timeout=60)


def _cpu_seconds(pid: int) -> float:
  """User + system CPU seconds of process `pid` so far (Linux /proc; fields 14 and 15 of its stat)."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _aot_figures(slice_name: str) -> None:
  """XLA's per-device figures of `1t`'s colocated iteration on `slice_name` (one compile, no repetitions:
  the compiler's numbers are deterministic)."""
  from k2jax.train import aot

  why = aot.libtpu_available()
  if why:
    print(f"aot_skipped=true reason={why}")
    return
  from configs.rl import get_config
  from k2jax.rl import aot as rl_aot

  r = rl_aot.compile_rl(get_config("1t"), slice_name)
  keys = ("slice", "wiring", "engine_mesh", "trainer_mesh", "generate_peak_gib_per_device")
  keys += ("generate_headroom_gib_per_device", "update_peak_gib_per_device", "update_headroom_gib_per_device")
  keys += ("reshard_bytes_per_device", "offload_bytes_per_device", "fits")
  print("aot_1t: " + " ".join(f"{k}={str(r[k]).lower() if isinstance(r[k], bool) else r[k]}" for k in keys))


def _phase_seconds(rec: dict) -> dict:
  s = {"generate": rec["rollout_time_s"], "update": rec["train_time_s"], "push": rec["sync_time_s"]}
  s["offload"] = rec.get("offload_time_s", 0.0) + rec.get("restore_time_s", 0.0)
  s["generate"] -= s["offload"]  # both moves run inside the learner's rollout timer (phases.generation)
  s["iteration"] = s["generate"] + s["offload"] + s["update"] + s["push"]
  s["cpu"] = rec["cpu_s"]
  return s


def _report(rows: dict, reps: int) -> None:
  times = {name: [_phase_seconds(r) for r in recs] for name, recs in rows.items()}
  print(f"devices={jax.device_count()} rollouts_per_iteration=16 {load_average()}")
  for name, per in times.items():
    label = {"push": "reshard" if name == "colocated" else "file_push"}
    parts = []
    for phase in ("generate", "offload", "update", "push", "iteration", "cpu"):
      xs = [p[phase] for p in per]
      parts.append(f"{label.get(phase, phase)}_s={statistics.median(xs):.4f}[{min(xs):.4f},{max(xs):.4f}]")
    print(f"{name}: " + " ".join(parts))
  it = {name: [p["iteration"] for p in per] for name, per in times.items()}
  print(fmt("colocated_over_remote", ratio(it, "colocated", "remote"), reps) + " target<=0.5")
  cpu = {name: [p["cpu"] for p in per] for name, per in times.items()}
  print(fmt("colocated_over_remote_cpu", ratio(cpu, "colocated", "remote"), reps))
  push = {name: [p["push"] for p in per] for name, per in times.items()}
  print(fmt("reshard_over_file_push", ratio(push, "colocated", "remote"), reps))
  share = [p["push"] / p["iteration"] for p in times["remote"]]
  print(
    f"file_push_share_of_remote={statistics.median(share):.3f} (the part colocation removes; the bound on the ratio)"
  )


if __name__ == "__main__":
  main()
