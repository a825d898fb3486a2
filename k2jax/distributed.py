"""Multi-host start-up and per-process data: `jax.distributed.initialize` from flags or environment.

  initialize()                       # TPU pod / SLURM / Open MPI: jax detects the cluster itself
  initialize("10.0.0.1:1234", 4, 0)  # GPU or CPU hosts: coordinator address, process count, id

Explicit arguments win; missing ones come from K2JAX_COORDINATOR, K2JAX_NUM_PROCESSES,
K2JAX_PROCESS_ID. With none of them set and no cluster detected the run stays single-process.
Each process then loads only its own rows (`process_rows`) and assembles the global batch with
`global_batch` (jax.make_array_from_process_local_data): no process ever holds the whole batch.
"""

from __future__ import annotations

import os
from typing import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding

ENV_COORDINATOR = "K2JAX_COORDINATOR"
ENV_NUM_PROCESSES = "K2JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "K2JAX_PROCESS_ID"

# Environment variables by which jax's own cluster detection recognises a managed cluster.
_CLUSTER_ENV = (
  "TPU_WORKER_HOSTNAMES",
  "CLOUD_TPU_TASK_ID",
  "MEGASCALE_COORDINATOR_ADDRESS",
  "SLURM_JOB_ID",
  "OMPI_MCA_orte_hnp_uri",
  "PMIX_NAMESPACE",
)


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  env: Mapping[str, str] | None = None,
  cpu_collectives: str = "gloo",
) -> bool:
  """Join (or form) the multi-process JAX runtime. Returns True when running multi-process.

  Must run before anything touches a JAX device. `cpu_collectives` picks the CPU cross-process
  collectives (jax's `jax_cpu_collectives_implementation`: 'gloo' or 'mpi'); without it CPU
  processes could not run collectives with each other.
  """
  env = os.environ if env is None else env
  coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
  num_processes = num_processes if num_processes is not None else _int_env(env, ENV_NUM_PROCESSES)
  process_id = process_id if process_id is not None else _int_env(env, ENV_PROCESS_ID)
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
  if all(v is None for v in given.values()):
    if not any(k in env for k in _CLUSTER_ENV):
      return False  # a plain single-process run
    jax.distributed.initialize()  # TPU pods, SLURM, Open MPI: jax reads the cluster itself
    return jax.process_count() > 1
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(
      f"distributed.initialize: {', '.join(missing)} missing (set the arguments or "
      f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); got {given}"
    )
  if not 0 <= process_id < num_processes:
    raise ValueError(f"distributed.initialize: process_id={process_id} is not in [0, {num_processes})")
  if ":" not in coordinator_address:
    raise ValueError(f"distributed.initialize: coordinator_address={coordinator_address!r} needs host:port")
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(
    coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )
  return num_processes > 1


# A process may wait this long for the others at `barrier` (a 1T step can compile for many minutes).
BARRIER_TIMEOUT_S = 3600
_barriers = [0]


