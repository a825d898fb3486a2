"""Test setup: 8 fake CPU devices so every mesh test runs on CI, float32 matmuls everywhere, compiles kept in
JAX's persistent cache (optimisation levels: tests/xla_flags.py)."""

import os

from tests.xla_flags import SUITE_CACHE_ENV, compile_level, launcher_cache, xla_flags  # noqa: E402

# The pytest processes compile at LLVM level 0, as the launchers they start: most test files compile far more
# than they run. The files marked `optimized` (pytest.ini), which run hundreds of steps in process, compile at
# level 1 (tests/xla_flags.py has the measurements).
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

import jax  # noqa: E402
from jax import monitoring  # noqa: E402

from k2jax import compile_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# JAX's persistent compilation cache for the suite's own compiles, in the directory the launchers it starts use
# by default (k2jax/compile_cache.py): test files compile the same tiny programs again (the model, its train
# step, the engine's buckets) in other processes. The summary line at the end says what it saved.
# Programs that compile in 0.25 s or more are written (JAX's default: 1 s); the variable reaches the children too.
# (Setting jax_compilation_cache_max_size here made every lookup miss in jax 0.10: left at its default.)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
jax.config.update(
  "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
)
jax.config.update("jax_compilation_cache_dir", compile_cache.DEFAULT_DIR)
_CACHE_STATS = {
  "compiles": 0,
  "compile_s": 0.0,
  "trace_s": 0.0,
  "lower_s": 0.0,
  "hits": 0,
  "saved_s": 0.0,
  "written": 0,
}
# Python-side seconds before each backend compile: tracing to a jaxpr, and lowering it to StableHLO.
_FRONT_END = {
  "/jax/core/compile/jaxpr_trace_duration": "trace_s",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
}
# Backend compile seconds per test file in this process (the file running when each compile ended).
_COMPILE_S: dict[str, float] = {}
_CURRENT = [""]
# CPU seconds (user + sys) per test file, this process's and its waited-for children's (the launchers a test
# starts): on 2 cores the suite's wall time is its CPU time over 2, so this, not --durations' wall seconds (which
# count the other worker's load), says which files to make cheaper.
_CPU_S: dict[str, float] = {}


def _add(per_file: dict[str, float], seconds: dict[str, float]) -> None:
  for path, s in seconds.items():
    per_file[path] = per_file.get(path, 0.0) + s


def _on_duration(event, seconds, **kwargs):
  if event == "/jax/core/compile/backend_compile_duration":
    _CACHE_STATS["compiles"] += 1
    _CACHE_STATS["compile_s"] += seconds
    _add(_COMPILE_S, {_CURRENT[0]: seconds})
  elif event in _FRONT_END:
    _CACHE_STATS[_FRONT_END[event]] += seconds
  elif event == "/jax/compilation_cache/compile_time_saved_sec":
    _CACHE_STATS["saved_s"] += seconds


def _on_event(event, **kwargs):
  if event == "/jax/compilation_cache/cache_hits":
    _CACHE_STATS["hits"] += 1
  elif event == "/jax/compilation_cache/cache_misses":
    _CACHE_STATS["written"] += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)

