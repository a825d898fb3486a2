"""Runs launch/$K2JAX_KILL_LAUNCHER (default train.py; rl.py for the RL learner) and SIGKILLs itself right
after checkpoint K2JAX_KILL_AFTER_STEP is committed.

A hard kill (no cleanup, no atexit, the next steps already dispatched) at a deterministic point, so
the exact-resume tests do not race the trainer.
"""

import os
import runpy
import signal
import sys

from k2jax.train import checkpoint

KILL_AFTER = int(os.environ["K2JAX_KILL_AFTER_STEP"])
_save = checkpoint.Checkpointer.save


def save_then_die(self, step, *args, **kwargs):
  _save(self, step, *args, **kwargs)
  if step == KILL_AFTER:
    self.wait()
    os.kill(os.getpid(), signal.SIGKILL)


checkpoint.Checkpointer.save = save_then_die
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.argv[0] = os.path.join(ROOT, "launch", os.environ.get("K2JAX_KILL_LAUNCHER", "train.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
