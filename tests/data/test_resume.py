"""Resume: stop mid-epoch, save the iterator state, restore it in a new process: the continued
stream equals the uninterrupted one element for element (in-process and with worker processes)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from k2jax.data import PretrainDataConfig, make_pretrain_iter, restore_args, save_args, save_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = "PretrainDataConfig(seq_len=128, batch_size=4, num_epochs=2, seed=5, num_workers={w})"


def _run_resume(tmp_path, workers, stop=7, more=9):
  cfg = eval(CFG.format(w=workers))  # Same text runs in the child process.
  it = make_pretrain_iter(cfg)
  for _ in range(stop):
    next(it)
  save_state(it, str(tmp_path / "state"))
  reference = [next(it) for _ in range(more)]
  it.close()
  child = textwrap.dedent(f"""
      import numpy as np
      from k2jax.data import PretrainDataConfig, make_pretrain_iter, restore_state
      it = make_pretrain_iter({CFG.format(w=workers)})
      restore_state(it, {str(tmp_path / 'state')!r})
      out = [next(it) for _ in range({more})]
      np.savez({str(tmp_path / 'out.npz')!r}, **{{f"{{i}}_{{k}}": v for i, b in enumerate(out) for k, v in b.items()}})
      print(it.report.documents)
      it.close()
  """)
  proc = subprocess.run(
    [sys.executable, "-c", child],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = np.load(tmp_path / "out.npz")
  for i, batch in enumerate(reference):
    for k, v in batch.items():
      np.testing.assert_array_equal(got[f"{i}_{k}"], v, err_msg=f"batch {i} key {k}")
  return int(proc.stdout.split()[-1])


def test_resume_in_new_process(tmp_path):
  _run_resume(tmp_path, workers=0)


@pytest.mark.slow
def test_resume_in_new_process_with_worker_processes(tmp_path):
  _run_resume(tmp_path, workers=2)


def test_orbax_checkpoint_manager_round_trip(tmp_path):
  import orbax.checkpoint as ocp

  cfg = PretrainDataConfig(seq_len=128, batch_size=2, num_epochs=None, seed=1)
  it = make_pretrain_iter(cfg)
  for _ in range(3):
    next(it)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=ocp.args.Composite(data=save_args(it)))
    mngr.wait_until_finished()
  want = [next(it) for _ in range(3)]
  fresh = make_pretrain_iter(cfg)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.restore(3, args=ocp.args.Composite(data=restore_args(fresh)))
  for w in want:
    g = next(fresh)
    for k in w:
      np.testing.assert_array_equal(g[k], w[k])
  assert fresh.report.documents == it.report.documents