# The heaviest files first, heaviest at the top: CPU seconds of each file (this process's and its children's) in a
# cold run of the whole suite from a fresh clone (2026-12-07, 2 workers on 2 cores, `suite_cpu_s=2034`; the
# summary line prints them). scripts/test.sh runs `-n 2 --dist loadfile --no-loadscope-reorder`: xdist hands out
# whole files in this order as workers free up. Its default order (most tests per file first) put these one- and
# two-test files last, so one worker ran them alone while the other sat idle.
HEAVY_FIRST = (
  "tests/test_recipe.py",  # 199: the whole recipe (pretrain, SFT, RL, three evals)
  "tests/rl/test_rl_colocated.py",  # 161: four RL runs, one of them 2-process
  "tests/rl/test_critic_loop.py",  # 129: an 8-iteration RL run with the critic (bench/critic_loop.py)
  "tests/rl/test_learner.py",  # 81: its module fixture
  "tests/rl/test_rl_processes.py",  # 70
  "tests/serve/test_serve_processes.py",  # 69
  "tests/engine/test_engine_mesh.py",  # 69
  "tests/train/test_multihost.py",  # 65: its 2-process run carries the eval.tasks checks too
  "tests/rl/test_swe_launch.py",  # 54
  "tests/rl/test_rl_mesh.py",  # 51
  "tests/train/test_loss.py",  # 45: the README demo's 300 steps
  "tests/train/test_pipeline.py",  # 43
  "tests/sharding/test_context_parallel.py",  # 43
  "tests/rl/test_agentic_launch.py",  # 36
  "tests/sandbox/test_humaneval.py",  # 31: the official harness in its own interpreter
  "tests/train/test_resume.py",  # 28
  "tests/train/test_torn_resume.py",  # 25
  "tests/serve/test_likelihood.py",  # 24
  "tests/test_accel.py",  # 22: bench/gpu.py --smoke's three child processes
  "tests/train/test_heldout.py",  # 21
  "tests/serve/test_lmeval.py",  # 21
  "tests/rl/test_rl_eval.py",  # 17
  "tests/rl/test_int4_rollouts.py",  # 14: two in-process learners (INT4 rollouts, QAT off and on)
  "tests/convert/test_writer.py",  # 14
  "tests/sharding/test_two_process.py",  # 11
  "tests/convert/test_reader_processes.py",  # 10
  "tests/eval/test_curves.py",  # 10
  "tests/test_distributed.py",  # 7
  "tests/eval/test_embedded.py",  # 7
  "tests/rl/test_critic.py",  # 5
  "tests/eval/test_http.py",  # 4
)


def pytest_collection_modifyitems(config, items):
  """HEAVY_FIRST files first; a stable sort, so every file keeps its own test order (module fixtures)."""
  rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def _cpu_seconds() -> float:
  own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  start = _cpu_seconds()
  path = _CURRENT[0] = item.nodeid.split("::", 1)[0]
  # Setup (module fixtures included), call and teardown at the file's level.
  compile_level(1 if item.get_closest_marker("optimized") else None)
  yield
  _add(_CPU_S, {path: _cpu_seconds() - start})


def pytest_configure(config):
  """The controller makes the directory where every process leaves its compile counts (xdist workers start
  later and inherit it)."""
  if not hasattr(config, "workerinput"):
    os.environ["K2JAX_SUITE_STATS"] = tempfile.mkdtemp(prefix="k2jax-suite-stats-")
    os.environ.pop(SUITE_CACHE_ENV, None)  # a fresh one per suite run (tests/xla_flags.py)
    launcher_cache()


def pytest_sessionfinish(session):
  if not hasattr(session.config, "workerinput"):  # the controller, after every worker has finished
    shutil.rmtree(os.environ.get(SUITE_CACHE_ENV, ""), ignore_errors=True)
  stats_dir = os.environ.get("K2JAX_SUITE_STATS")
  if stats_dir and os.path.isdir(stats_dir):
    with open(os.path.join(stats_dir, f"{os.getpid()}.json"), "w") as f:
      json.dump({**_CACHE_STATS, "cpu_s": _CPU_S, "file_compile_s": _COMPILE_S}, f)


def pytest_terminal_summary(terminalreporter):
  stats_dir = os.environ.get("K2JAX_SUITE_STATS")
  if not stats_dir or not os.path.isdir(stats_dir):
    return
  total, cpu, compile_s = dict.fromkeys(_CACHE_STATS, 0), {}, {}
  for name in os.listdir(stats_dir):
    with open(os.path.join(stats_dir, name)) as f:
      stats = json.load(f)
    _add(cpu, stats.pop("cpu_s", {}))
    _add(compile_s, stats.pop("file_compile_s", {}))
    for k, v in stats.items():
      total[k] += v
  top = sorted(cpu.items(), key=lambda kv: -kv[1])
  terminalreporter.write_line(
    f"suite_cpu_s={sum(cpu.values()):.0f} (user + sys of the pytest processes and the launchers they waited for); "
    "heaviest files: " + ", ".join(f"{path}={seconds:.0f}" for path, seconds in top[:20])
  )
  terminalreporter.write_line(
    f"suite_compiles={total['compiles']} compile_s={total['compile_s']:.0f} trace_s={total['trace_s']:.0f} "
    f"lower_s={total['lower_s']:.0f} (pytest processes; the launchers they start log their own) "
    f"persistent_cache_hits={total['hits']} saved_s={total['saved_s']:.0f} "
    f"written={total['written']}; most compile seconds: "
    + ", ".join(f"{path}={seconds:.0f}" for path, seconds in sorted(compile_s.items(), key=lambda kv: -kv[1])[:20])
  )
