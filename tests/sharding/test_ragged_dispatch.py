"""Ragged expert-parallel dispatch on CPU: the offsets/sizes against a numpy model of
`ragged_all_to_all`, and the whole ragged EP path (with the collective emulated from all_gather,
since XLA:CPU has no ragged-all-to-all) against the single-device MoE, values and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k2jax import sharding
from k2jax.model import expert_parallel as ep_lib


def _np_ragged_all_to_all(operands, outputs, go):
  """ragged_all_to_all's documented semantics, one list entry per rank (all numpy)."""
  in_off, send, out_off, recv = go
  results = [o.copy() for o in outputs]
  ep = len(operands)
  for src in range(ep):
    for dst in range(ep):
      s = send[src][dst]
      assert s == recv[dst][src], "send_sizes and recv_sizes disagree"
      results[dst][out_off[src][dst] : out_off[src][dst] + s] = operands[src][in_off[src][dst] : in_off[src][dst] + s]
  return results


@pytest.mark.parametrize("seed,skew", [(0, False), (1, True)])
def test_ragged_plan_routes_every_copy_to_its_expert_and_back(seed, skew):
  ep, El, n, k = 4, 3, 6, 2
  E = ep * El
  rng = np.random.default_rng(seed)
  idx = np.stack([rng.permutation(E)[:k] for _ in range(ep * n)]).reshape(ep, n, k)
  if skew:  # rank 0 sends every copy to rank 2's experts; rank 3 holds experts nobody picks
    idx[0] = np.stack([rng.permutation(np.arange(2 * El, 3 * El))[:k] for _ in range(n)])
    idx[idx >= 3 * El] -= El
  flat = idx.reshape(ep, n * k)
  order = np.argsort(flat, axis=1, kind="stable")
  counts = np.stack([np.bincount(f, minlength=E) for f in flat]).astype(np.int32)
  plans = [jax.device_get(ep_lib.ragged_plan(jnp.asarray(counts), me, ep)) for me in range(ep)]
  go = [[np.asarray(p[0][i]) for p in plans] for i in range(4)]
  back = [[np.asarray(p[1][i]) for p in plans] for i in range(4)]
  R = ep * ep_lib.send_capacity(n, k, El)
  # Payload of a sorted copy: (global expert, source rank, position in the source's sorted rows).
  payload = [np.stack([flat[r][order[r]], np.full(n * k, r), np.arange(n * k)], 1) for r in range(ep)]
  recv = _np_ragged_all_to_all(payload, [np.full((R, 3), -1) for _ in range(ep)], go)
  for dst in range(ep):
    eid = np.asarray(ep_lib.received_expert_ids(jnp.asarray(counts), dst, El, R))
    got = int(np.sum(counts[:, dst * El : (dst + 1) * El]))
    assert got <= R
    rows = recv[dst][:got]
    assert (rows[:, 0] // El == dst).all()  # every received copy is for one of this rank's experts
    np.testing.assert_array_equal(eid[:got], rows[:, 0] % El)
    assert (eid[got:] == El).all() and (recv[dst][got:] == -1).all()
    want = sorted((s, p) for s in range(ep) for p in range(n * k) if payload[s][p, 0] // El == dst)
    assert sorted(map(tuple, rows[:, 1:].tolist())) == want
  # The trip back returns each row to the slot it left from.
  returned = _np_ragged_all_to_all(recv, [np.full((n * k, 3), -1) for _ in range(ep)], back)
  for r in range(ep):
    np.testing.assert_array_equal(returned[r], payload[r])


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """ragged_all_to_all from all_gather (differentiable, runs on XLA:CPU)."""
  me = jax.lax.axis_index(axis_name)
  ops = jax.lax.all_gather(operand, axis_name)
  in_off, sizes, out_off = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
  rows = jnp.arange(output.shape[0])
  result = output
  for src in range(ops.shape[0]):
    start, size, at = in_off[src, me], sizes[src, me], out_off[src, me]
    inside = (rows >= at) & (rows < at + size)
    taken = jnp.take(ops[src], jnp.clip(rows - at + start, 0, operand.shape[0] - 1), axis=0)
    result = jnp.where(inside[:, None], taken, result)
  return result


@pytest.mark.parametrize(
  "ragged,chunk_tokens,mesh_shape,check_vma",
  [
    (True, 0, {"data": 2, "expert": 4}, True),
    (True, 4, {"data": 2, "expert": 4}, True),
    (False, 4, {"fsdp": 2, "expert": 4}, True),
    # As with a Pallas grouped GEMM (tokamax): shard_map without varying-axes types, jax's transposes
    # (the data-replicated and the fsdp-gathered weights' cotangents) must still be the unsharded ones.
    (True, 0, {"data": 2, "expert": 4}, False),
    (False, 4, {"fsdp": 2, "expert": 4}, False),
  ],
)
def test_ragged_ep_matches_single_device_values_and_gradients(monkeypatch, ragged, chunk_tokens, mesh_shape, check_vma):
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
  monkeypatch.setattr(ep_lib, "CHECK_VMA", check_vma)
  N, D, F, E, k = 64, 16, 8, 16, 2
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
  w = jnp.asarray(rng.random((N, k)), jnp.float32)
  idx = np.stack([rng.permutation(E)[:k] for _ in range(N)])
  idx[: N // 2] = idx[: N // 2] % 4  # half the tokens pick rank 0's experts: uneven sizes
  idx = jnp.asarray(idx, jnp.int32)
  weights = [jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]

  def loss(fn, x, *ws):
    y = fn(x, w, idx, *ws)
    return jnp.sum(y * jnp.cos(y)), y

  grad = lambda fn: jax.jit(jax.value_and_grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3), has_aux=True))  # noqa: E731
  (_, y0), g0 = grad(ep_lib.dispatch_compute_combine)(x, *weights)
  mesh = sharding.make_mesh(mesh_shape)  # fsdp 2: the expert weights' D shards are gathered in shard_map
  with sharding.use(mesh, "fsdp_ep"):
    ctx = sharding.current()
    fn = functools.partial(ep_lib.ep_experts, ctx, ragged=ragged, chunk_tokens=chunk_tokens)
    hlo = jax.jit(fn).lower(x, w, idx, *weights).as_text()
    (_, y1), g1 = grad(fn)(x, *weights)
  assert ragged == ("all_to_all" not in hlo and "all-to-all" not in hlo)  # ragged: no fixed-size buffer
  assert ep_lib.num_chunks(8, chunk_tokens) == (2 if chunk_tokens else 1)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
  for a, b in zip(g1, g0):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_dispatch_choice_follows_the_compile_target():
  assert not ep_lib.use_ragged("auto")  # CPU: fixed-size buffers
  assert ep_lib.use_ragged("ragged") and not ep_lib.use_ragged("fixed")
  with pytest.raises(ValueError, match="moe_dispatch: one of"):
    ep_lib.use_ragged("dense")
  # Rows sent over real rows: fixed pays the dropless worst case, ragged sends the routed rows.
  assert ep_lib.padding_overhead(4096, 8, 48, 8) == 8.0
