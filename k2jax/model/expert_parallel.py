"""Expert parallelism: route token copies to the devices holding their experts, compute, come back.

Runs under `shard_map` over the whole mesh. Per device (tokens n = its batch shard, k picks each):

  1. sort the n*k copies by expert id; expert e lives on expert-rank e // E_loc (E_loc = E / ep);
  2. scatter the copies into a send buffer [ep, C, D], one fixed-size row block per destination;
  3. all-to-all over `expert`: receive [ep, C, D] copies (plus their local expert ids);
  4. dropless local compute: sort received rows by local expert, SwiGLU with `ragged_dot`;
  5. all-to-all back, gather each copy's result, weighted sum over the k picks.

Why fixed-size and not `jax.lax.ragged_all_to_all`: XLA:CPU does not implement ragged-all-to-all
("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU", jax 0.10.2), and the issue's tests run
on CPU. Dropless needs C = n * min(k, E_loc): one source can send every copy to one destination. The
padding overhead (sent rows / real rows, at most ep * min(k, E_loc) / k) is measured by
`padding_overhead` and reported by bench/moe.py.

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
from k2jax.model import experts as experts_lib


def ep_experts(ctx: sharding_lib.Context, x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Σ_k weights[n,k] · Expert_{idx[n,k]}(x[n]) with tokens sharded over the batch axes and experts
  over the `experts` rule's mesh axes. Same contract as `Experts.__call__` on the global arrays."""
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
  w_in, w_out = P(ep_name, None, tp), P(ep_name, tp, None)
  fn = functools.partial(_local_moe, ep_axis=ep_name, ep=ep, tp_axis=tp)
  return jax.shard_map(fn, mesh=ctx.mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out), out_specs=tok)(
    x_ND, weights_Nk, idx_Nk, w_gate_EDF, w_up_EDF, w_down_EFD
  )


def send_capacity(n_local: int, k: int, experts_per_device: int) -> int:
  """Rows per destination in the fixed-size buffer: the dropless worst case."""
  return n_local * min(k, experts_per_device)


def padding_overhead(n_local: int, k: int, experts_per_device: int, ep: int) -> float:
  """Rows sent per all-to-all (ep * C) over real token copies (n * k)."""
  return ep * send_capacity(n_local, k, experts_per_device) / (n_local * k)


def _local_moe(x_nD, weights_nk, idx_nk, w_gate, w_up, w_down, *, ep_axis, ep: int, tp_axis):
  n, k = idx_nk.shape
  D, El = x_nD.shape[1], w_gate.shape[0]
  if ep == 1:
    y_nD = experts_lib.dispatch_compute_combine(x_nD, weights_nk, idx_nk, w_gate, w_up, w_down)
  else:
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
    y_rows_RD = _grouped_ffn(recv_PCD.reshape(ep * C, D), rid_PC.reshape(-1), El, w_gate, w_up, w_down)
    back_PCD = jax.lax.all_to_all(y_rows_RD.reshape(ep, C, D), ep_axis, 0, 0, tiled=True)
    y_sorted_MD = back_PCD[dest_M, slot_M]
    y_nD = experts_lib.combine(y_sorted_MD, order_M, weights_nk, n, k)
  if tp_axis is not None:
    # Each tensor rank summed over its F/tp slice of the down-projection: add the partial sums.
    y_nD = jax.lax.psum(y_nD, tp_axis)
  return y_nD


def _grouped_ffn(rows_RD, eid_R, num_local: int, w_gate, w_up, w_down):
  """SwiGLU of each received row by its local expert; padding rows (id == num_local) sort last,
  fall outside every ragged_dot group and are never read back."""
  order_R = jnp.argsort(eid_R, stable=True)
  sizes_E = jnp.bincount(eid_R, length=num_local).astype(jnp.int32)  # drops the padding id
  y_sorted_RD = experts_lib.expert_ffn(jnp.take(rows_RD, order_R, axis=0), sizes_E, w_gate, w_up, w_down)
  return jnp.zeros_like(y_sorted_RD).at[order_R].set(y_sorted_RD, unique_indices=True)


def expected_padding_overhead(cfg, ctx: sharding_lib.Context, tokens_global: int) -> float:
  """padding_overhead for a model config and mesh context at a global token count."""
  n_local = tokens_global // ctx.axis_size("act_batch")
  ep = ctx.axis_size("experts")
  return padding_overhead(n_local, cfg.num_experts_per_tok, cfg.n_routed_experts // ep, ep)
