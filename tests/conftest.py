"""Test setup: 8 fake CPU devices so every mesh test runs on CI, float32 matmuls everywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The heaviest files first, heaviest at the top (seconds on CI's 2 cores, from `--durations`: colocated RL
# 326, RL processes 362 before it lost a run, RL mesh ~220, the RL learners' shared runs ~150 each (learner,
# critic), torn resume ~110 before it lost a run, then the other launcher / multi-process / SIGKILL files; the
# held-out files (five trainer launches, one of two processes), HumanEval (164 problems, each in two sandboxes
# and the official harness) and lm-eval (a server, transformers and the harness) are ranked by what they run).
# scripts/test.sh runs `-n 2 --dist loadfile --no-loadscope-reorder`: xdist hands out whole files in this
# order as workers free up. Its default order (most tests per file first) (3.5+) put these one- and two-test
# files last, so one worker ran them alone while the other sat idle.
HEAVY_FIRST = (
  "tests/test_recipe.py",  # the whole recipe (pretrain, SFT, RL, six evals): ~6-11 min here
  "tests/rl/test_rl_processes.py",
  "tests/rl/test_rl_colocated.py",
  "tests/rl/test_rl_mesh.py",
  "tests/train/test_heldout.py",
  "tests/rl/test_learner.py",
  "tests/rl/test_critic.py",
  "tests/rl/test_rl_eval.py",
  "tests/train/test_torn_resume.py",
  "tests/rl/test_swe_launch.py",
  "tests/rl/test_agentic_launch.py",
  "tests/sandbox/test_humaneval.py",
  "tests/serve/test_lmeval.py",
  "tests/convert/test_reader_processes.py",
  "tests/convert/test_writer.py",
  "tests/train/test_resume.py",
  "tests/train/test_multihost.py",
  "tests/sharding/test_two_process.py",
  "tests/serve/test_serve_processes.py",
  "tests/serve/test_likelihood.py",  # ~80-170 s here: shared tiny server, a scored prefill program
  "tests/eval/test_embedded.py",  # ~90-115 s here: export + engine + forward scorer
  "tests/eval/test_http.py",
  "tests/test_distributed.py",  # two small processes ending 8 s apart, twice
)


def pytest_collection_modifyitems(config, items):
  """HEAVY_FIRST files first; a stable sort, so every file keeps its own test order (module fixtures)."""
  rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
