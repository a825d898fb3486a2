"""One of two CPU processes (4 fake devices each) exporting one sharded model (test_writer.py).

  python export_worker.py <port> <process_id> <out_dir>
The golden FP8 config (tests/golden/fp8_export_golden.py), filled from numpy with seed 0 on every
process, sharded over the 8-device mesh {fsdp: 4, expert: 2} (fsdp_ep), is exported twice by both
processes: float32 to <out_dir>/f32 and block-FP8 to <out_dir>/fp8. Each process prints the files the
plan gives it ("files <p> <name> ...").
"""

import os
import sys

from tests.xla_flags import xla_flags  # noqa: E402  (repo root on PYTHONPATH)

os.environ["XLA_FLAGS"] = xla_flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"

from k2jax import distributed  # noqa: E402  (must run before any device is touched)

HERE = os.path.dirname(os.path.abspath(__file__))


def main(port: str, process_id: str, out: str):
  distributed.initialize(f"localhost:{port}", 2, int(process_id))
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  sys.path.insert(0, os.path.join(os.path.dirname(HERE), "golden"))
  from fp8_export_golden import CONFIG, host_state  # noqa: PLC0415

  from k2jax import sharding  # noqa: PLC0415
  from k2jax.convert import writer  # noqa: PLC0415
  from k2jax.model import K2Model, presets  # noqa: PLC0415

  assert jax.process_count() == 2 and jax.device_count() == 8
  cfg = presets.get("tiny", **CONFIG)
  host = host_state(cfg)
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  mesh = sharding.make_mesh({"fsdp": 4, "expert": 2})
  shardings = nnx.to_pure_dict(sharding.param_shardings(abstract, mesh, "fsdp_ep"))
  state = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]), host, shardings)
  for dtype, name in ((None, "f32"), ("fp8", "fp8")):
    files = writer.plan_files(writer.make_plan(cfg, state, dtype), 100_000, "global")
    print(f"files {name} {jax.process_index()}", *(f for f, _ in files.get(jax.process_index(), [])), flush=True)
    writer.save_hf(cfg, state, os.path.join(out, name), dtype=dtype, max_shard_bytes=100_000)
  print("done", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
