"""SWE environment throughput: scripted episodes that apply the gold patch through the tools, concurrently.

  python bench/swe_env.py [--levels=8,32,128] [--reps=5] [--tasks=data/swe/toy_tasks]

Per concurrency level, `reps` rounds of N concurrent episodes (reset -> str_replace_editor create of each
file the gold patch changes -> finish, which grades the workspace's diff in a fresh sandbox) on one shared
workspace pool; printed: episodes/s and p50/p99 workspace-ready latency (reset's wait for a workspace), as
median with [min,max] over the rounds, the resolved share (must be 1.0), and leaked live workspaces, temp
dirs and sandbox processes after each level (target 0). Then grading seconds per task against running the
same tests directly (pytest in a subprocess on a prepared tree, no sandbox, no patch steps), interleaved:
`grade_over_direct` (target <= 1.5).
"""

import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench.interleave import fmt, load_average, ratio, time_interleaved  # noqa: E402
from k2jax.agentic.envs.swe import SweEnv, SweEnvConfig  # noqa: E402
from k2jax.sandbox.workspace import WorkspaceRunConfig, default_python_paths  # noqa: E402
from k2jax.swe import snapshot  # noqa: E402
from k2jax.swe.grade import GradeConfig, grade  # noqa: E402
from k2jax.swe.instances import read_instances  # noqa: E402
from k2jax.swe.workspace import PoolConfig, WorkspacePool  # noqa: E402

_LEVELS = flags.DEFINE_list("levels", ["8", "32", "128"], "Concurrent episodes per round ('' = grading only).")
_REPS = flags.DEFINE_integer("reps", 5, "Rounds per level (and interleaved grading repetitions).")
_TASKS = flags.DEFINE_string("tasks", "data/swe/toy_tasks", "Built task set (instances.jsonl + snapshots).")


def _gold_files(inst, root) -> dict[str, str]:
  """The files the gold patch changes, with their fixed text (what the scripted agent writes)."""
  with tempfile.TemporaryDirectory() as tmp:
    work = os.path.join(tmp, "r")
    snapshot.copy_tree(inst.snapshot_dir(root), work)
    snapshot.apply_patch(inst.patch, work)
    rels = [line[6:] for line in inst.patch.splitlines() if line.startswith("+++ b/")]
    return {rel: open(os.path.join(work, rel)).read() for rel in rels}


def _call(name, **args):
  import json

  fn = {"name": name, "arguments": json.dumps(args)}
  return {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": f"functions.{name}:0", "type": "function", "function": fn}],
  }


def _episode(env_cfg, pool, root, inst, files) -> tuple[float, float]:
  env = SweEnv(config=env_cfg, pool=pool)
  try:
    t0 = time.monotonic()
    env.reset({"id": inst.instance_id, "instruction": "fix", "instance_id": inst.instance_id, "task_set": root})
    ready = time.monotonic() - t0
    for rel, text in files.items():
      env.step(_call("str_replace_editor", command="create", path=rel, file_text=text))
    end = env.step(_call("finish"))
    return ready, end.reward
  finally:
    env.close()


def _leaks(pool) -> tuple[int, int, int]:
  """(live workspaces, dirs that are neither ready nor live, processes naming this run's temp dir) once the
  pool's prepare workers are idle: a copy still being made is not a leak, one left behind is."""
  pool.wait_idle()
  c = pool.counts()
  stray = len(
    [
      n
      for n in os.listdir(tempfile.gettempdir())
      if not os.path.samefile(os.path.join(tempfile.gettempdir(), n), pool.root)
    ]
  )
  procs = 0
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      procs += tempfile.gettempdir() in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
      pass
  return c["live"], c["dirs"] - c["ready"] - c["live"] - c["preparing"] + stray, procs


