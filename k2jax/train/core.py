"""The training core every loop plugs into (pretraining, SFT, RL): mesh, sharded state, restore, jit.

torchtitan's TrainSpec in spirit: a loop brings its loss (a pure step function over `TrainState`) and its
batch source; the core gives it the mesh, the sharded abstract state (`Layout`: `state_shardings`, nothing
allocated, so `launch/train.py --aot` compiles from it for a topology without devices), the first state
(`build`: random init, `init_from`'s weights, or the newest readable checkpoint via `Checkpointer`), and
`jit(step)` with the state's shardings in and out and the state donated. Every step ends in the one
guarded update, `k2jax.train.step.apply_update`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from k2jax import distributed, sharding
from k2jax.convert import workdir as wd
from k2jax.model.config import K2Config
from k2jax.model.pipeline import PipelineSpec
from k2jax.model.transformer import K2Model
from k2jax.train.checkpoint import Checkpointer, abstract_like
from k2jax.train.init_from import initial_state
from k2jax.train.partition import state_shardings
from k2jax.train.step import ModelDef, TrainState, init_state


@dataclasses.dataclass
class Layout:
  """Everything about a loop's training state but its values: the mesh, the abstract state, its shardings."""

  mesh: Mesh
  preset: str
  model: K2Config
  optimizer: optax.GradientTransformationExtraArgs
  make: Callable[[], K2Model]  # builds the model (random init with the run's seed)
  mdef: ModelDef
  abstract_state: TrainState
  shardings: TrainState  # NamedSharding per state leaf (the optimizer state's in host memory when offloaded)

  @property
  def device_shardings(self) -> TrainState:
    """`shardings` all in device memory: where a state is initialised or restored before `place`."""
    return jax.tree.map(lambda s: s.with_memory_kind("device") if s.memory_kind == "pinned_host" else s, self.shardings)

  def place(self, state: TrainState) -> TrainState:
    """`state` moved to `shardings` (the optimizer state to host memory when offloaded; else unchanged)."""
    if self.shardings == self.device_shardings:
      return state
    # Not donated: "Donation across different memory kinds is not implemented" (jax 0.10). The device
    # copies go when the caller drops `state`.
    return state._replace(opt_state=jax.device_put(state.opt_state, self.shardings.opt_state))

  @property
  def batch_sharding(self) -> NamedSharding:
    return sharding.batch_sharding(self.mesh, self.preset)

  def use(self):
    """The (mesh, preset) context steps must be traced in (MoE takes the EP path, activations constrained)."""
    return sharding.use(self.mesh, self.preset)

  def jitted(self, step: Callable, *, donate_params: bool = True):
    """`jax.jit(step)` with the state sharded out as in and donated (trace, lower or call it under `use()`).
    `donate_params=False` keeps the input's params and bias alive (a colocated engine may be serving
    them, `k2jax.rl.weight_sync`); the rest of the state is still donated."""
    if donate_params:
      return jax.jit(step, out_shardings=(self.shardings, None), donate_argnums=0)
    return _KeepWeights(step, self.shardings)


class _KeepWeights:
  """`step(state, *batch)` jitted with the state's params and bias passed apart and not donated."""

  def __init__(self, step: Callable, shardings: TrainState):
    weights_and_rest = lambda w, rest, *batch: step(rest._replace(params=w[0], bias=w[1]), *batch)  # noqa: E731
    self.inner = jax.jit(weights_and_rest, out_shardings=(shardings, None), donate_argnums=1)

  @staticmethod
  def _split(s: TrainState):
    return (s.params, s.bias), s._replace(params=None, bias=None)

  def __call__(self, s: TrainState, *batch):
    return self.inner(*self._split(s), *batch)

  def lower(self, s: TrainState, *batch):
    return self.inner.lower(*self._split(s), *batch)


@dataclasses.dataclass
class Core(Layout):
  """A loop's sharded training state and what it was built from."""

  ckpt: Checkpointer
  state: TrainState
  meta: dict  # the restored checkpoint's host-side state ({} when nothing was restored)
  restored_step: int | None
  data_restored: bool

  def jit(self, step: Callable, *, donate_params: bool = True) -> Callable:
    """`step(state, *batch) -> (state, metrics)`, jitted (`Layout.jitted`), traced and called under this
    core's mesh context. Inputs keep their own shardings: the state comes from `build` (or a previous
    step), batches from `distributed.global_batch` (sharded on rows)."""
    # Several processes: each batch signature is compiled, then run by all together (`compiled_together`).
    fn = distributed.compiled_together(
      self.jitted(step, donate_params=donate_params), getattr(step, "__name__", "step")
    )

    def call(state, *batch):
      with self.use():
        return fn(state, *batch)

    return call


