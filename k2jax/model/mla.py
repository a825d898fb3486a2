"""Multi-head Latent Attention (DeepSeek-V3 / Kimi K2), with packed-sequence masking.

q = W_qb · RMSNorm(W_qa x)                 -> per head [q_nope (Kn) | q_rope (Kr)]
[c_kv | k_rope] = W_kva x                  -> latent (Rkv) and ONE shared rope key (Kr)
[k_nope | v] = W_kvb · RMSNorm(c_kv)       -> per head (Kn, V)
logits = scale · (q_nope·k_nope + rope(q_rope)·rope(k_rope))

Besides the output, the layer returns the per-head max pre-softmax logit over valid (unmasked)
positions: QK-Clip (K2 §2.1) rescales exactly the heads whose max exceeds tau.

The attention kinds compute the same function (`cfg.attention`, resolved by `attention_impl`):
  einsum        materialises [B, H, T, T] float32 logits; the reference, and the CPU path.
  flash         the fused kernel of the compile target: on TPU our Pallas kernel
                (`k2jax.model.flash_attention`); on GPU tokamax's Pallas-Triton kernel
                (`k2jax.model.attention_gpu`, compute capability >= 8.0); on CPU the Pallas kernel in
                interpret mode (slow: tests only). Memory linear in T, the max logit from the kernel.
  flash_triton  the GPU kernel explicitly (an error on a CPU or TPU target).
  flash_xla     the plain-JAX blocked fallback (`flash_attention(impl="xla")`) on any target: the
                documented fallback where the GPU kernel refuses (old GPU, dtype, head dim > 256).
"auto" takes flash when the computation is compiled for TPU or GPU and einsum on CPU. The platform
is the compile target's (`k2jax.sharding.platform`), not `jax.default_backend()`: compiling for a TPU
topology from a CPU host must pick the TPU kernel.
Rows with no valid key (padding, segment id 0) output exactly 0 on every path.

Context parallelism (`k2jax.model.context_parallel`; a `*_cp` rules preset): the queries stay sharded by
sequence (each device its load-balanced share) and the keys are gathered over the context axis. What is
gathered is `cfg.cp_gather`:
  latent  the normalised latent c_kv and the rotated shared rope key, (Rkv + Kr) values per token: 576 for
          K2, 1,152 bytes in bf16; each device then up-projects every gathered token to per-head k_nope
          and v itself (2·S·Rkv·H·(Kn+V) FLOPs per layer, (c-1)/c of it redundant).
  heads   the per-head k_nope, the rope key and v after a local up-projection: H·(Kn+V) + Kr values per
          token, 16,448 for K2 (32,896 bytes in bf16; the kernels then broadcast the rope key per head).
The default is 'latent': 28.6x fewer bytes gathered per layer (and as many fewer in the backward's gradient
reduction), for an up-projection every device repeats for all S keys: (c-1)/c of 2·S·Rkv·H·(Kn+V) FLOPs, which
relative to the causal attention it feeds is (c-1)·819/S for K2: 7.5% at S = 32k with c = 4, 4.4% at 128k with
c = 8, and falling with S, while the per-head gather moves 32.9 KB per token per layer (bench/cp_gather.py measures
both from the compiled HLO of one K2 layer; tests/sharding/test_context_parallel.py checks the ordering).
The gathered keys are put back in natural order, so a query's causal limit is its global position; the
per-head max logit is reduced over the context axis too (`sharded_flash_attention`; under jit the einsum
path's max is global already), so QK-Clip sees the same maxima as without CP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from k2jax import sharding as sharding_lib
from k2jax.model import attention_gpu
from k2jax.model import context_parallel as cp
from k2jax.model import flash_attention as flash_lib
from k2jax.model import rope as rope_lib
from k2jax.model.config import K2Config
from k2jax.model.layers import RMSNorm, make_param

# HF builds q_a_layernorm and kv_a_layernorm with the default eps, not config.rms_norm_eps.
LORA_NORM_EPS = 1e-6
_NEG = -1e30  # finite "minus infinity": fully masked rows (padding) stay NaN-free


class MLA(nnx.Module):
  def __init__(self, cfg: K2Config, *, stack: int | None, rngs: nnx.Rngs):
    D, H = cfg.hidden_size, cfg.num_attention_heads
    Kn, Kr, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    Rq, Rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    std, dt = cfg.initializer_range, jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.scale = rope_lib.softmax_scale(cfg)
    self.w_q_a = make_param(rngs, (D, Rq), ("embed", "q_lora"), stack=stack, std=std, dtype=dt)
    self.q_norm = RMSNorm(Rq, "q_lora", eps=LORA_NORM_EPS, stack=stack, rngs=rngs, dtype=dt)
    self.w_q_b = make_param(rngs, (Rq, H * (Kn + Kr)), ("q_lora", "q_heads"), stack=stack, std=std, dtype=dt)
    self.w_kv_a = make_param(rngs, (D, Rkv + Kr), ("embed", "kv_lora_rope"), stack=stack, std=std, dtype=dt)
    self.kv_norm = RMSNorm(Rkv, "kv_lora", eps=LORA_NORM_EPS, stack=stack, rngs=rngs, dtype=dt)
    self.w_kv_b = make_param(rngs, (Rkv, H * (Kn + V)), ("kv_lora", "kv_heads"), stack=stack, std=std, dtype=dt)
    self.w_o = make_param(rngs, (H * V, D), ("o_heads", "embed"), stack=stack, std=std, dtype=dt)

  def __call__(self, x_BTD, cos_BTk, sin_BTk, segment_ids_BT):
    """x [B,T,D]; cos/sin [B,T,Kr/2]; segment_ids [B,T] int (0 = padding; causal within a segment).

    Returns (out [B,T,D], max_logit [H] float32).
    """
    cfg, dt = self.cfg, x_BTD.dtype
    B, T, _ = x_BTD.shape
    H, Kn, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q_nope_BTHK, q_rope_BTHK = self.queries(x_BTD, cos_BTk, sin_BTk)
    c_BSR, k_rope_BSK = self.latent_and_rope_key(x_BTD, cos_BTk, sin_BTk)
    q_pos_BT = cp.query_positions(B, T)  # None unless the sequence is sharded (context parallelism)
    kv_seg_BS = None if q_pos_BT is None else gather_keys(segment_ids_BT)
    if q_pos_BT is not None and cfg.cp_gather == "latent":
      c_BSR, k_rope_BSK = gather_keys(c_BSR), gather_keys(k_rope_BSK)
    S = c_BSR.shape[1]
    kv_BSHK = (c_BSR @ self.w_kv_b[...].astype(dt)).reshape(B, S, H, Kn + V)
    k_nope_BSHK, v_BSHV = kv_BSHK[..., :Kn], kv_BSHK[..., Kn:]
    if q_pos_BT is not None and cfg.cp_gather == "heads":
      k_nope_BSHK, v_BSHV, k_rope_BSK = (gather_keys(a, heads=a.ndim == 4) for a in (k_nope_BSHK, v_BSHV, k_rope_BSK))
    impl = attention_impl(cfg.attention)
    args = (q_nope_BTHK, q_rope_BTHK, k_nope_BSHK, k_rope_BSK, v_BSHV, segment_ids_BT, self.scale)
    masks = dict(kv_segment_ids_BS=kv_seg_BS, q_positions_BT=q_pos_BT)
    if impl == "einsum":
      out_BTHV, max_logit_H = einsum_attention(*args, **masks)
    else:
      out_BTHV, max_logit_H = flash_mla_attention(*args, impl, **masks)
    out_BTD = out_BTHV.reshape(B, T, H * V) @ self.w_o[...].astype(dt)
    return out_BTD, max_logit_H

  def queries(self, x_BTD, cos_BTk, sin_BTk):
    """(q_nope [B,T,H,Kn], rotated q_rope [B,T,H,Kr]); shared with the KV-cached decode path."""
    cfg, dt = self.cfg, x_BTD.dtype
    B, T, _ = x_BTD.shape
    Kn, Kr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_BTR = self.q_norm(x_BTD @ self.w_q_a[...].astype(dt))
    q_BTHK = (q_BTR @ self.w_q_b[...].astype(dt)).reshape(B, T, cfg.num_attention_heads, Kn + Kr)
    return q_BTHK[..., :Kn], rope_lib.apply_rope(q_BTHK[..., Kn:], cos_BTk, sin_BTk, cfg.rope_interleave)

  def latent_and_rope_key(self, x_BTD, cos_BTk, sin_BTk):
    """(normalised kv latent [B,T,Rkv], rotated shared rope key [B,T,Kr]): what a KV cache stores."""
    cfg, Rkv = self.cfg, self.cfg.kv_lora_rank
    kv_a_BTR = x_BTD @ self.w_kv_a[...].astype(x_BTD.dtype)
    k_rope_BTK = rope_lib.apply_rope(kv_a_BTR[:, :, None, Rkv:], cos_BTk, sin_BTk, cfg.rope_interleave)[:, :, 0]
    return self.kv_norm(kv_a_BTR[..., :Rkv]), k_rope_BTK


def gather_keys(x_BS, heads: bool = False):
  """A key-side [B, S, ...] array gathered over the context axis, in natural order (for every device)."""
  names = ("act_batch", "act_kv_length") + (("act_heads", None) if heads else (None,) * (x_BS.ndim - 2))
  return cp.natural_keys(sharding_lib.constrain(x_BS, names))


def attention_mask(segment_ids_BT: jnp.ndarray, kv_segment_ids_BS=None, q_positions_BT=None) -> jnp.ndarray:
  """valid[b, t, s]: causal, same segment, and not padding (segment id 0). Without context parallelism
  queries and keys are the same tokens; with it (`q_positions`), query t is the token at key index
  q_positions[b, t] and the keys' segments are kv_segment_ids."""
  kv_seg_BS = segment_ids_BT if kv_segment_ids_BS is None else kv_segment_ids_BS
  T, S = segment_ids_BT.shape[1], kv_seg_BS.shape[1]
  if q_positions_BT is None:
    causal_BTS = jnp.tril(jnp.ones((T, S), bool))[None]
  else:
    causal_BTS = jnp.arange(S)[None, None, :] <= q_positions_BT[:, :, None]
  same_BTS = segment_ids_BT[:, :, None] == kv_seg_BS[:, None, :]
  return causal_BTS & same_BTS & (segment_ids_BT[:, :, None] > 0)


