"""Pipeline parallelism (k2jax.model.pipeline): the pipelined train step equals the unpipelined one.

Loss, gradients, QK-Clip's max logits, the balancing counts and the whole MuonClip step (params, bias, optimizer
state) under 2 and 4 stages, with repeats and with layers left outside the pipeline, against one device without
a pipeline, float32 to 1e-5. One tiny model (1 dense + 4 MoE layers) and one reference step serve every case."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k2jax import sharding
from k2jax.data import PretrainDataConfig, make_pretrain_iter
from k2jax.model import K2Model, presets
from k2jax.model.config import ConfigError
from k2jax.model.pipeline import PipelineError, PipelineSpec, bubble_fraction, plan
from k2jax.optim import QKClipSpec, muonclip
from k2jax.train import aot, core
from k2jax.train.step import accumulate_grads, init_state, make_train_step
from tests.cross_lowering import NEEDS_GPU_MESH

# ragged_dot: the CPU default grouped GEMM ('tiled') cannot run inside stages on a stage mesh (transformer.py).
CFG = presets.get("tiny", num_hidden_layers=5, moe_gemm="ragged_dot")
TAU = 0.05  # about half the heads of this model exceed it at init: the clip path is compared too
TOL = 1e-5


def _optimizer():
  # AdamW's first step is g / (|g| + eps): for the LM head's rows of tokens absent from the batch (|g| ~ 1e-7)
  # float32 rounding of another summation order moves the update by O(lr * rounding / eps); eps = 1e-4 keeps
  # the comparison about the pipeline, not that amplification (Muon's leaves are unaffected either way).
  return muonclip(1e-2, qk_clip_tau=TAU, qk_clip_spec=QKClipSpec.from_config(CFG), adam_eps=1e-4)


def _step_and_grads(mdef, opt, pipeline):
  step = make_train_step(
    mdef,
    opt,
    optax.constant_schedule(1e-2),
    num_microbatches=1,
    bias_update_rate=1e-3,
    qk_clip_tau=TAU,
    pipeline=pipeline,
  )

  def both(state, batch):
    grads, loss, aux = accumulate_grads(mdef, state.params, state.bias, batch, 1, pipeline=pipeline)
    new, metrics = step(state, batch)
    return grads, loss, aux, new, metrics

  return both


@pytest.fixture(scope="module")
def batch():
  it = make_pretrain_iter(PretrainDataConfig(seq_len=16, batch_size=8, seed=5))
  return {k: jnp.asarray(v) for k, v in next(it).items()}


@pytest.fixture(scope="module")
def state0():
  """The initial TrainState (host arrays) every layout starts from."""
  return jax.tree.map(np.asarray, init_state(K2Model(CFG, rngs=nnx.Rngs(0)), _optimizer()))


@pytest.fixture(scope="module")
def reference(state0, batch):
  """The unpipelined step on one device: (state, (grads, loss, aux, new_state, metrics))."""
  opt = _optimizer()
  mdef = core.layout(CFG, opt, mesh=sharding.make_mesh({}, devices=jax.devices()[:1]), preset="fsdp", seed=0).mdef
  out = jax.jit(_step_and_grads(mdef, opt, None))(jax.tree.map(jnp.asarray, state0), batch)
  return state0, jax.tree.map(np.asarray, out)


def _assert_close(got, want, what):
  diff = jax.tree.map(
    lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0)), got, want
  )
  worst = max(jax.tree.leaves(diff))
  assert worst <= TOL, (what, diff)


def _pipelined(mesh_shape, preset, spec, state0, batch):
  mesh = sharding.make_mesh(mesh_shape)
  opt = _optimizer()
  lay = core.layout(CFG, opt, mesh=mesh, preset=preset, seed=0, pipeline=spec)
  with lay.use():
    state = jax.device_put(jax.tree.map(jnp.asarray, state0), lay.shardings)
    b = jax.device_put(batch, lay.batch_sharding)
    out = jax.jit(_step_and_grads(lay.mdef, opt, spec))(state, b)
  return lay, jax.tree.map(np.asarray, out)


CASES = {
  # 2 stages x 2 repeats x 1 layer, 4 microbatches; EP inside each stage.
  "stages2_repeats2_ep": ({"stage": 2, "fsdp": 2, "expert": 2}, "fsdp_ep", PipelineSpec(2, repeats=2, microbatches=4)),
  # 4 stages x 1 layer; TP and EP inside each stage.
  "stages4_ep_tp": ({"stage": 4, "expert": 2}, "fsdp_ep_tp", PipelineSpec(4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_step_equals_unpipelined(case, reference, batch):
  state0, (g_ref, loss_ref, aux_ref, new_ref, m_ref) = reference
  mesh_shape, preset, spec = CASES[case]
  lay, (g, loss, aux, new, m) = _pipelined(mesh_shape, preset, spec, state0, batch)
  assert abs(float(loss) - float(loss_ref)) <= TOL
  _assert_close(g, g_ref, "grads")
  assert float(optax.tree.norm(g_ref)) > 0.1  # a real gradient
  _assert_close(aux["max_logits"], aux_ref["max_logits"], "max_logits")  # bubbles left out, per layer
  np.testing.assert_array_equal(aux["expert_counts"], aux_ref["expert_counts"])  # summed over microbatches
  assert int(m_ref["qk_clipped_heads"]) > 0 and int(m["qk_clipped_heads"]) == int(m_ref["qk_clipped_heads"])
  _assert_close(new.params, new_ref.params, "params after the MuonClip step")
  _assert_close(new.bias, new_ref.bias, "router bias")
  _assert_close(new.opt_state, new_ref.opt_state, "optimizer state")
  # The pipelined stack is stored sharded over `stage`; the dense layer, embedding and head are not.
  assert all(s.spec[0] == "stage" for s in jax.tree.leaves(lay.shardings.params["moe_layers"]))
  assert "stage" not in str(jax.tree.leaves(lay.shardings.params["dense_layers"])[0].spec)


def test_layers_outside_the_pipeline():
  """2 stages over the last 2 of 4 MoE layers (the first 2 run before the pipeline): the same outputs."""
  model = K2Model(CFG, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(3), (4, 8), 0, CFG.vocab_size)
  ref, out = model(ids), model(ids, pipeline=PipelineSpec(2, layers=2))
  np.testing.assert_allclose(out.logits, ref.logits, atol=TOL)
  np.testing.assert_allclose(out.max_logits, ref.max_logits, atol=TOL)
  np.testing.assert_array_equal(out.expert_counts, ref.expert_counts)


def test_dense_only_stack_pipelines():
  """A model without MoE layers pipelines its dense stack: stages with no MoE layer, no expert counts."""
  cfg = presets.get("tiny", num_hidden_layers=4, first_k_dense_replace=4)
  model = K2Model(cfg, rngs=nnx.Rngs(1))
  ids = jax.random.randint(jax.random.key(2), (4, 8), 0, cfg.vocab_size)
  ref = model(ids)
  out = model(ids, pipeline=PipelineSpec(2, repeats=2))
  assert out.expert_counts.shape == (0, cfg.n_routed_experts)
  np.testing.assert_allclose(out.logits, ref.logits, atol=TOL)
  np.testing.assert_allclose(out.max_logits, ref.max_logits, atol=TOL)


def test_plan_refuses_what_cannot_work():
  with pytest.raises(PipelineError, match=r"60 pipelined layers are not divisible by mesh.stage \(16\)"):
    plan(PipelineSpec(16), 60)
  with pytest.raises(PipelineError, match=r"microbatches: 2 < 4 stages"):
    plan(PipelineSpec(4, microbatches=2), 8)
  with pytest.raises(PipelineError, match=r"does not divide the 6 rows"):
    plan(PipelineSpec(4), 8, rows=6)
  with pytest.raises(PipelineError, match=r"pipeline.layers: 9 > the 8 layers"):
    plan(PipelineSpec(4, layers=9), 8)
  p = plan(PipelineSpec(16, repeats=3, microbatches=32, layers=48), 60)
  assert (p.outside, p.per_stage, p.iterations) == (12, 1, 3 * 32 + 15)
  # The reference's K2-shaped examples: p=16, v=3, m=32 -> 13.5%; p=4, v=15, m=8 -> 2.4%.
  assert round(100 * bubble_fraction(16, 3, 32), 1) == 13.5 and round(100 * bubble_fraction(4, 15, 8), 1) == 2.4


def _config(**kw):
  from configs import k2

  c = k2.get_config("tiny")
  with c.unlocked():
    c.model.num_hidden_layers = 5
    for key, v in kw.items():
      section, name = key.split(".")
      c[section][name] = v
  return c


def test_config_refusals_name_the_knob():
  from k2jax.train.config import check_runtime, from_config_dict

  def refused(match, **kw):
    with pytest.raises(ConfigError, match=match):
      check_runtime(from_config_dict(_config(**kw)), 8, 1)

  refused(
    r"4 pipelined layers are not divisible by mesh.stage \(2\) x pipeline.repeats \(4\)",
    **{"mesh.stage": 2, "pipeline.repeats": 4},
  )
  refused(r"pipeline.microbatches: 1 < 2 stages", **{"mesh.stage": 2, "pipeline.microbatches": 1})
  refused(r"product 16 != 8 devices", **{"mesh.stage": 2, "mesh.fsdp": 8})
  refused(r"pipeline.layers: 6 > the 4 layers", **{"mesh.stage": 2, "pipeline.layers": 6})
  refused(
    r"pipeline.microbatches: 8 pipeline microbatches of 2 rows: not divisible by the 4 batch shards",
    **{"mesh.stage": 2, "pipeline.microbatches": 8},
  )
  shape = check_runtime(from_config_dict(_config(**{"mesh.stage": 2})), 8, 1)
  assert shape == {"stage": 2, "data": 1, "fsdp": 4, "expert": 1, "tensor": 1}


def test_dry_run_prints_the_schedule_and_bubble():
  from k2jax.train import dryrun

  out = dryrun.report(_config(**{"mesh.stage": 2, "pipeline.repeats": 2, "pipeline.microbatches": 4}))
  lines = dict(line.split("=", 1) for line in out.splitlines())
  assert lines["pipeline_stages"] == "2" and lines["pipeline_repeats"] == "2" and lines["pipeline_microbatches"] == "4"
  assert lines["pipeline_layers"] == "4" and lines["pipeline_layers_before"] == "1"  # the dense first layer
  assert lines["pipeline_iterations"] == str(2 * 4 + 1)
  assert lines["pipeline_bubble_fraction"] == f"{1 / 9:.4f}"
  assert lines["mesh_stage"] == "2" and lines["mesh_dcn_data"] == "1"


def test_checkpoint_restores_across_stage_layouts(state0, tmp_path):
  """Saved with the MoE stack stored over 2 stages (and 2 repeats), restored with no stage axis and with 4
  stages: the same values (layers keep their natural order in every layout)."""
  from k2jax.train.checkpoint import Checkpointer, abstract_like

  opt = _optimizer()

  def layout(mesh_shape, spec):
    return core.layout(CFG, opt, mesh=sharding.make_mesh(mesh_shape), preset="fsdp", seed=0, pipeline=spec)

  saved = layout({"stage": 2, "fsdp": 4}, PipelineSpec(2, repeats=2, microbatches=4))
  with saved.use():
    state = jax.device_put(jax.tree.map(jnp.asarray, state0), saved.shardings)
    assert jax.tree.leaves(state.params["moe_layers"])[0].sharding.spec[0] == "stage"
    ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
    ckpt.save(1, state, None, {})
    ckpt.close()
  for mesh_shape, spec in (({"fsdp": 8}, None), ({"stage": 4, "fsdp": 2}, PipelineSpec(4))):
    lay = layout(mesh_shape, spec)
    with lay.use():
      ckpt = Checkpointer(str(tmp_path), keep=1, async_save=False)
      restored = ckpt.restore_latest(abstract_like(lay.abstract_state, lay.shardings), on_unreadable="error")
      ckpt.close()
    leaf = jax.tree.leaves(restored.state.params["moe_layers"])[0]
    assert (leaf.sharding.spec[0] == "stage") == (spec is not None)
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state0)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@NEEDS_GPU_MESH
def test_step_lowers_for_gpu_with_stages_and_ep_tp_inside():
  """The pipelined step lowered for CUDA on an 8-device mesh: 2 stages (across hosts), EP 2 x TP 2 inside each
  (the GPU kernels chosen, the experts' all-to-all inside the stages, arrays sharded over `stage`)."""
  pytest.importorskip("tokamax")
  c = _config(**{"mesh.stage": 2, "mesh.expert": 2, "mesh.tensor": 2, "mesh.fsdp": 1, "mesh.rules": "fsdp_ep_tp"})
  with c.unlocked():
    c.model.compute_dtype = "bfloat16"
  text = aot.lower_step_for_gpu(c, num_devices=8).as_text()
  assert re.search(r"custom_call @__gpu\$xla\.gpu\.triton", text)  # tokamax's grouped GEMM / attention kernels
  assert "all_to_all" in text  # expert parallelism inside each stage
  assert '{"stage"}' in text  # the stage-sharded layer stack and pipeline buffers
