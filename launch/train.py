"""Pretrain or fine-tune Kimi K2: `python launch/train.py --config=configs/k2.py:tiny --workdir=W`.

Resumes from W's latest checkpoint. `--dry_run` prints parameter counts (and the memory plan for
`config.topology`) from shapes alone, allocating nothing. `--aot=v5p-1024` compiles the real step for that
TPU slice on this host (needs libtpu, see docs/install.md) and prints XLA's per-device memory, FLOPs and
collective bytes; it exits 1 when the step does not fit the chips' HBM. `eval.tasks.<name>` / `eval.tasks_file`
run benchmarks (k2jax.eval's runner, an embedded engine over the current weights) at the held-out loss's steps. Multi-host: set the coordinator flags (or
let the cluster's environment do it, see docs/scaling.md) and run the same command on every host.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402
from k2jax import accel, compile_cache, host_malloc  # noqa: E402

config_flags.DEFINE_config_file("config", None, "configs/k2.py:<variant>", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, TensorBoard events.")
flags.DEFINE_bool("dry_run", False, "Print params_total/params_activated (+ memory plan) and exit.")
flags.DEFINE_string(
  "aot", None, "Compile the step for a TPU slice (e.g. v5p-1024) without TPUs; print memory/FLOPs/collectives."
)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (else K2JAX_COORDINATOR or the cluster).")
flags.DEFINE_integer("num_processes", None, "Total JAX processes (multi-host).")
flags.DEFINE_integer("process_id", None, "This process's index (multi-host).")
_COMPILE_CACHE = compile_cache.define_flag()
FLAGS = flags.FLAGS


def _task_eval(tc, workdir):
  """`eval.tasks`' evaluator (k2jax.eval sits above k2jax.train: the launcher brings it to the loop)."""
  from k2jax.eval import inloop

  return inloop.train_evaluator(tc, workdir)


def main(argv):
  del argv
  # XLA's GPU flags (k2jax/accel.py) before anything starts a backend; printed with the run.
  print(accel.describe(accel.configure(multi_gpu=True, moe_gemm=FLAGS.config.model.moe_gemm)), flush=True)
  compile_cache.enable(_COMPILE_CACHE.value)
  host_malloc.keep_freed_memory()  # freed XLA:CPU buffers stay in the heap (k2jax/host_malloc.py)
  from k2jax.train import dryrun, loop

  if FLAGS.dry_run:
    print(dryrun.report(FLAGS.config))
    return
  if FLAGS.aot:
    from k2jax.train import aot

    report = aot.compile_step(FLAGS.config, FLAGS.aot)
    print(aot.format_report(report), flush=True)
    if not report["fits"]:
      sys.exit(1)
    return
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required (unless --dry_run)")
  from k2jax import distributed

  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; the loop prints status
  final = loop.run(FLAGS.config, FLAGS.workdir, task_eval=_task_eval)
  print(" ".join(f"{k}={final[k]}" for k in ("step", "loss") if k in final))
  distributed.shutdown("train")  # the processes leave together (jax's own exit barrier gives up after 300 s)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
