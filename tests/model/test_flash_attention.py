"""Flash attention (k2jax.model.flash_attention) against the einsum path (k2jax.model.mla).

The Pallas kernel runs with `pallas_call(interpret=True)` on CPU: tiny shapes, few blocks.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k2jax import sharding
from k2jax.model import K2Model, mla, presets
from k2jax.model import flash_attention as fa
from k2jax.model.config import ConfigError, K2Config
from k2jax.optim import QKClipSpec, qk_clip

B, T, H, KN, KR, V = 2, 37, 3, 8, 4, 8
SCALE = 0.37
# Row 0: two packed documents then padding; row 1: one document, then padding at the end. T = 37 is
# not a multiple of either block, so the wrapper pads (with segment id 0) and slices.
SEG = np.array([[1] * 10 + [2] * 20 + [0] * 7, [5] * 30 + [0] * 7], np.int32)


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  return (
    2.0 * jax.random.normal(ks[0], (B, T, H, KN)),  # q_nope
    2.0 * jax.random.normal(ks[1], (B, T, H, KR)),  # q_rope
    jax.random.normal(ks[2], (B, T, H, KN)),  # k_nope
    jax.random.normal(ks[3], (B, T, KR)),  # the ONE shared rope key
    jax.random.normal(ks[4], (B, T, H, V)),  # v
    jax.random.normal(ks[5], (B, T, H, V)),  # cotangent weights for the loss
  )


def _flash(impl, block_q=8, block_k=16):
  def f(qn, qr, kn, kr, v, seg):
    q = jnp.concatenate([qn, qr], -1)
    k = jnp.concatenate([kn, jnp.broadcast_to(kr[:, :, None], (*kr.shape[:2], H, KR))], -1)
    return fa.flash_attention(
      q, k, v, seg, scale=SCALE, block_q=block_q, block_k=block_k, impl=impl, interpret=impl == "pallas"
    )

  return f


def _einsum(qn, qr, kn, kr, v, seg):
  return mla.einsum_attention(qn, qr, kn, kr, v, seg, SCALE)


def _loss_grads(fn, args, w):
  def loss(qn, qr, kn, kr, v):
    out, _ = fn(qn, qr, kn, kr, v, jnp.asarray(SEG))
    return jnp.sum(out * w)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_flash_equals_einsum_outputs_max_logit_and_grads(impl):
  *args, w = _inputs()
  want_out, want_max = jax.jit(_einsum)(*args, SEG)
  out, max_logit = jax.jit(_flash(impl))(*args, SEG)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(max_logit, want_max, atol=1e-5, rtol=0)
  # The max is over valid positions only: a padding query's logits are not counted. Check it moves.
  assert np.all(np.asarray(max_logit) > 1.0)
  # Padding rows (segment 0) output exactly zero, as the einsum path does, and nothing is NaN.
  pad = SEG == 0
  assert np.all(np.asarray(out)[pad] == 0.0) and np.all(np.asarray(want_out)[pad] == 0.0)
  got_g, want_g = _loss_grads(_flash(impl), args, w), _loss_grads(_einsum, args, w)
  for name, g, ref in zip(("q_nope", "q_rope", "k_nope", "k_rope", "v"), got_g, want_g):
    assert np.all(np.isfinite(np.asarray(g))), name
    np.testing.assert_allclose(g, ref, atol=1e-4, rtol=0, err_msg=name)
  # Padding rows get no gradient; their keys and values are never attended.
  for g in (got_g[0], got_g[2], got_g[4]):
    assert np.all(np.asarray(g)[pad] == 0.0)


def test_causal_and_segment_masking_by_perturbation():
  """Changing one key/value at position s changes exactly the outputs that may attend to s."""
  *args, _ = _inputs(1)
  f = jax.jit(_flash("pallas"))
  base, _ = f(*args, SEG)
  s = 12  # in row 0's second document (positions 10..29)
  args2 = list(args)
  args2[4] = args[4].at[0, s].add(3.0)
  out, _ = f(*args2, SEG)
  changed = np.any(np.asarray(out != base)[0], axis=(1, 2))
  np.testing.assert_array_equal(np.nonzero(changed)[0], np.arange(s, 30))
  np.testing.assert_array_equal(np.asarray(out)[1], np.asarray(base)[1])


def test_all_padding_batch_row_and_single_block():
  """A row of only padding stays finite (zero output); one block covering all of T matches too."""
  *args, _ = _inputs(2)
  seg = SEG.copy()
  seg[1] = 0
  want_out, want_max = _einsum(*args, seg)
  out, max_logit = jax.jit(_flash("pallas", block_q=40, block_k=40))(*args, seg)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(max_logit, want_max, atol=1e-5, rtol=0)
  assert np.all(np.asarray(out)[1] == 0.0)


def test_bad_arguments_are_named():
  *args, _ = _inputs()
  q = jnp.concatenate(args[:2], -1)
  with pytest.raises(ValueError, match="block_k=16 must be a positive multiple of 128"):
    fa.flash_attention(q, q, args[4], SEG, scale=1.0, block_q=128, block_k=16)
  with pytest.raises(ValueError, match="impl must be one of"):
    fa.flash_attention(q, q, args[4], SEG, scale=1.0, impl="triton")
  with pytest.raises(ValueError, match="segment_ids must be an integer"):
    fa.flash_attention(q, q, args[4], SEG.astype(np.float32), scale=1.0, interpret=True)
  with pytest.raises(ValueError, match="k has shape"):
    fa.flash_attention(q, q[..., :3], args[4], SEG, scale=1.0, interpret=True)


def test_attention_config_field():
  assert K2Config().attention == "auto"
  with pytest.raises(ConfigError, match="attention: one of"):
    presets.get("tiny", attention="splash")
  cfg = presets.get("tiny", attention="flash")
  d = cfg.to_hf_dict()
  assert "attention" not in d  # an execution knob, not architecture
  assert K2Config.from_hf_dict(d, attention="flash") == cfg
  # A config.json key named "attention" is not ours: kept verbatim in `extra`, written back unchanged.
  other = K2Config.from_hf_dict({**d, "attention": "sdpa"})
  assert other.attention == "auto" and other.to_hf_dict()["attention"] == "sdpa"
  # configs/k2.py -> TrainConfig boundary.
  from configs import k2 as k2_configs
  from k2jax.train.config import from_config_dict

  c = k2_configs.get_config("tiny")
  assert from_config_dict(c).model.attention == "auto"
  c.model.attention = "flash"
  assert from_config_dict(c).model.attention == "flash"


def test_auto_follows_the_target_platform_not_the_host():
  assert mla.attention_impl("auto") == "einsum"  # CPU here
  assert mla.attention_impl("einsum") == "einsum"
  assert mla.attention_impl("flash") == "pallas_interpret"
  mesh_lib = pytest.importorskip("jax._src.mesh")

  def under(platform, kind):
    device = mesh_lib.AbstractDevice(device_kind=f"fake {platform}", num_cores=None, platform=platform)
    abstract = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    seen = []

    def f(x):  # decided while tracing, as the model does
      seen.append(mla.attention_impl(kind))
      return x

    with jax.sharding.use_abstract_mesh(abstract):
      jax.jit(f).trace(jax.ShapeDtypeStruct((), jnp.float32))
    return seen[0]

  assert under("tpu", "auto") == "pallas"  # compiling for a TPU topology from this CPU host
  assert under("cuda", "auto") == "triton"
  assert under("cuda", "flash_xla") == "xla"
  assert under("tpu", "einsum") == "einsum"
  assert under("cpu", "auto") == "einsum"


CFG = presets.get(
  "tiny", num_hidden_layers=2, first_k_dense_replace=1, vocab_size=128, num_attention_heads=2, num_key_value_heads=2
)


def _model(cfg, seed=0, blow_up=1.0):
  m = K2Model(cfg, rngs=nnx.Rngs(seed))
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)
  params = jax.tree.map(lambda p: p * 8.0 if p.ndim >= 2 else p, params)
  m = nnx.merge(graphdef, params, rest)
  if blow_up != 1.0:  # q and k of the first layer: its logits reach O(10), some heads above tau
    params = nnx.state(m, nnx.Param)
    for name in ("w_q_b", "w_kv_b"):
      var = params["dense_layers"]["attn"][name]
      var[...] = var[...] * blow_up
    nnx.update(m, params)
  return m


def _batch():
  ids = jax.random.randint(jax.random.key(7), (2, 12), 0, CFG.vocab_size)
  seg = jnp.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])
  pos = jnp.array([list(range(5)) + list(range(7)), list(range(9)) + [0] * 3])
  return ids, seg, pos


@pytest.mark.slow
def test_model_flash_equals_einsum_and_qk_clip_clips_the_same_heads():
  """The whole model with attention='flash' (Pallas kernel, interpret mode) vs 'einsum'."""
  ids, seg, pos = _batch()
  valid = np.asarray(seg > 0)
  outs = {}
  for kind in ("einsum", "flash"):
    model = _model(CFG.replace(attention=kind), blow_up=3.0)

    def loss(m):
      out = m(ids, seg, pos)
      return jnp.sum(jnp.where(seg[..., None] > 0, out.logits, 0.0) ** 2) / 1e3, out

    (value, out), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    outs[kind] = (value, out, nnx.state(grads, nnx.Param), nnx.state(model, nnx.Param))
  (l0, o0, g0, p0), (l1, o1, g1, _) = outs["einsum"], outs["flash"]
  np.testing.assert_allclose(np.asarray(o1.logits)[valid], np.asarray(o0.logits)[valid], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(o1.max_logits, o0.max_logits, atol=1e-5, rtol=1e-6)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(np.abs(b).max())), rtol=1e-4, err_msg=str(path))

  # QK-Clip driven by each path's max logits rescales the same heads by the same factors.
  max0, max1 = np.asarray(o0.max_logits), np.asarray(o1.max_logits)
  tau = float(np.median(max0))
  assert 1 <= (max0 > tau).sum() < max0.size
  np.testing.assert_array_equal(max1 > tau, max0 > tau)
  spec = QKClipSpec.from_config(CFG)
  params = jax.tree.map(jnp.asarray, nnx.to_pure_dict(p0))
  clipped0, clipped1 = (
    qk_clip(params, jnp.asarray(max0), spec, tau=tau),
    qk_clip(params, jnp.asarray(max1), spec, tau=tau),
  )
  for a, b, before in zip(jax.tree.leaves(clipped1), jax.tree.leaves(clipped0), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=0)
    # Exactly the same columns changed.
    np.testing.assert_array_equal(np.asarray(a) != np.asarray(before), np.asarray(b) != np.asarray(before))


@pytest.mark.slow
def test_sharded_flash_equals_unsharded():
  """Under a mesh the kernel runs per device under shard_map (batch over fsdp, heads over tensor)."""
  *args, w = _inputs(3)
  want_out, want_max = _einsum(*args, SEG)
  want_g = _loss_grads(_einsum, args, w)
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 1}, devices=jax.devices()[:2])
  impl = "pallas_interpret"
  fn = functools.partial(mla.flash_mla_attention, scale=SCALE, impl=impl)

  def run(qn, qr, kn, kr, v, seg):
    return fn(qn, qr, kn, kr, v, seg)

  with sharding.use(mesh, "fsdp"):
    out, max_logit = jax.jit(run)(*args, SEG)
    got_g = _loss_grads(run, args, w)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(max_logit, want_max, atol=1e-5, rtol=0)
  for g, ref in zip(got_g, want_g):
    np.testing.assert_allclose(g, ref, atol=1e-4, rtol=0)


def test_compiles_for_tpu_where_libtpu_imports():
  """Lower and compile the kernel's forward and backward for a v5p chip (no TPU needed, libtpu is)."""
  devices = _tpu_devices()
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shapes = [((1, 300, 2, 192), jnp.bfloat16)] * 2 + [((1, 300, 2, 128), jnp.bfloat16)] * 2 + [((1, 300), jnp.int32)]
  q, k, v, w, seg = (jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes)

  def loss(q, k, v, w, seg):
    out, max_logit = fa.flash_attention(q, k, v, seg, scale=0.1, block_q=128, block_k=256)
    return jnp.sum(out.astype(jnp.float32) * w), max_logit

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(q, k, v, w, seg).compile()
  assert compiled.as_text().count("tpu_custom_call") == 3  # forward, dq, dk/dv


