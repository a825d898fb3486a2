"""Context parallelism on 8 fake CPU devices: every layout equals the unsharded forward and gradients.

One packed batch whose segments cross the load-balancing chunk boundaries (and padding); the reference
forward/backward is compiled once per module, each layout once. float32 throughout, to 1e-5.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k2jax import sharding
from k2jax.model import K2Model, attention_gpu, context_parallel, mla, presets
from k2jax.model.config import ConfigError
from k2jax.optim import QKClipSpec, muonclip
from k2jax.train import hlo_stats
from k2jax.train.step import ModelDef, accumulate_grads, apply_update, init_state

RTOL = 1e-5
B, T, V = 4, 32, 4096
# Segment lengths per row (the rest is padding): runs cross every chunk boundary for c = 4 and 8.
SEGMENTS = ((5, 11, 9), (32,), (3, 20, 4), (17, 8))
CFG = presets.get("tiny", num_hidden_layers=2, n_routed_experts=8)  # one dense + one MoE layer


def _packed():
  rng = np.random.default_rng(3)
  seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
  for b, lengths in enumerate(SEGMENTS):
    t = 0
    for i, n in enumerate(lengths):
      seg[b, t : t + n], pos[b, t : t + n] = i + 1, np.arange(n)
      t += n
  ids = rng.integers(0, V, (B, T)).astype(np.int32)
  cot = rng.standard_normal((B, T, V)).astype(np.float32)
  return tuple(jnp.asarray(a) for a in (ids, seg, pos, cot))


@functools.cache
def _state():
  """Parameters filled from numpy (no per-op compiles), shared by every layout."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: K2Model(CFG, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)

  def fill(path, x):
    name = jax.tree_util.keystr(path)
    if "router" in name and "bias" in name:
      return jnp.zeros(x.shape, x.dtype)
    if "scale" in name:
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype)

  return jax.tree_util.tree_map_with_path(fill, state)


def _loss(graphdef, params, rest, ids, seg, pos, cot):
  out = nnx.merge(graphdef, params, rest)(ids, seg, pos)
  return jnp.sum(out.logits * cot), out


def _run(preset=None, mesh_shape=None, **knobs):
  cfg = CFG.replace(**knobs)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  state, args = _state(), _packed()
  fn = jax.jit(jax.value_and_grad(functools.partial(_loss, graphdef), has_aux=True))
  if preset is None:
    _, params, rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    return jax.device_get(fn(params, rest, *args))
  mesh = sharding.make_mesh(mesh_shape)
  state = jax.device_put(state, sharding.param_shardings(state, mesh, preset))
  _, params, rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
  args = tuple(jax.device_put(a, sharding.batch_sharding(mesh, preset, ndim=a.ndim)) for a in args)
  assert args[0].sharding.spec[1] == sharding.CP_AXIS  # the sequence really is sharded
  with sharding.use(mesh, preset):
    return jax.device_get(fn(params, rest, *args))


@pytest.fixture(scope="module")
def reference():
  return _run()


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


