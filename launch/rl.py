"""RL post-training (K2 §3.2.3): `python launch/rl.py --config=configs/rl.py:tiny --workdir=W`.

`--config=configs/rl.py:agentic_tiny` mixes six task types per batch (math, code, instruction following,
judge, rubric, multi-turn tool use against an env service it starts itself unless
`--config.agentic.env_urls` names one). With no `--config.rollout.engine_url` the embedded k2jax engine
runs in-process (`--config.rollout.engine=sglang_jax_colocated`: sglang-jax's engine in-process instead, Python
>= 3.12, docs/rl.md "sglang-jax colocated"); with a URL rollouts come from that SGLang-compatible server (see
launch/sglang_server.sh and docs/rl.md "Rollouts on SGLang servers").
Resumes from the latest checkpoint in W; writes W/metrics.jsonl and W/checkpoints/<iteration>/.
`--dry_run` prints parameter counts and the per-device memory plan (`configs/rl.py:1t`) and exits.
`--aot=v5p-1024` compiles the colocated iteration's programs (the engine's decode/prefill on its serving
mesh, the RL update, the training->serving reshard) for that TPU slice without TPUs (libtpu, Python >= 3.12)
and prints XLA's per-device memory of each phase, the reshard and offload bytes and fits= (k2jax/rl/aot.py).
Multi-host: the coordinator flags (or the cluster's environment) as launch/train.py, the same command
on every host; process 0 runs the rollouts and talks to the engine (with `--config.engine.sharding=tp_ep`
and no URL: the embedded engine on every process's devices, in lockstep; docs/rl.md "Colocated RL").
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from k2jax import compile_cache, host_malloc  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:tiny", "RL config file and variant.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, weight pushes).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print params and the per-device memory plan, then exit.")
_AOT = flags.DEFINE_string(
  "aot",
  None,
  "Compile the colocated RL iteration for this TPU slice (e.g. v5p-1024; needs libtpu), print XLA's figures.",
)
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (else K2JAX_COORDINATOR).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Total JAX processes (multi-host).")
_PID = flags.DEFINE_integer("process_id", None, "This process's index (multi-host).")
_COMPILE_CACHE = compile_cache.define_flag()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _DRY_RUN.value:
    from k2jax.rl.plan import dry_run

    print(dry_run(_CONFIG.value))
    return
  if _AOT.value:
    from k2jax.rl import aot as rl_aot
    from k2jax.train import aot

    why = aot.libtpu_available()
    if why:
      raise app.UsageError(f"--aot: {why}")
    progress = lambda part: print(aot.format_report(part), file=sys.stderr, flush=True)  # noqa: E731
    report = rl_aot.compile_rl(_CONFIG.value, _AOT.value, progress)
    print(aot.format_report(report))
    sys.exit(0 if report["fits"] else 1)
  from k2jax.rl import learner

  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (unless --dry_run or --aot)")
  from k2jax import distributed

  distributed.initialize(_COORD.value, _NPROC.value, _PID.value)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  compile_cache.enable(_COMPILE_CACHE.value)
  host_malloc.keep_freed_memory()  # freed XLA:CPU buffers stay in the heap (k2jax/host_malloc.py)
  final = learner.run(_CONFIG.value, _WORKDIR.value)
  if final:
    print(json.dumps({k: final[k] for k in ("step", "reward_mean", "eval_accuracy") if k in final}))
  distributed.shutdown("rl")  # the processes leave together (jax's own exit barrier gives up after 300 s)


if __name__ == "__main__":
  app.run(main)