def barrier(what: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
  """Wait until every process reaches its own call number n of `barrier` (no-op single-process).

  This is the coordination service's barrier, not a device collective: JAX's CPU collectives (gloo) give
  a device group 30 s to form when its first collective runs (jaxlib's fixed key-value timeout), so a
  process that reaches its first collective that much before the others fails with "Gloo context
  initialization failed". Compiling the step is what makes processes drift apart (the persistent
  compilation cache serves process 0 and not the others), so `compiled_together` compiles, then waits here.
  `multihost_utils.sync_global_devices` would not do: it is itself a collective.
  """
  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # the running client; jax has no public handle

  client = jax_distributed.global_state.client
  _barriers[0] += 1
  name = f"k2jax/{_barriers[0]}/{what}"
  try:
    client.wait_at_barrier(name, int(timeout_s * 1000))
  except Exception as e:  # jaxlib raises XlaRuntimeError with the coordination service's status
    raise RuntimeError(
      f"process {jax.process_index()}: the other processes did not reach barrier {name!r} within "
      f"{timeout_s:.0f} s ({e})"
    ) from e


def shutdown(what: str = "exit") -> None:
  """Leave the multi-process runtime together: wait at `barrier` (an hour), then `jax.distributed.shutdown`.

  jax shuts the runtime down at interpreter exit with a barrier of its own that waits
  `shutdown_timeout_seconds` (300 s) for every process; a process that gets there that much before another
  (process 0 writing the last metrics and checkpoint on a loaded host, a peer still compiling) fails it,
  and then every process aborts (SIGABRT, "Shutdown barrier in coordination service has failed:
  DEADLINE_EXCEEDED"; tests/test_distributed.py reproduces it). Waiting here first absorbs that drift
  under `BARRIER_TIMEOUT_S`, so the processes reach jax's barrier together. Call it on the success path
  only: after an error the peers are not coming, and jax's own exit handling applies. No-op single-process.
  """
  from jax._src import distributed as jax_distributed

  if jax_distributed.global_state.client is None:
    return
  if jax.process_count() > 1:
    barrier(f"shutdown {what}")
  jax.distributed.shutdown()


class compiled_together:
  """`jitted` (a `jax.jit` function, or anything with its `lower`) that, with several processes, compiles
  each new argument signature and waits at `barrier` before running it, so every process enters the
  program's collectives together. One process: `jitted` itself, unchanged."""

  def __init__(self, jitted, what: str):
    self.jitted, self.what, self.seen = jitted, what, set()

  def __call__(self, *args):
    if jax.process_count() > 1:
      key = _signature(args)
      if key not in self.seen:
        self.jitted.lower(*args).compile()  # jit keeps this compilation: the call below reuses it
        barrier(f"compiled {self.what}")
        self.seen.add(key)
    return self.jitted(*args)

  def __getattr__(self, name):  # lower, eval_shape, _cache_size...: the jitted function's own
    return getattr(self.jitted, name)


def _signature(args) -> tuple:
  leaves, tree = jax.tree.flatten(args)
  one = lambda x: (x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else x  # noqa: E731
  return (tree, *map(one, leaves))


def process_rows(global_batch_size: int, sharding: NamedSharding) -> slice:
  """Rows of a [global_batch_size, ...] batch that this process's devices hold under `sharding`.

  Rows are sharded over the batch mesh axes; a process reads exactly the rows of its addressable
  shards (a contiguous block when the mesh orders devices by process, as jax.make_mesh does).
  """
  shape = (global_batch_size,)
  index_map = sharding.addressable_devices_indices_map(shape)
  starts = sorted({(idx[0].start or 0) for idx in index_map.values()})
  stops = sorted({(idx[0].stop if idx[0].stop is not None else global_batch_size) for idx in index_map.values()})
  lo, hi = starts[0], stops[-1]
  covered = sum(b - a for a, b in zip(starts, stops))
  if covered != hi - lo:
    raise ValueError(
      f"process {jax.process_index()}: its batch rows {list(zip(starts, stops))} "
      "are not one contiguous block; build the mesh with k2jax.sharding.make_mesh"
    )
  return slice(lo, hi)


def global_batch(local_tree, sharding: NamedSharding, global_batch_size: int):
  """Global jax.Arrays from this process's rows (each leaf [local_rows, ...])."""

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(sharding, x, (global_batch_size, *x.shape[1:]))

  return jax.tree.map(one, local_tree)


# The TPU runtime's multislice environment (ray `get_tpu_coordinator_env_vars`, xpk's JobSet template): on every
# host of every slice, before the TPU backend starts. GKE and queued resources set them; a hand-made JobSet must.
MEGASCALE_PORT = "8081"


def megascale_env(coordinator_host: str, num_slices: int, slice_id: int, port: str = MEGASCALE_PORT) -> dict[str, str]:
  """The MEGASCALE_* variables one host of slice `slice_id` (0-based) of `num_slices` needs; the coordinator is
  a host of slice 0."""
  if not 0 <= slice_id < num_slices:
    raise ValueError(f"megascale_env: slice_id={slice_id} is not in [0, {num_slices})")
  return {
    "MEGASCALE_COORDINATOR_ADDRESS": coordinator_host,
    "MEGASCALE_PORT": str(port),
    "MEGASCALE_NUM_SLICES": str(num_slices),
    "MEGASCALE_SLICE_ID": str(slice_id),
  }


def check_slices(slices: int, platform: str, env: Mapping[str, str] | None = None) -> None:
  """A mesh with a DCN level of `slices` slices on TPU needs the runtime to have been told the same number:
  a clear error before any compile when MEGASCALE_NUM_SLICES is missing or differs (the slices would otherwise
  each form their own runtime, or hang waiting for one another)."""
  env = os.environ if env is None else env
  if slices == 1 or platform != "tpu":
    return
  got = env.get("MEGASCALE_NUM_SLICES")
  if got != str(slices):
    raise ValueError(
      f"mesh.dcn_*: {slices} slices, but MEGASCALE_NUM_SLICES={got!r} on this host; every host needs "
      "MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID (launch/tpu_multislice.sh, "
      "launch/multislice_jobset.yaml)"
    )


def _int_env(env: Mapping[str, str], key: str) -> int | None:
  value = env.get(key)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment {key}={value!r} is not an integer") from None
