"""One of two CPU processes standing in for two slices joined over DCN (test_multislice.py).

  python multislice_worker.py <port> <process_id> <out_json>
Each process owns 4 fake CPU devices (one "slice"); the mesh has a DCN level of `data: 2` over the processes
(jax's hybrid device mesh, process granules) and `fsdp: 4` inside each. One MuonClip train step of the tiny
model; process 0 writes the loss, the gradient norm and the new parameters' sums; both save the new state in
one checkpoint beside the output file.
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
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  jax.config.update("jax_default_matmul_precision", "highest")
  sys.path.insert(0, os.path.dirname(__file__))
  from multislice_common import reference_inputs, step_fn, summarize  # noqa: PLC0415

  from k2jax import sharding  # noqa: PLC0415
  from k2jax.train import core  # noqa: PLC0415
  from k2jax.train.checkpoint import Checkpointer  # noqa: PLC0415

  assert jax.process_count() == 2 and jax.device_count() == 8
  mesh = sharding.make_mesh({"fsdp": 4}, dcn_shape={"data": 2})
  # The DCN axis is the process: every device of data row i belongs to process i.
  owners = np.vectorize(lambda d: d.process_index)(mesh.devices)
  assert [sorted(set(owners[0, i].ravel())) for i in range(2)] == [[0], [1]], owners
  cfg, opt, state0, batch = reference_inputs()
  lay = core.layout(cfg, opt, mesh=mesh, preset="fsdp", seed=0)
  with lay.use():
    place = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx, x=np.asarray(x): x[idx])  # noqa: E731
    state = jax.tree.map(place, state0, lay.shardings)
    rows = distributed.process_rows(batch["input_ids"].shape[0], lay.batch_sharding)
    local = {k: np.asarray(v)[rows] for k, v in batch.items()}
    b = distributed.global_batch(local, lay.batch_sharding, batch["input_ids"].shape[0])
    new, metrics = jax.jit(step_fn(lay.mdef, opt))(state, b)
    out = summarize(new, metrics, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    # The two slices' state, checkpointed together: the test restores it in one process on one device.
    ckpt = Checkpointer(os.path.join(os.path.dirname(out_path), "ckpt"), keep=1, async_save=False)
    ckpt.save(1, new, None, {})
    ckpt.close()
  if jax.process_index() == 0:
    with open(out_path, "w") as f:
      json.dump({**out, "rows": [rows.start, rows.stop]}, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