def einsum_attention(
  q_nope_BTHK,
  q_rope_BTHK,
  k_nope_BSHK,
  k_rope_BSK,
  v_BSHV,
  segment_ids_BT,
  scale,
  kv_segment_ids_BS=None,
  q_positions_BT=None,
):
  """Reference MLA attention with full [B,H,T,S] logits: (out [B,T,H,V], max_logit [H] float32)."""
  dt = v_BSHV.dtype
  logits_BHTS = (
    jnp.einsum("bthk,bshk->bhts", q_nope_BTHK, k_nope_BSHK, preferred_element_type=jnp.float32)
    + jnp.einsum("bthk,bsk->bhts", q_rope_BTHK, k_rope_BSK, preferred_element_type=jnp.float32)
  ) * scale
  valid_B1TS = attention_mask(segment_ids_BT, kv_segment_ids_BS, q_positions_BT)[:, None]
  max_logit_H = jnp.max(jnp.where(valid_B1TS, logits_BHTS, -jnp.inf), axis=(0, 2, 3))
  probs_BHTS = jax.nn.softmax(jnp.where(valid_B1TS, logits_BHTS, _NEG), axis=-1)
  # Rows with no valid key (padding) would average every value; zero them, as the flash kernel does.
  # Elsewhere masked probabilities are exp(-1e30 - max) == 0 already, so valid rows are unchanged.
  probs_BHTS = jnp.where(valid_B1TS, probs_BHTS, 0.0)
  out_BTHV = jnp.einsum("bhts,bshv->bthv", probs_BHTS.astype(dt), v_BSHV)
  return out_BTHV, max_logit_H


