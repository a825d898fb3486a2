"""Dropless MoE dispatch: sort token copies by expert, grouped SwiGLU, combine; across devices by
all-to-all. Owns every dispatch path (`experts.Experts` only holds the weights).

One device (no multi-device mesh active): sort the N*k copies by expert id, run `ragged_dot` over the
contiguous groups, undo the sort, weighted sum. On CPU the four steps are one fused op
(`moe_cpu.moe_swiglu`: rows gathered once into an expert-sorted stack and combined once).

Expert parallelism runs under `shard_map` over the whole mesh. Per device (tokens n = its batch
shard, k picks each, E_loc = E / ep experts per expert-rank):

  1. sort the n*k copies by expert id: expert e lives on expert-rank e // E_loc, so the copies are
     grouped by destination;
  2. send them to the experts' devices (all-to-all over `expert`), in one of two ways:
     ragged  `jax.lax.ragged_all_to_all` sends exactly the routed rows. The per-expert counts are
             exchanged first (all_gather of [E] int32 per device, as MaxText does), giving every
             device the [ep, ep] matrix of rows each source sends each destination, hence the
             offsets and sizes of both trips (`ragged_plan`). TPU and GPU;
     fixed   a send buffer [ep, C, D] with one fixed-size row block per destination, C = n*min(k,
             E_loc) (dropless: one source may send all its copies to one destination), and
             `jax.lax.all_to_all`. XLA:CPU has no ragged-all-to-all ("HLO opcode
             `ragged-all-to-all` is not supported by XLA:CPU"), so CPU keeps this path;
  3. dropless local compute: sort received rows by local expert, SwiGLU with grouped matmuls;
  4. the same collective back, undo the sort, weighted sum over the k picks.

Rows sent over real rows: ragged 1; fixed ep * min(k, E_loc) / k (`padding_overhead`). Either way
the receiving buffer holds the dropless worst case, ep * C rows.

With `expert_mlp` over `tensor` (fsdp_ep_tp) each tensor rank holds a slice F/tp of every local
expert; the down-projection then yields partial sums, reduced by one psum over `tensor`. When
experts are not sharded (preset `fsdp`), ep = 1 and no all-to-all is emitted: each device dispatches
its own tokens over all (fsdp-gathered) experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k2jax import sharding as sharding_lib
from k2jax.model import moe_cpu, moe_gemm

RAGGED_PLATFORMS = ("tpu", "gpu")  # XLA backends with ragged-all-to-all
FUSED_CPU = True  # one device's MoE on CPU through moe_cpu.moe_swiglu (tests compare it with False)
CHECK_VMA = True  # shard_map's varying-axes checks where the grouped GEMM allows them (tests set False)


def routed_experts(
  x_ND,
  weights_Nk,
  idx_Nk,
  w_gate_EDF,
  w_up_EDF,
  w_down_EFD,
  *,
  dispatch: str = "auto",
  chunk_tokens: int = 0,
  gemm: str = "auto",
):
  """Σ_k weights[n,k] · Expert_{idx[n,k]}(x[n]): on one device, or by expert parallelism when a
  multi-device mesh is active (`sharding.use`). `dispatch`: 'auto' | 'fixed' | 'ragged';
  `chunk_tokens`: expert parallelism takes each device's tokens in chunks of at most this many (0: all);
  `gemm`: the grouped GEMM (`moe_gemm.IMPLS`)."""
  moe_gemm.resolve(gemm)  # a kernel the compile target lacks fails here, before any tracing
  ctx = sharding_lib.current()
  if ctx is None:
    return dispatch_compute_combine(x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, gemm=gemm)
  return ep_experts(
    ctx,
    x_ND,
    weights_Nk,
    idx_Nk,
    w_gate_EDF,
    w_up_EDF,
    w_down_EFD,
    ragged=use_ragged(dispatch),
    chunk_tokens=chunk_tokens,
    gemm=gemm,
  )


def use_ragged(dispatch: str) -> bool:
  """Whether `dispatch` means ragged_all_to_all on the compile target (the active mesh's platform)."""
  if dispatch not in ("auto", "fixed", "ragged"):
    raise ValueError(f"moe_dispatch: one of ('auto', 'fixed', 'ragged'), got {dispatch!r}")
  return dispatch == "ragged" or (dispatch == "auto" and sharding_lib.platform() in RAGGED_PLATFORMS)


# ------------------------------------------------------------------------------ one device's experts
def dispatch_compute_combine(x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD, *, gemm: str = "auto"):
  """The whole dropless MoE on one device's tokens and experts: sort, grouped SwiGLU, combine.
  With the CPU kernel (`gemm` resolving to 'tiled' on CPU) the three steps are fused
  (`moe_cpu.moe_swiglu`: rows move once each way)."""
  if FUSED_CPU and sharding_lib.platform() == "cpu" and moe_gemm.resolve(gemm) == "tiled":
    return moe_cpu.moe_swiglu(x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD)
  N, k = idx_Nk.shape
  x_sorted_MD, order_M, group_sizes_E = sort_by_expert(x_ND, idx_Nk, w_gate_EDF.shape[0])
  y_sorted_MD = expert_ffn(x_sorted_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, gemm=gemm)
  return combine(y_sorted_MD, order_M, weights_Nk, N, k)


def sort_by_expert(x_ND, idx_Nk, num_experts: int):
  """Token copies sorted by expert id: (x_sorted [N*k, D], order [N*k], group_sizes [E])."""
  k = idx_Nk.shape[1]
  flat_M = idx_Nk.reshape(-1)
  order_M = jnp.argsort(flat_M, stable=True)
  group_sizes_E = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
  return jnp.take(x_ND, order_M // k, axis=0), order_M, group_sizes_E


def expert_ffn(x_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, *, gemm: str = "auto"):
  """SwiGLU per contiguous expert group with grouped matmuls (`moe_gemm.grouped_dot`)."""
  dt = x_MD.dtype
  dot = moe_gemm.grouped_dot
  g_MF = dot(x_MD, w_gate_EDF.astype(dt), group_sizes_E, gemm)
  u_MF = dot(x_MD, w_up_EDF.astype(dt), group_sizes_E, gemm)
  return dot(jax.nn.silu(g_MF) * u_MF, w_down_EFD.astype(dt), group_sizes_E, gemm)


def combine(y_sorted_MD, order_M, weights_Nk, N: int, k: int):
  """Undo the sort and take the weighted sum over each token's k experts."""
  y_MD = jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD, unique_indices=True)
  y_NkD = y_MD.reshape(N, k, -1)
  return jnp.einsum("nkd,nk->nd", y_NkD, weights_Nk.astype(y_NkD.dtype))


# --------------------------------------------------------------------------------- expert parallel
def ep_experts(
  ctx: sharding_lib.Context,
  x_ND,
  weights_Nk,
  idx_Nk,
  w_gate_EDF,
  w_up_EDF,
  w_down_EFD,
  *,
  ragged: bool = False,
  chunk_tokens: int = 0,
  gemm: str = "auto",
):
  """Σ_k weights[n,k] · Expert_{idx[n,k]}(x[n]) with tokens sharded over the batch axes and experts
  over the `experts` rule's mesh axes. Same contract as `routed_experts` on the global arrays.

  `chunk_tokens` > 0 runs each device's n tokens in `num_chunks(n, chunk_tokens)` sequential chunks, each
  rematerialised in the backward pass (only the chunk's inputs are saved): every dispatch buffer is
  sized by the chunk's tokens, so the dropless worst case shrinks by the chunk count (K2 at EP 8 with
  4096 tokens per device: 262144 received rows, 3.5 GiB in bf16, per buffer unchunked). Each token's
  output is unchanged; the weight gradients are summed over chunks (in the weights' compute dtype)."""
  N, k = idx_Nk.shape
  E = w_gate_EDF.shape[0]
  batch_spec = sharding_lib.logical_to_spec(("act_batch",), ctx.preset)
  ep_axes = ctx.rules["experts"] or ()
  tp_axes = ctx.rules["expert_mlp"] or ()
  ep, n_shards = ctx.axis_size("experts"), ctx.axis_size("act_batch")
  if E % ep:
    raise sharding_lib.ShardingError(
      f"n_routed_experts={E} is not divisible by the expert mesh axes {ep_axes} of size {ep}"
    )
  if N % n_shards:
    raise sharding_lib.ShardingError(
      f"MoE tokens: batch*length={N} is not divisible by the batch mesh axes {batch_spec[0]} of "
      f"size {n_shards}; use a global batch that is a multiple of {n_shards}"
    )
  tok, tp = P(batch_spec[0], None), (tp_axes[0] if len(tp_axes) == 1 else tp_axes or None)
  ep_name = ep_axes[0] if len(ep_axes) == 1 else (ep_axes or None)
  # The weights' `embed` shards (FSDP) are all-gathered inside shard_map, so the transpose is a
  # reduce-scatter: the weight gradient leaves as this device's shard. (Gathered by the partitioner
  # before shard_map, the gradient was all-reduced at full size, then sliced.)
  fsdp = sharding_lib.logical_to_spec(("experts", "embed", "expert_mlp"), ctx.preset)[1]
  w_in, w_out = P(ep_name, fsdp, tp), P(ep_name, tp, fsdp)
  chunks = num_chunks(N // n_shards, chunk_tokens)
  fn = functools.partial(
    _local_moe, ep_axis=ep_name, ep=ep, tp_axis=tp, ragged=ragged, chunks=chunks, fsdp_axis=fsdp, gemm=gemm
  )
  # Cast to the compute dtype before the fsdp shards are gathered: the all-gather, the gathered copy and
  # the weight gradients' reduce-scatter are then bf16, not float32 (K2: 4.2 GB instead of 8.4 GB per
  # MoE layer and device at EP 8).
  dt = x_ND.dtype
  weights = (w_gate_EDF.astype(dt), w_up_EDF.astype(dt), w_down_EFD.astype(dt))
  # Pallas kernels (tokamax's) build outputs without shard_map's varying-axes types, so their shard_map runs
  # with check_vma=False, as MaxText's does: jax then transposes every input by a psum over the mesh axes its
  # spec leaves out (tests/sharding compare both settings' gradients with the unsharded ones).
  # Inside pipeline stages (a vmap over the `stage` mesh axis, k2jax/model/pipeline.py) jax 0.12's ragged_dot
  # rule casts its operands to varying over every mesh axis, `stage` included, which the vmap already made
  # them vary over (ValueError in pvary lowering 1t_pipeline for v5p-1024): those run unchecked too.
  check_vma = CHECK_VMA and moe_gemm.resolve(gemm) not in moe_gemm.PALLAS and not moe_gemm.staged()
  specs = dict(in_specs=(tok, tok, tok, w_in, w_in, w_out), out_specs=tok, check_vma=check_vma)
  return jax.shard_map(fn, mesh=ctx.mesh, **specs)(x_ND, weights_Nk, idx_Nk, *weights)


def num_chunks(n_local: int, chunk_tokens: int) -> int:
  """Chunks of at most `chunk_tokens` tokens that split `n_local` evenly (1 when chunk_tokens <= 0)."""
  if chunk_tokens <= 0 or n_local <= chunk_tokens:
    return 1
  c = -(-n_local // chunk_tokens)
  while n_local % c:
    c += 1
  return c


def send_capacity(n_local: int, k: int, experts_per_device: int) -> int:
  """Rows per destination in the fixed-size buffer (and per source in the receive buffer): the
  dropless worst case."""
  return n_local * min(k, experts_per_device)


def padding_overhead(n_local: int, k: int, experts_per_device: int, ep: int) -> float:
  """Fixed path: rows sent per all-to-all (ep * C) over real token copies (n * k). Ragged: 1."""
  return ep * send_capacity(n_local, k, experts_per_device) / (n_local * k)


def _local_moe(
  x_nD,
  weights_nk,
  idx_nk,
  w_gate,
  w_up,
  w_down,
  *,
  ep_axis,
  ep: int,
  tp_axis,
  ragged: bool,
  chunks=1,
  fsdp_axis=None,
  gemm: str = "auto",
):
  if fsdp_axis is not None:  # [E_loc, D/f, F] shards -> [E_loc, D, F] (w_down: [E_loc, F, D])
    w_gate = jax.lax.all_gather(w_gate, fsdp_axis, axis=1, tiled=True)
    w_up = jax.lax.all_gather(w_up, fsdp_axis, axis=1, tiled=True)
    w_down = jax.lax.all_gather(w_down, fsdp_axis, axis=2, tiled=True)
  if chunks > 1:
    one = functools.partial(_local_moe, ep_axis=ep_axis, ep=ep, tp_axis=tp_axis, ragged=ragged, gemm=gemm)
    body = jax.checkpoint(lambda xs: one(*xs, w_gate, w_up, w_down), policy=jax.checkpoint_policies.nothing_saveable)
    split = lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:])  # noqa: E731
    y_cnD = jax.lax.map(body, (split(x_nD), split(weights_nk), split(idx_nk)))
    return y_cnD.reshape(x_nD.shape)
  n, k = idx_nk.shape
  if ep == 1:
    y_nD = dispatch_compute_combine(x_nD, weights_nk, idx_nk, w_gate, w_up, w_down, gemm=gemm)
  elif ragged:
    y_nD = _ragged_moe(x_nD, weights_nk, idx_nk, w_gate, w_up, w_down, ep_axis=ep_axis, ep=ep, gemm=gemm)
  else:
    y_nD = _fixed_moe(x_nD, weights_nk, idx_nk, w_gate, w_up, w_down, ep_axis=ep_axis, ep=ep, gemm=gemm)
  if tp_axis is not None:
    # Each tensor rank summed over its F/tp slice of the down-projection: add the partial sums.
    y_nD = jax.lax.psum(y_nD, tp_axis)
  return y_nD


def _fixed_moe(x_nD, weights_nk, idx_nk, w_gate, w_up, w_down, *, ep_axis, ep: int, gemm: str):
  n, k = idx_nk.shape
  D, El = x_nD.shape[1], w_gate.shape[0]
  C = send_capacity(n, k, El)
  flat_M = idx_nk.reshape(-1)
  order_M = jnp.argsort(flat_M, stable=True)
  e_M = flat_M[order_M]
  dest_M = e_M // El
  send_E = jnp.bincount(dest_M, length=ep)
  slot_M = jnp.arange(n * k) - (jnp.cumsum(send_E) - send_E)[dest_M]
  x_M = jnp.take(x_nD, order_M // k, axis=0)
  send_PCD = jnp.zeros((ep, C, D), x_nD.dtype).at[dest_M, slot_M].set(x_M, unique_indices=True)
  # Local expert id per row; El marks an empty (padding) row.
  eid_PC = jnp.full((ep, C), El, jnp.int32).at[dest_M, slot_M].set(e_M % El, unique_indices=True)
  recv_PCD = jax.lax.all_to_all(send_PCD, ep_axis, 0, 0, tiled=True)
  rid_PC = jax.lax.all_to_all(eid_PC, ep_axis, 0, 0, tiled=True)
  y_rows_RD = _grouped_ffn(recv_PCD.reshape(ep * C, D), rid_PC.reshape(-1), El, w_gate, w_up, w_down, gemm)
  back_PCD = jax.lax.all_to_all(y_rows_RD.reshape(ep, C, D), ep_axis, 0, 0, tiled=True)
  y_sorted_MD = back_PCD[dest_M, slot_M]
  return combine(y_sorted_MD, order_M, weights_nk, n, k)


def _ragged_moe(x_nD, weights_nk, idx_nk, w_gate, w_up, w_down, *, ep_axis, ep: int, gemm: str):
  n, k = idx_nk.shape
  D, El = x_nD.shape[1], w_gate.shape[0]
  R = ep * send_capacity(n, k, El)  # receive buffer: the dropless worst case
  x_sorted_MD, order_M, counts_E = sort_by_expert(x_nD, idx_nk, El * ep)
  counts_PE = jax.lax.all_gather(counts_E, ep_axis)  # [source rank, global expert]
  me = jax.lax.axis_index(ep_axis)
  go, back = ragged_plan(counts_PE, me, ep)
  recv_RD = jax.lax.ragged_all_to_all(x_sorted_MD, jnp.zeros((R, D), x_nD.dtype), *go, axis_name=ep_axis)
  eid_R = received_expert_ids(counts_PE, me, El, R)
  y_RD = _grouped_ffn(recv_RD, eid_R, El, w_gate, w_up, w_down, gemm)
  y_sorted_MD = jax.lax.ragged_all_to_all(y_RD, jnp.zeros((n * k, D), y_RD.dtype), *back, axis_name=ep_axis)
  return combine(y_sorted_MD, order_M, weights_nk, n, k)


def _exclusive_cumsum(x, axis: int):
  return jnp.cumsum(x, axis=axis) - x


def ragged_plan(counts_PE, me, ep: int):
  """`ragged_all_to_all` arguments (input_offsets, send_sizes, output_offsets, recv_sizes) of rank
  `me`, for the trip to the experts and the trip back.

  counts_PE [ep, E]: copies each source rank routes to each global expert (its rows are sorted by
  expert, so the rows for destination j are one contiguous block). S[i, j] = rows i sends j.
    to the experts:  rank me sends S[me, j] rows from offset Σ_{j'<j} S[me, j'] to rank j, landing at
                     Σ_{i<me} S[i, j] in j's receive buffer (sources in rank order); receives S[i, me]
    back:            rank me returns the S[i, me] rows it got from i (at Σ_{i'<i} S[i', me]) to the
                     offset they left from, Σ_{j<me} S[i, j]; receives S[me, j] from each j
  """
  S_PP = counts_PE.reshape(ep, ep, -1).sum(-1).astype(jnp.int32)
  send_P, recv_P = S_PP[me], S_PP[:, me]
  go = (_exclusive_cumsum(send_P, 0), send_P, _exclusive_cumsum(S_PP, 0)[me], recv_P)
  back = (_exclusive_cumsum(recv_P, 0), recv_P, _exclusive_cumsum(S_PP, 1)[:, me], send_P)
  return go, back


def received_expert_ids(counts_PE, me, experts_per_rank: int, rows: int):
  """Local expert id of each row of rank `me`'s receive buffer (`rows` long); `experts_per_rank`
  marks the unused tail. Rows arrive source by source, each source's rows sorted by expert."""
  El = experts_per_rank
  ep = counts_PE.shape[0]
  local_PL = jax.lax.dynamic_slice_in_dim(counts_PE, me * El, El, axis=1)
  ends_S = jnp.cumsum(local_PL.reshape(-1))  # segment (source, local expert) s ends at row ends[s]
  # Unrolled: the same log2(S) bisection steps, no while loop (XLA:CPU compiled the loop's body as unfused ops:
  # tests/rl/test_rl_mesh.py 147 -> 128 CPU-s with this and grouped_matmul's two searches unrolled).
  seg_R = jnp.searchsorted(ends_S, jnp.arange(rows), side="right", method="scan_unrolled")
  return jnp.where(seg_R < ep * El, seg_R % El, El).astype(jnp.int32)


def _grouped_ffn(rows_RD, eid_R, num_local: int, w_gate, w_up, w_down, gemm: str):
  """SwiGLU of each received row by its local expert; padding rows (id == num_local) sort last,
  fall outside every grouped-matmul group and are never read back."""
  order_R = jnp.argsort(eid_R, stable=True)
  sizes_E = jnp.bincount(eid_R, length=num_local).astype(jnp.int32)  # drops the padding id
  y_sorted_RD = expert_ffn(jnp.take(rows_RD, order_R, axis=0), sizes_E, w_gate, w_up, w_down, gemm=gemm)
  return jnp.zeros_like(y_sorted_RD).at[order_R].set(y_sorted_RD, unique_indices=True)


def expected_padding_overhead(cfg, ctx: sharding_lib.Context, tokens_global: int) -> float:
  """padding_overhead for a model config and mesh context at a global token count."""
  n_local = tokens_global // ctx.axis_size("act_batch")
  ep = ctx.axis_size("experts")
  return padding_overhead(n_local, cfg.num_experts_per_tok, cfg.n_routed_experts // ep, ep)