def _tpu_devices():
  try:
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
  except Exception as e:  # noqa: BLE001 - any failure here means no usable libtpu
    pytest.skip(f"no TPU compiler here (libtpu does not import or make a v5p topology: {type(e).__name__}: {e})")


@pytest.mark.slow
def test_model_auto_attention_compiles_the_kernel_for_a_tpu_mesh():
  """From this CPU host, `attention='auto'` under a v5p mesh (heads over `tensor`) takes the kernel."""
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2}, devices=_tpu_devices())
  cfg = presets.get("tiny", compute_dtype="bfloat16")
  graphdef, state = nnx.split(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  shardings = sharding.param_shardings(state, mesh, "fsdp_ep_tp")
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp", "expert")))
  ids = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=batch)

  def loss(state, ids):
    out = nnx.merge(graphdef, state)(ids, (ids > 0).astype(jnp.int32))
    return jnp.mean(out.logits**2), out.max_logits

  with sharding.use(mesh, "fsdp_ep_tp"):
    compiled = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(state, ids).compile()
  text = compiled.as_text()
  kernels = lambda name: len(re.findall(name + r"[\w.]* = [^\n]*custom-call", text))  # noqa: E731
  # forward, dq and dk/dv kernels, once per layer stack (dense, MoE)
  assert [kernels(f"%k2jax_flash_mla_{k}") for k in ("fwd", "dq", "dkv")] == [2, 2, 2]
  # The MoE's grouped GEMMs stay XLA:TPU's own (moe_gemm auto on TPU: ragged_dot, a Mosaic kernel of libtpu's):
  # gate, up and down, forward, dlhs and drhs each. The suite's `highest` matmul precision on bf16 operands
  # compiles (moe_gemm._precision).
  assert kernels("%ragged-dot-none") == 9
