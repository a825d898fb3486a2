"""One of two CPU processes forming one 8-device mesh; prints `loss=<float>` (test_two_process.py).

  python two_process_worker.py <port> <process_id> <out_json>
Each process owns 4 fake CPU devices, loads only its own batch rows and shards the tiny model over
{fsdp: 2, expert: 4} with the fsdp_ep preset: experts exchange tokens across the processes.
"""

import json
import os
import sys

from tests.xla_flags import xla_flags  # noqa: E402  (repo root on PYTHONPATH)

os.environ["XLA_FLAGS"] = xla_flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"

from k2jax import distributed  # noqa: E402  (must run before any device is touched)


def main(port: str, process_id: str, out_path: str):
  distributed.initialize(f"localhost:{port}", 2, int(process_id))
  import functools  # noqa: PLC0415

  import jax  # noqa: PLC0415

  jax.config.update("jax_default_matmul_precision", "highest")
  sys.path.insert(0, os.path.dirname(__file__))
  from sharding_helpers import batch, next_token_loss, split_params, tiny_model_state  # noqa: PLC0415

  from k2jax import sharding  # noqa: PLC0415

  assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
  graphdef, state = tiny_model_state(16)
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
  model = sharding.shard_model(__import__("flax").nnx.merge(graphdef, state), mesh, "fsdp_ep")
  gd, params, rest = split_params(*__import__("flax").nnx.split(model))
  ids_all = batch()[0]
  batch_sharding = sharding.batch_sharding(mesh, "fsdp_ep")
  rows = distributed.process_rows(ids_all.shape[0], batch_sharding)
  ids = distributed.global_batch(jax.device_get(ids_all)[rows], batch_sharding, ids_all.shape[0])
  with sharding.use(mesh, "fsdp_ep"):
    loss = jax.jit(functools.partial(next_token_loss, gd))(params, rest, ids)
  with open(out_path, "w") as f:
    json.dump({"loss": float(loss), "rows": [rows.start, rows.stop]}, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
