"""Build SWE tasks offline: `python launch/swe_build.py --sources=DIR --out=TASKS [--max_bugs=50 ...]`.

DIR holds sdists (`scripts/swe_sources.sh DIR` downloads the pinned, sha256-checked list in
configs/data/swe_sources.txt) and/or unpacked source trees named NAME-VERSION (data/swe/toy has two). Writes
TASKS/instances.jsonl (SWE-bench rows), TASKS/rl_tasks.jsonl (for configs/rl.py's "swe" tasks) and
TASKS/snapshots/. Grade predictions with `python -m k2jax.swe.grade --instances=TASKS/instances.jsonl ...`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

_SOURCES = flags.DEFINE_string("sources", None, "Dir of sdists / NAME-VERSION source trees.", required=True)
_OUT = flags.DEFINE_string("out", None, "Task set dir to write.", required=True)
_MAX_BUGS = flags.DEFINE_integer("max_bugs", 50, "Procedural bugs kept per package.")
_CANDIDATES = flags.DEFINE_integer("max_candidates", 200, "Mutations tried per package (seeded sample).")
_COMBOS = flags.DEFINE_integer("combos", 10, "Combination tasks (2-3 bugs) per package.")
_RUNS = flags.DEFINE_integer("runs", 3, "Baseline suite runs: tests must pass in all of them.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 120.0, "Deadline of one suite run (SWE-smith validation: 120 s).")
_WORKERS = flags.DEFINE_integer("workers", 0, "Validations at once (0 = CPU count).")
_SEED = flags.DEFINE_integer("seed", 0, "Mutation sampling seed.")
_TURNS = flags.DEFINE_integer("max_turns", 0, "Turn limit written into rl_tasks.jsonl (0 = the env's default).")
_LLM_URL = flags.DEFINE_string("llm_url", "", "OpenAI-compatible endpoint for issue texts ('' = templates).")
_LLM_MODEL = flags.DEFINE_string("llm_model", "default", "Model name sent to --llm_url.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from k2jax.sandbox.workspace import WorkspaceRunConfig, default_python_paths
  from k2jax.swe import build, taskset

  llm = None
  if _LLM_URL.value:
    from k2jax.llm_client import ChatClient, ChatConfig

    llm = ChatClient(ChatConfig(_LLM_URL.value, model=_LLM_MODEL.value, temperature=0.7, max_tokens=300))
  run = WorkspaceRunConfig(timeout_s=_TIMEOUT.value, python_paths=default_python_paths())
  cfg = build.BuildConfig(
    run=run,
    runs=_RUNS.value,
    max_candidates=_CANDIDATES.value,
    max_bugs=_MAX_BUGS.value,
    combos=_COMBOS.value,
    workers=_WORKERS.value,
    seed=_SEED.value,
  )
  logging.set_verbosity(logging.INFO)
  instances = taskset.build_task_set(_SOURCES.value, _OUT.value, cfg, llm, max_turns=_TURNS.value)
  kinds = {k: sum(i.kind == k for i in instances) for k in ("procedural", "combo", "version_diff")}
  print(f"instances={len(instances)} " + " ".join(f"{k}={v}" for k, v in kinds.items()) + f" out={_OUT.value}")


if __name__ == "__main__":
  app.run(main)