def layout(
  model: K2Config,
  optimizer: optax.GradientTransformationExtraArgs,
  *,
  mesh: Mesh,
  preset: str,
  seed: int,
  offload_opt_state: bool = False,
  pipeline: PipelineSpec | None = None,
) -> Layout:
  """The abstract sharded state of `model` trained by `optimizer` on `mesh` (allocates nothing).
  `pipeline`: the pipelined stack's layers are stored sharded over the `stage` axis (`partition`).
  `offload_opt_state`: the optimizer state lives in pinned host memory between steps (TPU/GPU meshes; on
  CPU, device memory is host memory and the flag changes nothing)."""
  offload = offload_opt_state and sharding.platform(mesh) != "cpu"
  with sharding.use(mesh, preset):
    make = lambda: K2Model(model, rngs=nnx.Rngs(seed))  # noqa: E731
    abstract_model = nnx.eval_shape(make)
    abstract_state = jax.eval_shape(lambda: init_state(make(), optimizer))
    shardings = state_shardings(
      abstract_model, abstract_state, mesh, preset, offload_opt_state=offload, pipeline=pipeline
    )
  return Layout(mesh, preset, model, optimizer, make, ModelDef.from_model(abstract_model), abstract_state, shardings)


def build(
  model: K2Config,
  optimizer: optax.GradientTransformationExtraArgs,
  *,
  mesh_shape: dict[str, int],
  preset: str,
  seed: int,
  init_from: str,
  read_budget_bytes: int,
  workdir: str,
  keep: int,
  async_save: bool,
  on_unreadable: str,
  data_iter=None,
  offload_opt_state: bool = False,
  resume_from: str = "",
  pipeline: PipelineSpec | None = None,
  dcn_shape: dict[str, int] | None = None,
  devices=None,
) -> Core:
  """Mesh -> abstract state and shardings -> restore the newest readable checkpoint of `workdir` (or
  initialise: `init_from`'s weights, else random with `seed`). Nothing unsharded is ever allocated.
  `data_iter` (a grain iterator) is restored in place when the checkpoint holds its position.
  `on_unreadable`: when checkpoints exist but none restores, "error" raises `UnreadableCheckpoints`
  before anything is moved; "fresh" moves them aside and initialises (`Checkpointer.restore_latest`).
  `resume_from`: with no checkpoint in `workdir`, the newest checkpoint of that workdir starts the run
  (a new stage, e.g. 32k after 4k): weights, optimizer state and routing bias carried, the step count reset
  to 0 (the stage's own schedule), the data position not (the pipeline packs to the new length).
  `dcn_shape`: slices per axis (multislice); `mesh_shape` is then the whole mesh (ICI size x DCN size per axis).
  `devices`: the mesh's devices (default: all of them; a subset leaves the others to the caller's other work)."""
  dcn = dcn_shape or {}
  ici = {a: n // dcn.get(a, 1) for a, n in mesh_shape.items()}
  mesh = sharding.make_mesh(ici, devices, dcn_shape=dcn_shape)
  lay = layout(
    model, optimizer, mesh=mesh, preset=preset, seed=seed, offload_opt_state=offload_opt_state, pipeline=pipeline
  )
  with lay.use():
    if jax.process_index() == 0:
      wd.write_model_config(model, workdir)
    ckpt = Checkpointer(workdir, keep=keep, async_save=async_save)
    # Restored (or initialised) in device memory, then placed: an offloaded optimizer state moves to host.
    restored = ckpt.restore_latest(
      abstract_like(lay.abstract_state, lay.device_shardings), data_iter, on_unreadable=on_unreadable
    )
    if restored is None and resume_from:
      prior = Checkpointer(resume_from, keep=keep, async_save=False).restore_latest(
        abstract_like(lay.abstract_state, lay.device_shardings), None, on_unreadable="error"
      )
      if prior is None:
        raise FileNotFoundError(f"checkpoint.resume_from: no checkpoint under {resume_from!r}")
      state = prior.state._replace(step=jnp.zeros_like(prior.state.step))
      meta, step, data_ok = {}, None, False
    elif restored is None:
      state = initial_state(model, init_from, lay.make, optimizer, lay.device_shardings, read_budget_bytes)
      meta, step, data_ok = {}, None, False
    else:
      state, meta, data_ok = restored.state, restored.meta, restored.data_restored
      step = meta.get("checkpoint_step", int(state.step))
    state = lay.place(state)
  return Core(
    **{f.name: getattr(lay, f.name) for f in dataclasses.fields(Layout)},
    ckpt=ckpt,
    state=state,
    meta=meta,
    restored_step=step,
    data_restored=data_ok,
  )
