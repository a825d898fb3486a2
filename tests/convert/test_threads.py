"""Import and export on N threads (`k2jax.convert.pool.Workers`): bitwise the same trees and files as on
one thread, never more than the in-flight byte budget in the pool, and a failing thread fails the
import naming the tensor and its file, or the export with nothing written."""

import functools
import hashlib
import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from k2jax import sharding
from k2jax.convert import blockops, fp8, pool, reader, st_stream, writer
from k2jax.convert import hf as hf_io
from k2jax.convert.errors import CheckpointError
from k2jax.model import K2Model
from k2jax.model.config import ConfigError
from k2jax.rl.weight_sync import WeightSync, WeightSyncConfig
from tests.convert import kimi_dir

CFG = kimi_dir.CFG
N = 4  # threads of the multi-threaded runs (more than this machine's cores: the order must not matter)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
  return kimi_dir.write_dir(str(tmp_path_factory.mktemp("kimi") / "hf"), CFG, kimi_dir.quantized_state(CFG, 1))


@pytest.fixture(scope="module")
def cfg(fp8_dir):
  return hf_io.read_config(fp8_dir, param_dtype="bfloat16")


def _abstract(cfg, mesh_shape=None):
  abstract = hf_io.abstract_state(cfg)
  if mesh_shape is None:
    return abstract
  mesh = sharding.make_mesh(mesh_shape)
  model = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  shardings = nnx.to_pure_dict(sharding.param_shardings(model, mesh, "fsdp"))
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _bytes(tree) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): (np.asarray(v).dtype, np.asarray(v).tobytes()) for p, v in flat}


def _read(path, cfg, abstract, threads, budget):
  pool.READ.reset()
  state = reader.read_state(path, cfg, abstract, read_budget_bytes=budget, threads=threads)
  return _bytes(state), {"peak": pool.READ.peak_bytes, "jobs": pool.READ.peak_jobs, "largest": pool.READ.largest_job}