LAYOUTS = {
  "context_alone": ("fsdp_cp", {"expert": 8}, {}),
  "with_fsdp_heads_gather": ("fsdp_cp", {"fsdp": 2, "expert": 4}, {"cp_gather": "heads"}),
  "with_expert": ("fsdp_ep_cp", {"data": 2, "expert": 4}, {}),
  "with_tensor_flash_xla": ("fsdp_ep_tp_cp", {"expert": 4, "tensor": 2}, {"attention": "flash_xla"}),
  "with_flash_kernel": ("fsdp_ep_cp", {"fsdp": 2, "expert": 4}, {"attention": "flash"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_unsharded_forward_and_gradients(reference, layout):
  preset, mesh_shape, knobs = LAYOUTS[layout]
  (loss0, out0), g0 = reference
  (loss1, out1), g1 = _run(preset, mesh_shape, **knobs)
  assert _rel(out1.logits, out0.logits) <= RTOL
  assert _rel(out1.max_logits, out0.max_logits) <= RTOL  # global over batch and context shards
  np.testing.assert_array_equal(out1.expert_counts, out0.expert_counts)
  assert int(out0.expert_counts.sum()) == sum(map(sum, SEGMENTS)) * CFG.num_experts_per_tok
  assert _rel(loss1, loss0) <= RTOL
  flat0 = dict(jax.tree_util.tree_flatten_with_path(g0)[0])
  flat1 = dict(jax.tree_util.tree_flatten_with_path(g1)[0])
  assert flat0.keys() == flat1.keys()
  for path, want in flat0.items():
    assert _rel(flat1[path], want) <= RTOL, jax.tree_util.keystr(path)


def test_load_balanced_order_round_trips_and_balances_causal_work():
  c = 4
  pos = context_parallel.global_positions(32, c)
  # Shard r holds chunks r and 2c-1-r: [0..3 | 28..31], [4..7 | 24..27], ...
  np.testing.assert_array_equal(pos[:8], [0, 1, 2, 3, 28, 29, 30, 31])
  work = [int(np.sum(pos[r * 8 : (r + 1) * 8] + 1)) for r in range(c)]  # keys each shard's queries see
  assert len(set(work)) == 1
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
  x = jnp.arange(2 * 32 * 3, dtype=jnp.int32).reshape(2, 32, 3)
  with sharding.use(mesh, "fsdp_cp"):
    x = jax.device_put(x, sharding.batch_sharding(mesh, "fsdp_cp", ndim=3))
    balanced = jax.jit(context_parallel.balance)(x)
    back = jax.jit(context_parallel.restore)(balanced)
  np.testing.assert_array_equal(np.asarray(balanced), np.asarray(x)[:, pos])
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


@pytest.mark.parametrize("c", [2, 3, 8, 32])
def test_ppermute_plans_realise_the_permutation(c):
  """The static exchange plans, simulated in numpy: natural -> balanced gives `global_positions`, and back."""
  g = 3
  natural = np.arange(2 * c * g).reshape(c, 2, g)  # device r holds chunks 2r, 2r+1

  def run(x, forward):
    out = np.zeros_like(x)
    for pairs, send_slot, recv_slot in context_parallel._plan(c, forward):
      for src, dst in pairs:
        out[dst, recv_slot[dst]] = x[src, send_slot[src]]
    return out

  balanced = run(natural, True)
  np.testing.assert_array_equal(balanced.reshape(-1), context_parallel.global_positions(2 * c * g, c))
  np.testing.assert_array_equal(run(balanced, False), natural)


def test_bad_context_inputs_are_named():
  with pytest.raises(context_parallel.ContextParallelError, match="length 20 is not divisible by 8"):
    context_parallel.global_positions(20, 4)
  with pytest.raises(ConfigError, match="cp_gather"):
    presets.get("tiny", cp_gather="ring")
  mesh = sharding.make_mesh({"expert": 8})
  graphdef, state = nnx.split(nnx.eval_shape(lambda: K2Model(CFG, rngs=nnx.Rngs(0))))
  ids = jax.ShapeDtypeStruct((8, 24), jnp.int32, sharding=NamedSharding(mesh, P(None, "expert")))
  with sharding.use(mesh, "fsdp_cp"), pytest.raises(context_parallel.ContextParallelError, match="2 x 8 = 16"):
    jax.jit(lambda s, i: nnx.merge(graphdef, s)(i).logits).trace(state, ids)


def _attention_inputs(S=64, H=2, Kn=8, Kr=8, Dv=8, rows=2):
  rng = np.random.default_rng(5)
  f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
  seg = np.zeros((rows, S), np.int32)
  seg[0, :20], seg[0, 20:50], seg[1, 3:64] = 1, 2, 1
  return f(rows, S, H, Kn), f(rows, S, H, Kr), f(rows, S, H, Kn), f(rows, S, Kr), f(rows, S, H, Dv), jnp.asarray(seg)


@pytest.mark.parametrize("impl", ["tokamax_xla", "pallas_interpret"])
def test_kernels_under_context_parallelism_equal_einsum(impl):
  """The GPU wrapper (tokamax's reference path on CPU) and the Pallas kernel take each device's balanced
  queries against the gathered keys: same output and max logit as the unsharded einsum path."""
  q_nope, q_rope, k_nope, k_rope, v, seg = _attention_inputs()
  want_out, want_max = mla.einsum_attention(q_nope, q_rope, k_nope, k_rope, v, seg, 0.3)
  mesh = sharding.make_mesh({"data": 2, "expert": 4})

  def cp_attention(q_nope, q_rope, k_nope, k_rope, v, seg):
    bal = [context_parallel.balance(a) for a in (q_nope, q_rope, seg)]
    q_pos = context_parallel.query_positions(*seg.shape)
    out, mx = mla.flash_mla_attention(*bal[:2], k_nope, k_rope, v, bal[2], 0.3, impl, seg, q_pos)
    return context_parallel.restore(out), mx

  with sharding.use(mesh, "fsdp_cp"):
    out, mx = jax.jit(cp_attention)(q_nope, q_rope, k_nope, k_rope, v, seg)
  assert _rel(out, want_out) <= RTOL
  np.testing.assert_allclose(mx, want_max, rtol=RTOL)


def _mla_layer_hlo(gather: str, cfg, S: int, c: int) -> dict:
  """Collective bytes and matmul FLOPs of one MLA layer's forward + backward under CP (compiled, not run)."""
  cfg = cfg.replace(cp_gather=gather)
  layer = nnx.eval_shape(lambda: mla.MLA(cfg, stack=None, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(layer)
  mesh = sharding.make_mesh({"fsdp": 8 // c, "expert": c})
  spec = sharding.batch_sharding(mesh, "fsdp_cp", ndim=3)
  Kr2 = cfg.qk_rope_head_dim // 2
  x = jax.ShapeDtypeStruct((8 // c, S, cfg.hidden_size), jnp.float32, sharding=spec)
  cs = jax.ShapeDtypeStruct((8 // c, S, Kr2), jnp.float32, sharding=spec)
  seg = jax.ShapeDtypeStruct((8 // c, S), jnp.int32, sharding=sharding.batch_sharding(mesh, "fsdp_cp"))
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), state)

  def loss(state, x, cos, sin, seg):
    out, _ = nnx.merge(graphdef, state)(x, cos, sin, seg)
    return jnp.sum(out)

  with sharding.use(mesh, "fsdp_cp"):
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x, cs, cs, seg).compile().as_text()
  return hlo_stats.hlo_stats(text)


def test_latent_gather_moves_fewer_bytes_than_per_head_keys():
  """The lowered HLO of one MLA layer (fwd + bwd) under CP: the latent gather moves (Rkv + Kr) values per
  token, the per-head gather H*(Kn + V) + Kr; the latent path pays with up-projection FLOPs."""
  cfg = presets.get("tiny", num_attention_heads=8, num_key_value_heads=8)  # 8 x 32 + 8 = 264 vs 32 + 8 = 40 values
  latent, heads = (_mla_layer_hlo(g, cfg, S=64, c=4) for g in ("latent", "heads"))
  # float32, one row per device: 64 keys x 40 values x 4 bytes = 10,240 (+ 256 of segment ids) vs 67,584.
  assert latent["all-gather_bytes"] * 5 < heads["all-gather_bytes"], (latent, heads)
  assert latent["matmul_flops"] > heads["matmul_flops"]  # every device up-projects all 64 keys


def _clip_step(tau, preset=None, mesh_shape=None):
  """One MuonClip train step on the packed batch: (new params, per-head max logits, clipped head count)."""
  model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: K2Model(CFG, rngs=nnx.Rngs(0)))), _state())
  # AdamW's first step is lr*g/(|g| + eps): with eps 1e-8 a gradient of +-1e-9 (float32 rounding of a zero)
  # flips a whole lr step; eps 1e-3 keeps the update continuous in the gradient, so 1e-5 compares CP itself.
  opt = muonclip(1e-2, qk_clip_tau=tau, qk_clip_spec=QKClipSpec.from_config(CFG), adam_eps=1e-3)
  mdef, state = ModelDef.from_model(model), init_state(model, opt)
  ids, seg, pos, _ = _packed()
  targets = jnp.where(seg[:, 1:] == seg[:, :-1], ids[:, 1:], 0)
  batch = {
    "input_ids": ids,
    "targets": jnp.pad(targets, ((0, 0), (0, 1))),
    "segment_ids": seg,
    "positions": pos,
    "loss_mask": jnp.pad((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), ((0, 0), (0, 1))).astype(jnp.int32),
  }

  def step(state, batch):
    grads, loss, aux = accumulate_grads(mdef, state.params, state.bias, batch, 1)
    new, _ = apply_update(
      state, grads, loss, aux, opt, optax.constant_schedule(1e-2), bias_update_rate=0.0, qk_clip_tau=tau
    )
    return new.params, aux["max_logits"], new.opt_state.qk_clipped_heads

  if preset is None:
    return jax.device_get(jax.jit(step)(state, batch))
  mesh = sharding.make_mesh(mesh_shape)
  state = jax.device_put(state, NamedSharding(mesh, P()))
  batch = {k: jax.device_put(v, sharding.batch_sharding(mesh, preset)) for k, v in batch.items()}
  with sharding.use(mesh, preset):
    return jax.device_get(jax.jit(step)(state, batch))


@pytest.mark.slow
def test_qk_clip_under_context_parallelism_equals_the_unsharded_step(reference):
  """Max logits, the heads QK-Clip rescales and the updated weights equal the unsharded step's."""
  (_, out0), _ = reference
  logits = np.sort(np.asarray(out0.max_logits).ravel())
  mid = len(logits) // 2
  tau = float(logits[mid - 1] + logits[mid]) / 2  # half the heads clip; no head within 1e-5 of tau
  params0, max0, clipped0 = _clip_step(tau)
  params1, max1, clipped1 = _clip_step(tau, "fsdp_ep_cp", {"fsdp": 2, "expert": 4})
  assert _rel(max1, max0) <= RTOL
  np.testing.assert_array_equal(max1 > tau, max0 > tau)
  assert int(clipped1) == int(clipped0) == len(logits) - mid
  flat0 = dict(jax.tree_util.tree_flatten_with_path(params0)[0])
  flat1 = dict(jax.tree_util.tree_flatten_with_path(params1)[0])
  for path, want in flat0.items():
    assert _rel(flat1[path], want) <= RTOL, jax.tree_util.keystr(path)


def test_gpu_kernel_with_query_positions_lowers_for_cuda():
  """tokamax's Triton kernel takes a CP share (16 balanced queries against 64 gathered keys, k_start/k_end):
  forward and backward lower to Triton kernels for CUDA from this CPU host."""
  q_nope, q_rope, k_nope, k_rope, v, seg = _attention_inputs()
  pos_T = jnp.asarray(context_parallel.global_positions(64, 4)[:16])  # shard 0 of 4: chunks 0 and 7
  q = jnp.concatenate([q_nope, q_rope], -1)[:, pos_T].astype(jnp.bfloat16)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape)], -1).astype(jnp.bfloat16)
  pos_BT = jnp.broadcast_to(pos_T, (2, 16))

  def f(q, k, v):
    out, mx = attention_gpu.tokamax_attention(
      q, k, v, seg[:, pos_T], scale=0.3, kv_segment_ids_BS=seg, q_positions_BT=pos_BT
    )
    return jnp.sum(out.astype(jnp.float32)), mx

  with sharding.target_platform("gpu"):
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v.astype(jnp.bfloat16))]
    grad = jax.grad(f, argnums=(0, 1, 2), has_aux=True)
    text = jax.jit(grad).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @__gpu$xla.gpu.triton(") >= 2, "forward and backward kernels"
