"""XLA_FLAGS for the suite's processes and the children they start (tests/conftest.py sets the suite's own).

Two LLVM optimisation levels, both below XLA:CPU's default (2); all three compute the same floats (LLVM does not
reassociate them without fast-math: the tiny run's loss printed equal to the last digit, 8.28056812286377, at 0 and
at 2), and every child gets the same flags as the test that compares against it, so bitwise checks compare like
with like.

- Level 0 (FAST_COMPILE) in the children the suite starts by default: most of them are compile-bound (tiny
  models, hundreds of programs, one per shape, a few steps each), and level 0 halves a compile (the tiny train
  step: 13.8 -> 7.0 s here, the whole 3-step `launch/train.py` run 27.5 -> 17.6 s). A step runs ~2x slower at
  level 0: tests/train/test_resume + test_torn_resume (compile-bound) took 188 CPU-s at level 0 against 280 at 2,
  while the recipe's first four stages (hundreds of steps) took 252 s against 136 s.
- Level 1 (OPTIMIZE) in the children that run many steps (`optimize=True`) and in the test files marked
  `optimized` (pytest.ini; tests/conftest.py compiles their programs at level 1 through `compile_level`): it
  compiles ~25% faster than level 2 and its programs run as fast. User + sys CPU seconds per test file, one
  pytest process on a fresh compile cache each, level 2 / 1 / 0, with XLA's MLIR fusion emitters (before
  LEGACY_EMITTERS below; 2026-12-07, a 2-core AMD EPYC, jax 0.10.2):
  tests/sharding/test_equivalence.py (compile-bound) 92 / 73 / 57, tests/engine/test_engine_mesh.py (decode
  loops) 121 / 95 / 233, tests/rl/test_learner.py 155 / 143 / 159.
- The pytest processes compile at level 0 too (tests/conftest.py), but for the `optimized` files. The 43 test
  files that compiled 3 s or more in the pytest processes, with 2 xdist workers on a fresh compile cache, at
  level 1 in a cold run of the whole suite and at level 0 in a run of those files only (2026-12-07, the same
  host, jax 0.10.2): 1352 against 1025 CPU-s, every test passing at both levels. At level 0: tests/sharding/test_context_parallel.py
  107 -> 56, tests/rl/test_rl_mesh.py 116 -> 66, tests/train/test_pipeline.py 97 -> 59, and no file of the 41
  others costlier by more than 3 CPU-s but the two that run hundreds of steps in process, now `optimized`:
  tests/rl/test_learner.py 86 -> 118 and tests/engine/test_engine_mesh.py 98 -> 142.

Every process also takes LEGACY_EMITTERS: XLA:CPU's older elemental emitters for loop fusions instead of its
MLIR fusion emitters. The tiny model's fwd+bwd on one device compiles in 3.4 CPU-s against 6.9 (8 devices, fsdp:
5.3 against 14.0; fsdp + expert parallelism, whose searchsorted loops the older emitters leave unfused: 16 against
14), and its steps run as fast. Per test file at level 1 (the launchers at 0), with / without: tests/train/test_resume.py
(launchers) 62 / 49 CPU-s, tests/rl/test_learner.py 174 / 123, tests/sharding/test_equivalence.py 99 / 82,
tests/engine/test_engine_mesh.py 108 / 104 (2026-12-07, the same host beside another job, jax 0.10.2).

Per stage of tests/test_recipe.py's scripts/recipe.sh at levels 0 and 2 (user + sys CPU seconds from
`/usr/bin/time`, each run on a fresh compile cache, 2026-12-06, the same host shared with other jobs, jax 0.10.2),
none of which pays for a per-stage level: the RL stage (40 iterations from the SFT workdir) took 179 CPU-s at
level 0 against 167 at 2; `launch/eval.py` on the SFT model (1800 answers, compile-bound: 64 or 2048 cache
positions cost the same, 59 against 60, with the same 1800 answers) 53 against 60, and only the first of the
recipe's three evaluations compiles (the later two load its programs). Single-threaded dots (SECOND_HOST below)
cost more CPU, not less: the tiny config's 300 steps (tests/train/test_loss.py's run) took 81 CPU-s against 68
multi-threaded.
"""

