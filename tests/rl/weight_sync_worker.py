"""One of two CPU processes (4 fake devices each) pushing one sharded model (test_weight_sync.py).

  python weight_sync_worker.py <port> <process_id> <root>
The tiny model, filled from numpy with seed 0 on every process, is sharded over the 8-device mesh
{fsdp: 4, expert: 2} (fsdp_ep); a full push writes each process's own tensors under <root>.
"""

import os
import sys

from tests.xla_flags import xla_flags  # noqa: E402  (repo root on PYTHONPATH)

os.environ["XLA_FLAGS"] = xla_flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"

from k2jax import distributed  # noqa: E402  (must run before any device is touched)


class _Recorder:
  def update_weights(self, model_path, weight_version):
    print(f"update_weights {model_path} {weight_version}", flush=True)


def main(port: str, process_id: str, root: str):
  distributed.initialize(f"localhost:{port}", 2, int(process_id))
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from k2jax import sharding  # noqa: PLC0415
  from k2jax.model import K2Model, presets  # noqa: PLC0415
  from k2jax.rl.weight_sync import WeightSync, WeightSyncConfig  # noqa: PLC0415

  assert jax.process_count() == 2 and jax.device_count() == 8
  cfg = presets.get("tiny")
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  host = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), nnx.to_pure_dict(abstract))
  mesh = sharding.make_mesh({"fsdp": 4, "expert": 2})
  shardings = nnx.to_pure_dict(sharding.param_shardings(abstract, mesh, "fsdp_ep"))
  state = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]), host, shardings)
  engine = _Recorder() if jax.process_index() == 0 else None
  sync = WeightSync(WeightSyncConfig(root, max_shard_bytes=400_000), engine, cfg)
  assert sync.push(state) == 1


if __name__ == "__main__":
  main(*sys.argv[1:])