def flash_mla_attention(
  q_nope_BTHK,
  q_rope_BTHK,
  k_nope_BSHK,
  k_rope_BSK,
  v_BSHV,
  segment_ids_BT,
  scale,
  impl,
  kv_segment_ids_BS=None,
  q_positions_BT=None,
):
  """`einsum_attention` through the flash kernel (impl from `attention_impl`): same arguments and results."""
  # The shared rope key joins every head's key, so one qk dot per head gives both logit terms.
  q_BTHK = jnp.concatenate([q_nope_BTHK, q_rope_BTHK], axis=-1)
  H = q_nope_BTHK.shape[2]
  k_rope_BSHK = jnp.broadcast_to(k_rope_BSK[:, :, None], (*k_rope_BSK.shape[:2], H, k_rope_BSK.shape[-1]))
  k_BSHK = jnp.concatenate([k_nope_BSHK, k_rope_BSHK], axis=-1)
  return sharded_flash_attention(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, scale, impl, kv_segment_ids_BS, q_positions_BT)


IMPLS = ("einsum", "pallas", "pallas_interpret", "xla", "triton", "tokamax_xla")  # tokamax_xla: tests only


def attention_impl(kind: str) -> str:
  """`cfg.attention` -> one of IMPLS ('einsum', 'pallas', 'pallas_interpret', 'xla', 'triton') for the
  compile target's platform."""
  platform = sharding_lib.platform()
  if kind == "einsum" or (kind == "auto" and platform == "cpu"):
    return "einsum"
  if kind == "flash_xla":
    return "xla"
  if kind == "flash_triton":
    if platform != "gpu":
      raise ValueError(
        f"attention='flash_triton' is a GPU kernel, the compile target is {platform}; use 'flash' or 'flash_xla'"
      )
    return "triton"
  if kind not in ("auto", "flash"):
    raise ValueError(f"attention: one of ('auto', 'einsum', 'flash', 'flash_xla', 'flash_triton'), got {kind!r}")
  return {"tpu": "pallas", "gpu": "triton"}.get(platform, "pallas_interpret")


