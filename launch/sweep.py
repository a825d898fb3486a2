"""Run a sweep declared in a config file: `python launch/sweep.py --config=configs/k2.py:tiny --sweep=lr
--workdir=/tmp/sweeps` runs each setting one after another; `--mode=pod --tpu=NAME --zone=ZONE` prints
one TPU-pod launch command per run instead.
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_string("config", None, "Config file and variant, e.g. configs/k2.py:tiny.")
flags.DEFINE_string("sweep", None, "Sweep name declared by the config file's get_sweep(name).")
flags.DEFINE_string("workdir", None, "Base directory; each run writes <workdir>/<sweep>/<run>.")
flags.DEFINE_enum("mode", "local", ["local", "pod"], "local: run sequentially; pod: print commands.")
flags.DEFINE_string("tpu", None, "TPU VM name (pod mode).")
flags.DEFINE_string("zone", None, "TPU zone (pod mode).")
flags.DEFINE_multi_string("extra", [], "Extra flags for every run, e.g. --extra=--config.steps=50.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from k2jax.train import sweep

  runs = sweep.load_sweep(FLAGS.config, FLAGS.sweep)
  if FLAGS.mode == "pod" and not (FLAGS.tpu and FLAGS.zone):
    raise app.UsageError("--mode=pod needs --tpu and --zone")
  for i, run in enumerate(runs):
    workdir = os.path.join(FLAGS.workdir, FLAGS.sweep, sweep.run_name(i, run))
    cmd = sweep.train_command(FLAGS.config, workdir, run, FLAGS.extra)
    if FLAGS.mode == "pod":
      print(sweep.pod_command(cmd, FLAGS.tpu, FLAGS.zone))
      continue
    print(f"[{i + 1}/{len(runs)}] {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
      sys.exit(f"sweep run {i} failed with exit code {rc}: {workdir}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "sweep", "workdir"])
  app.run(main)
