"""A multi-process server's other processes: the same engine on the same mesh, driven by process 0.

`launch/serve.py --num_processes=N` serves one model over the devices of N JAX processes. Process 0 runs
the HTTP server and the engine's scheduler (the leader); every other process loads its own shards of the
weights onto the same serving mesh, builds the same engine, and runs the commands process 0 broadcasts
(`k2jax.engine.lockstep`) until process 0 closes its engine: `follow` returns then.
"""

from __future__ import annotations

import jax

from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.engine.placement import load_model, make_placement


def check_processes(engine_config: EngineConfig) -> None:
  """Several processes serve only on a serving mesh over all their devices (raises ValueError else)."""
  if jax.process_count() > 1 and not engine_config.sharding:
    raise ValueError(
      f"{jax.process_count()} JAX processes serve one model on a mesh over all their devices: give a "
      "serving preset (--sharding=tp | ep | tp_ep)"
    )


def follow(model_path: str, engine_config: EngineConfig) -> None:
  """Process > 0: loads this process's shards of `model_path` and runs process 0's engine commands until
  process 0 closes its engine. Every process passes the same `engine_config`, and builds its engine at
  the same point (the weights' placement and the precompiles are programs over the whole mesh)."""
  if jax.process_index() == 0:
    raise ValueError("follow: process 0 leads the engine (it serves HTTP); only the other processes follow")
  check_processes(engine_config)
  model = load_model(model_path, make_placement(engine_config.sharding, engine_config.mesh))
  engine = InferenceEngine(model, engine_config)
  del model  # the engine holds what it serves
  engine.wait_closed()
  if not engine.closed:  # the loop ended on an error (logged by its thread), e.g. process 0 went away
    raise RuntimeError(f"process {jax.process_index()}: the engine's command loop failed before process 0 closed it")