def sharded_flash_attention(
  q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, scale, impl, kv_segment_ids_BS=None, q_positions_BT=None
):
  """`flash_attention` per device under the active mesh: batch over the batch axes, heads over theirs,
  and under context parallelism the queries (with their positions) over the context axis while the keys
  are whole (gathered by the caller).

  impl: from `attention_impl` ('pallas', 'pallas_interpret', 'xla', 'triton'), or 'tokamax_xla' (tokamax's
  reference path, which runs on CPU: tests of the GPU wrapper). A Pallas kernel is opaque to XLA's
  partitioner (it would gather its operands), so with a multi-device mesh it runs under `shard_map`; the
  max logit is reduced with pmax over the batch shards and the context shards: every query row's max over
  all its keys is in the kernel's own running max, so the pmax gives the global per-head max exactly.
  """
  attend = _local_attention(impl, scale)
  ctx = sharding_lib.current()
  if q_positions_BT is None:
    masks, mask_names = (), ()
  else:
    masks, mask_names = (
      (kv_segment_ids_BS, q_positions_BT),
      (("act_batch", "act_kv_length"), ("act_batch", "act_length")),
    )

  def call(q, k, v, s, *m):
    kw = {} if not m else dict(kv_segment_ids_BS=m[0], q_positions_BT=m[1])
    return attend(q, k, v, s, **kw)

  if ctx is None:
    return call(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, *masks)
  spec = lambda names: sharding_lib.logical_to_spec(names, ctx.preset)  # noqa: E731
  q_spec, kv_spec = (
    spec(("act_batch", "act_length", "act_heads", None)),
    spec(("act_batch", "act_kv_length", "act_heads", None)),
  )
  seg = spec(("act_batch", "act_length"))
  mask_specs = tuple(spec(n) for n in mask_names)
  sizes = dict(ctx.mesh.shape)
  for name, x, sp in (
    ("q", q_BTHK, q_spec),
    ("k", k_BSHK, kv_spec),
    ("v", v_BSHV, kv_spec),
    ("segment_ids", segment_ids_BT, seg),
  ):
    sharding_lib.check_divisible(x.shape, sp, sizes, f"flash attention {name}")
  stat_axes = sharding_lib.spec_mesh_axes(q_spec[0]) + sharding_lib.spec_mesh_axes(q_spec[1])

  def local(q, k, v, s, *m):
    out, max_logit_H = call(q, k, v, s, *m)
    return out, jax.lax.pmax(max_logit_H, stat_axes) if stat_axes else max_logit_H

  return jax.shard_map(
    local,
    mesh=ctx.mesh,
    in_specs=(q_spec, kv_spec, kv_spec, seg, *mask_specs),
    out_specs=(q_spec, P(q_spec[2])),
    check_vma=False,
  )(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, *masks)


def _local_attention(impl, scale):
  """(q, k, v, segment_ids) -> (out, max_logit [H]) on one device's shard, for `impl`."""
  if impl in ("triton", "tokamax_xla"):
    implementation = "triton" if impl == "triton" else "xla"
    return functools.partial(attention_gpu.tokamax_attention, scale=scale, implementation=implementation)
  if impl not in ("pallas", "pallas_interpret", "xla"):
    raise ValueError(f"flash attention impl: one of {IMPLS[1:]}, got {impl!r}")
  kw = {"scale": scale, "impl": "xla" if impl == "xla" else "pallas", "interpret": impl == "pallas_interpret"}
  return functools.partial(flash_lib.flash_attention, **kw)