import functools
import os
import tempfile

FAST_COMPILE = "--xla_backend_optimization_level=0"
OPTIMIZE = "--xla_backend_optimization_level=1"
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# One persistent compilation cache for the launchers the suite starts with an explicit cache (RL and resume
# runs, which cache every program: min compile time and entry size 0), made once per suite run by the
# controller (tests/conftest.py) and shared by every test file and xdist worker: the 8-device trainer programs
# of tests/rl/test_rl_colocated.py and test_rl_processes.py, and the 1-device ones of the resume tests, are the
# same programs. Per-test caches compiled each of them once per file. Fresh per run, so a local suite measures
# the cold start CI has.
SUITE_CACHE_ENV = "K2JAX_SUITE_LAUNCHER_CACHE"


def launcher_cache() -> str:
  """The suite's shared launcher compile cache (a fresh directory when run outside the suite's conftest)."""
  if not os.environ.get(SUITE_CACHE_ENV):
    os.environ[SUITE_CACHE_ENV] = tempfile.mkdtemp(prefix="k2jax-launcher-cache-")
  return os.environ[SUITE_CACHE_ENV]


# A second host configuration for the runs that compare floats across process counts or layouts: XLA:CPU's
# dots single-threaded, another intra-op split of the same work than the host's Eigen thread pool gives. How
# Eigen splits a contraction over its pool depends on the host (its cores, the processes sharing them), so
# equality across layouts checked under one split holds on some hosts and not others (a rollout
# token differed on a 2-core AMD host). The cross-layout runs take this configuration on one side, so a
# result that depends on the split fails on every host. Results compared with each other under the SAME
# configuration (a resume after SIGKILL against the uninterrupted run: one program, one thread count) stay
# bitwise: the split is a function of the shapes and the thread count, not of timing.
SECOND_HOST = "--xla_cpu_multi_thread_eigen=false"


def xla_flags(devices: int = 0, optimize: bool = False, second_host: bool = False) -> str:
  """`devices` fake CPU devices (0: the platform's own, one), at FAST_COMPILE unless `optimize` (OPTIMIZE: for
  runs of many steps), with LEGACY_EMITTERS, under SECOND_HOST's intra-op threading if `second_host`."""
  return " ".join(
    ([f"--xla_force_host_platform_device_count={devices}"] if devices else [])
    + [OPTIMIZE if optimize else FAST_COMPILE, LEGACY_EMITTERS]
    + ([SECOND_HOST] if second_host else [])
  )


# The LLVM level the pytest process compiles at now: None leaves XLA_FLAGS' level (tests/conftest.py sets it per
# test file, from the file's `optimized` marker).
_LEVEL: list[int | None] = [None]


def compile_level(level: int | None) -> None:
  """Every program this process compiles from now on at LLVM level `level` (None: XLA_FLAGS' level), for every
  thread. XLA reads XLA_FLAGS once per process; jax passes a compile's own XLA options (`jax.jit`'s
  `compiler_options`, part of the persistent cache's key) to XLA through `get_compile_options`'s
  `env_options_overrides`, which `_patch_compile_options` extends with this level."""
  _patch_compile_options()
  _LEVEL[0] = level


@functools.cache
def _patch_compile_options() -> None:
  # jax has no process-wide setting for a compile option that XLA_FLAGS did not set at start-up, so this wraps
  # the function every jit compile takes its options from (jax._src.compiler, private: checked with jax 0.10.2;
  # tests/test_xla_flags.py fails if the level stops reaching the options of a real compile).
  from jax._src import compiler  # noqa: PLC0415

  original = compiler.get_compile_options

  @functools.wraps(original)
  def get_compile_options(*args, env_options_overrides=None, **kwargs):
    if _LEVEL[0] is not None:
      env_options_overrides = {"xla_backend_optimization_level": _LEVEL[0], **(env_options_overrides or {})}
    return original(*args, env_options_overrides=env_options_overrides, **kwargs)

  compiler.get_compile_options = get_compile_options