def test_workers_consume_in_order_within_the_byte_budget():
  """Jobs finishing in random order are consumed in submission order; bytes in flight never pass the
  budget (a job larger than it runs alone); a failing job is raised by the call that consumes it."""
  rng = np.random.default_rng(0)
  sizes = [int(x) for x in rng.integers(1, 40, 200)] + [150, 3]
  got, stats = [], pool.InFlight("test")

  def job(i):
    time.sleep(float(rng.random()) * 1e-3)
    return i

  with pool.Workers(N, 100, stats) as w:
    for i, n in enumerate(sizes):
      w.submit(n, functools.partial(job, i), got.append)
    w.drain()
  assert got == list(range(len(sizes)))
  assert stats.peak_bytes == 150 and stats.bytes == 0 and stats.peak_jobs == 2 * N  # 150: alone
  stats.reset()
  with pytest.raises(ZeroDivisionError), pool.Workers(N, 100, stats) as w:
    for i in range(50):
      w.submit(1, functools.partial(lambda i: 1 // (i - 7), i), lambda r: None)
    w.drain()


@pytest.mark.parametrize("device_convert", [False, True], ids=["numpy", "xla"])
def test_import_on_n_threads_is_bitwise_the_one_thread_import_within_the_budget(
  fp8_dir, cfg, monkeypatch, device_convert
):
  """fsdp over the 8 CPU devices, a budget of a few blocks: same bytes on 1 and N threads (numpy blocks, and
  every block through XLA's FP8 dequantization), and the pool's peak never above the budget."""
  if device_convert:
    monkeypatch.setattr(reader, "DEVICE_CONVERT_BYTES", 0)
  abstract = _abstract(cfg, {"fsdp": 8})
  budget = 256 << 10
  one, s1 = _read(fp8_dir, cfg, abstract, 1, budget)
  many, sn = _read(fp8_dir, cfg, abstract, N, budget)
  assert one.keys() == many.keys() and len(one) > 20
  for k in one:
    assert one[k] == many[k], k
  assert pool.READ.threads == N and pool.READ.bytes == 0  # every job consumed
  for s in (s1, sn):
    assert 0 < s["peak"] <= max(budget, s["largest"]), s
  assert sn["largest"] <= budget, sn  # every job fits this budget, so the peak is held to it
  assert sn["jobs"] > 1  # blocks really were in flight together


def test_load_hf_on_n_threads_is_bitwise_the_one_thread_load(fp8_dir):
  a = _bytes(hf_io.load_hf(fp8_dir, threads=1)[1])
  pool.READ.reset()
  b = _bytes(hf_io.load_hf(fp8_dir, threads=N, read_budget_bytes=64 << 10)[1])
  assert a == b and len(a) > 20
  assert 0 < pool.READ.peak_bytes <= max(64 << 10, pool.READ.largest_job)


def test_threads_must_be_non_negative(fp8_dir, cfg):
  with pytest.raises(ConfigError, match="threads"):
    reader.read_state(fp8_dir, cfg, _abstract(cfg), threads=-1)
  with pytest.raises(ConfigError, match="threads"):
    writer.Writer(cfg, "fp8", threads=-2)
  with pytest.raises(ValueError, match="WeightSyncConfig"):
    WeightSyncConfig(root="/tmp", threads=-1)
  assert pool.resolve_threads(0) == pool.THREADS_PER_CORE * len(os.sched_getaffinity(0))


def test_a_failing_transform_fails_the_import_naming_tensor_and_file(fp8_dir, cfg, monkeypatch):
  """A transform raising on a reader thread (the 5th FP8 dequantization) is re-raised by the import as a
  RuntimeError naming the tensor and its shard."""
  real, calls = fp8.dequantize, {"n": 0}

  def failing(*a, **k):
    calls["n"] += 1
    if calls["n"] == 5:
      raise ValueError("boom")
    return real(*a, **k)

  monkeypatch.setattr(fp8, "dequantize", failing)
  with pytest.raises(
    RuntimeError, match=r"reading model\.layers\.\d+\.\S+\.weight from \S+\.safetensors: ValueError: boom"
  ):
    reader.read_state(fp8_dir, cfg, _abstract(cfg, {"fsdp": 8}), threads=N, read_budget_bytes=64 << 10)


def test_a_shard_truncated_while_reading_fails_naming_tensor_and_file(fp8_dir, cfg, tmp_path, monkeypatch):
  """The headers validate, then a shard loses its tail: the thread that reads past the end fails the
  import with a CheckpointError naming the shard and the tensor."""
  src = str(tmp_path / "hf")
  shutil.copytree(fp8_dir, src)
  victim = max(f for f in os.listdir(src) if f.endswith(".safetensors"))
  real = reader.open_checkpoint

  def then_truncate(path, c):
    ckpt = real(path, c)
    file = os.path.join(src, victim)
    os.truncate(file, os.path.getsize(file) // 2)
    return ckpt

  monkeypatch.setattr(reader, "open_checkpoint", then_truncate)
  with pytest.raises(CheckpointError, match=rf"{victim}: tensor '[^']+': unexpected end of file"):
    reader.read_state(src, cfg, _abstract(cfg), threads=N)


def _sha256(directory: str) -> dict[str, str]:
  out = {}
  for f in sorted(os.listdir(directory)):
    with open(os.path.join(directory, f), "rb") as fh:
      out[f] = hashlib.sha256(fh.read()).hexdigest()
  return out


@pytest.fixture(scope="module")
def host_state(fp8_dir):
  return hf_io.load_hf(fp8_dir, param_dtype="bfloat16")[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_export_on_n_threads_writes_the_same_files(cfg, host_state, tmp_path, dtype):
  """save_hf on 1 and N threads, from host arrays and from arrays sharded over 8 devices: every file
  (safetensors, index, config.json) has the same sha256."""
  sharded = jax.device_put(host_state, jax.tree.map(lambda a: a.sharding, _abstract(cfg, {"fsdp": 8})))
  for name, state in (("host", host_state), ("mesh", sharded)):
    writer.save_hf(cfg, state, str(tmp_path / f"{name}1"), dtype=dtype, threads=1, max_shard_bytes=300_000)
    writer.save_hf(cfg, state, str(tmp_path / f"{name}n"), dtype=dtype, threads=N, max_shard_bytes=300_000)
    a, b = _sha256(str(tmp_path / f"{name}1")), _sha256(str(tmp_path / f"{name}n"))
    assert a == b and sum(f.endswith(".safetensors") for f in a) > 2, name
    assert pool.WRITE.threads == N and pool.WRITE.bytes == 0


def _short_writev(limit: int):
  """os.writev that writes at most `limit` bytes per call (cutting inside a buffer), counting its calls."""
  real, calls = os.writev, []

  def writev(fd, bufs):
    bufs, out, left = list(bufs), [], limit
    calls.append(len(bufs))
    for b in bufs:
      if left == 0:
        break
      out.append(memoryview(b).cast("B")[:left])
      left -= out[-1].nbytes
    return real(fd, out)

  return writev, calls


def test_write_all_resumes_short_writes(tmp_path, monkeypatch):
  writev, calls = _short_writev(777)
  monkeypatch.setattr(os, "writev", writev)
  blocks = [np.arange(n, dtype=np.uint16).view(np.uint8) for n in (5, 1000, 3, 2048)] + [b"tail"]
  with open(tmp_path / "f", "wb", buffering=0) as f:
    assert st_stream.write_all(f.fileno(), blocks) == 2 * (5 + 1000 + 3 + 2048) + 4
  assert (tmp_path / "f").read_bytes() == b"".join(bytes(b) for b in blocks)
  assert len(calls) == -(-(2 * 3056 + 4) // 777)


def test_pipe_runs_a_files_queued_blocks_as_one_call_in_order():
  """Blocks of one file waiting back to back become one call (one writev); another call between them
  (a `drop_last` truncation) or another file's block ends the run, so the order is kept."""
  pipe, gate, calls = st_stream.Pipe(max_bytes=1 << 20), threading.Event(), []

  def write(*blocks):
    calls.append([int(b[0]) for b in blocks])

  pipe.submit(gate.wait)  # holds the pipe's thread while the rest queues up
  for i in range(5):
    pipe.submit(write, np.array([i]), nbytes=8, batch="a")
  pipe.submit(calls.append, "cut")
  pipe.submit(write, np.array([5]), nbytes=8, batch="a")
  pipe.submit(write, np.array([6]), nbytes=8, batch="b")
  pipe.submit(write, np.array([7]), nbytes=8, batch="a")
  gate.set()
  pipe.close()
  assert calls == [[0, 1, 2, 3, 4], "cut", [5], [6], [7]]


def test_export_with_short_writes_writes_the_same_files(cfg, host_state, tmp_path, monkeypatch):
  writer.save_hf(cfg, host_state, str(tmp_path / "a"), dtype="fp8", threads=N, max_shard_bytes=300_000)
  writev, calls = _short_writev(5000)
  monkeypatch.setattr(os, "writev", writev)
  writer.save_hf(cfg, host_state, str(tmp_path / "b"), dtype="fp8", threads=N, max_shard_bytes=300_000)
  assert _sha256(str(tmp_path / "a")) == _sha256(str(tmp_path / "b")) and len(calls) > 10


def test_export_holds_at_most_its_in_flight_budget(cfg, host_state, tmp_path):
  budget = 256 << 10
  pool.WRITE.reset()
  out = tmp_path / "out"
  out.mkdir()
  writer.Writer(cfg, "fp8", threads=N, in_flight_bytes=budget).write(host_state, str(out))
  assert pool.WRITE.largest_job <= budget and 0 < pool.WRITE.peak_bytes <= budget, pool.WRITE
  assert pool.WRITE.peak_jobs > 1


def test_a_failing_quantize_thread_fails_the_export_and_writes_nothing(cfg, host_state, tmp_path, monkeypatch):
  real, calls = fp8.quantize, {"n": 0}

  def failing(*a, **k):
    calls["n"] += 1
    if calls["n"] == 7:
      raise MemoryError("no room")
    return real(*a, **k)

  monkeypatch.setattr(st_stream.fp8, "quantize", failing)
  dst = str(tmp_path / "export")
  with pytest.raises(
    RuntimeError, match=r"writing model\.\S+\.weight to \S+\.safetensors: quantizing rows .*MemoryError"
  ):
    writer.save_hf(cfg, host_state, dst, dtype="fp8", threads=N)
  assert not os.path.exists(dst)
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".k2jax-")]


class _Engine:
  def __init__(self):
    self.updates = []

  def update_weights(self, path: str, version: int) -> None:
    self.updates.append((path, version))


def test_fp8_weight_push_on_n_threads_pushes_the_same_files(cfg, host_state, tmp_path):
  shas = []
  for threads in (1, N):
    engine = _Engine()
    sync = WeightSync(WeightSyncConfig(root=str(tmp_path / f"t{threads}"), dtype="fp8", threads=threads), engine, cfg)
    assert sync.push(host_state) == 1 and len(engine.updates) == 1
    shas.append(_sha256(engine.updates[0][0]))
  assert shas[0] == shas[1] and len(shas[0]) > 1


def test_fp8_export_through_xla_writes_the_numpy_quantizers_files(cfg, host_state, tmp_path, monkeypatch):
  """The writer quantizes jobs of `blockops.XLA_QUANT_MIN_ELEMS` and more in one XLA call: with every job
  sent there, the files on N threads are the numpy quantizer's on 1."""
  writer.save_hf(cfg, host_state, str(tmp_path / "numpy"), dtype="fp8", threads=1, max_shard_bytes=300_000)
  monkeypatch.setattr(blockops, "XLA_QUANT_MIN_ELEMS", 0)
  calls = {"n": 0}
  real = blockops.quantize_fp8

  def counted(*a, **k):
    calls["n"] += 1
    return real(*a, **k)

  monkeypatch.setattr(blockops, "quantize_fp8", counted)
  writer.save_hf(cfg, host_state, str(tmp_path / "xla"), dtype="fp8", threads=N, max_shard_bytes=300_000)
  assert calls["n"] > 10
  assert _sha256(str(tmp_path / "numpy")) == _sha256(str(tmp_path / "xla"))
  # A process without JAX's CPU backend (JAX_PLATFORMS=tpu) quantizes with numpy: the same files again.
  monkeypatch.setattr(blockops, "cpu_device", lambda: None)
  n = calls["n"]
  writer.save_hf(cfg, host_state, str(tmp_path / "no_cpu"), dtype="fp8", threads=N, max_shard_bytes=300_000)
  assert calls["n"] == n and _sha256(str(tmp_path / "numpy")) == _sha256(str(tmp_path / "no_cpu"))
