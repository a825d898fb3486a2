"""`launch/convert.py HF -> workdir` on two JAX processes (4 fake CPU devices each) onto the `fsdp_ep`
mesh: each process reads at most 0.6 of the shard bytes (counted by the reader's own pread counter,
`safetensors_io.STATS`), and the workdir they write together restores bitwise equal to a one-process
load. A bad source fails before anything is written."""

import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from k2jax.convert import hf as hf_io
from k2jax.convert import workdir as wd
from tests.convert import kimi_dir
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _env(devices):
  return dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=xla_flags(devices),
    PYTHONPATH=ROOT,
  )


def _cmd(src, dst, *extra):
  return [sys.executable, os.path.join(ROOT, "launch/convert.py"), f"--src={src}", f"--dst={dst}", *extra]


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_read_their_own_slices_and_write_one_workdir(tmp_path):
  src = kimi_dir.write_dir(str(tmp_path / "hf"), kimi_dir.CFG, kimi_dir.quantized_state(kimi_dir.CFG, 3))
  dst = str(tmp_path / "w")
  port = _free_port()
  mesh = ["--mesh=fsdp=2,expert=4", "--rules=fsdp_ep"]
  procs = [
    subprocess.Popen(
      _cmd(src, dst, *mesh, f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"),
      cwd=ROOT,
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs[0][-4000:] + outs[1][-4000:]
  for i, out in enumerate(outs):
    read, total = map(int, re.search(rf"process {i}: read (\d+) of (\d+) shard bytes", out).groups())
    assert 0.3 < read / total <= 0.6, (i, read, total)
    print(f"process {i} read {read / total:.3f} of the shard bytes")
  cfg, host = hf_io.load_hf(src)  # the one-process load
  _, got = wd.restore_model_state(dst, hf_io.abstract_state(cfg))
  assert wd.read_model_config(dst) == cfg
  for path, want in _flat(host):
    leaf = np.asarray(_get(got, path))
    assert leaf.dtype == want.dtype and leaf.tobytes() == want.tobytes(), path


def test_bad_source_writes_nothing(tmp_path):
  src = kimi_dir.write_dir(str(tmp_path / "hf"), kimi_dir.CFG, kimi_dir.quantized_state(kimi_dir.CFG, 4))
  shard = os.path.join(src, "model-3-of-3.safetensors")
  with open(shard, "r+b") as f:
    f.truncate(os.path.getsize(shard) - 1)
  dst = str(tmp_path / "w")
  p = subprocess.run(_cmd(src, dst), cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=300)
  assert p.returncode != 0 and "model-3-of-3.safetensors" in p.stderr and "truncated" in p.stderr, p.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no workdir, no temporary sibling


def _flat(tree, prefix=()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flat(v, prefix + (k,))
    else:
      yield prefix + (k,), v


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree
