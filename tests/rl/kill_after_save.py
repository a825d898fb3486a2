"""Runs launch/rl.py and SIGKILLs itself right after checkpoint K2JAX_KILL_AFTER_STEP is committed
(a hard kill at a deterministic point, so the exact-resume test does not race the learner)."""

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
sys.argv[0] = os.path.join(ROOT, "launch", "rl.py")
runpy.run_path(sys.argv[0], run_name="__main__")