def main(argv):
  del argv
  root = os.path.abspath(_TASKS.value)
  tempfile.tempdir = tempfile.mkdtemp(prefix="k2jax-bench-swe-")  # leaks are counted in this run's own dir
  instances = read_instances(os.path.join(root, "instances.jsonl"))
  files = {i.instance_id: _gold_files(i, root) for i in instances}
  run = WorkspaceRunConfig(timeout_s=120.0, python_paths=default_python_paths())
  env_cfg = SweEnvConfig(bash=run, grade=GradeConfig(run=run))
  print(f"swe_env tasks={len(instances)} {load_average()}")
  for level in map(int, _LEVELS.value):
    pool = WorkspacePool(PoolConfig(ready_per_instance=max(2, level // len(instances)), max_ready=2 * level))
    rates, p50s, p99s, resolved = [], [], [], []
    for _ in range(_REPS.value):
      picks = [instances[k % len(instances)] for k in range(level)]
      t0 = time.monotonic()
      with concurrent.futures.ThreadPoolExecutor(level) as ex:
        out = list(ex.map(lambda i: _episode(env_cfg, pool, root, i, files[i.instance_id]), picks))
      rates.append(level / (time.monotonic() - t0))
      ready = sorted(r for r, _ in out)
      p50s.append(ready[len(ready) // 2])
      p99s.append(ready[min(len(ready) - 1, int(0.99 * len(ready)))])
      resolved.append(sum(r for _, r in out) / level)
    live, dirs, procs = _leaks(pool)
    pool.close()
    print(
      f"concurrency={level} episodes_per_s={_med(rates, 2)} ready_p50_ms={_med(p50s, 0, 1e3)} "
      f"ready_p99_ms={_med(p99s, 0, 1e3)} resolved={min(resolved):.2f} reps={_REPS.value} "
      f"leaked_workspaces={live} leaked_dirs={dirs} leaked_procs={procs} {load_average()}"
    )
  _grading_ratio(instances, root, run)
  os.rmdir(tempfile.tempdir)  # empty: anything left would be a leak (and fails here, loudly)


def _grading_ratio(instances, root, run):
  inst = instances[0]
  with tempfile.TemporaryDirectory() as tmp:
    direct_tree = os.path.join(tmp, "r")
    snapshot.copy_tree(inst.snapshot_dir(root), direct_tree)
    snapshot.apply_patch(inst.patch, direct_tree)
    tests = list(inst.FAIL_TO_PASS + inst.PASS_TO_PASS)
    # The sandbox's interpreter, the same site-packages on PYTHONPATH and the same pytest options (no plugin
    # autoload): what differs is only the isolation and the grader's copy / patch / restore steps.
    paths = os.pathsep.join((direct_tree, *run.python_paths))
    env = {
      "PATH": "/usr/bin:/bin",
      "PYTHONPATH": paths,
      "PYTHONDONTWRITEBYTECODE": "1",
      "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    cmd = [_sandbox_python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]

    def direct():
      r = subprocess.run(cmd, cwd=direct_tree, env=env, capture_output=True, check=False)
      assert r.returncode == 0, r.stdout[-500:]

    def graded():
      assert grade(inst, inst.patch, root, GradeConfig(run=run)).resolved

    times = time_interleaved({"grade": graded, "direct": direct}, _REPS.value)
  g, d = statistics.median(times["grade"]), statistics.median(times["direct"])
  print(f"grade_s={g:.3f} direct_s={d:.3f} " + fmt("grade_over_direct", ratio(times, "grade", "direct"), _REPS.value))


def _sandbox_python() -> str:
  from k2jax.sandbox.runner import _python_for
  from k2jax.sandbox.workspace import sandbox_uid

  return _python_for(sandbox_uid())


def _med(xs, digits, scale=1.0):
  xs = [x * scale for x in xs]
  return f"{statistics.median(xs):.{digits}f}[{min(xs):.{digits}f},{max(xs):.{digits}f}]"


if __name__ == "__main__":
  app.run(main)
