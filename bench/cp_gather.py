"""What MLA gathers under context parallelism, by the lowered HLO of one K2 MLA layer (forward + backward).

Compiles (does not run) one MLA layer at K2's dims (`1t` preset: 64 heads, latent 512, rope 64, bf16) on
fake CPU devices under the `fsdp_cp` preset with the sequence over `c` context shards, once per
`cp_gather` ('latent': the compressed latent + shared rope key; 'heads': per-head k_nope, v + the rope key),
and prints per layer and per gathered token:

  <gather>_all_gather_bytes_per_token=   bytes the forward all-gather delivers to a device, per token of
                                         the whole sequence (the backward returns the same as gradients)
  <gather>_matmul_flops_per_device=      XLA dots of the layer's fwd+bwd on one device
  latent_over_heads_bytes=  latent_over_heads_flops=

  python bench/cp_gather.py                      # S = 4096, c = 8 (bytes per token do not depend on S)
  python bench/cp_gather.py --seq=8192 --cp=4
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--cp", type=int, default=8)
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cp}"
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from k2jax import sharding
  from k2jax.model import mla, presets
  from k2jax.train import hlo_stats

  stats = {}
  for gather in ("latent", "heads"):
    cfg = presets.get("1t", cp_gather=gather, compute_dtype="bfloat16", param_dtype="bfloat16", attention="einsum")
    graphdef, state = nnx.split(nnx.eval_shape(lambda cfg=cfg: mla.MLA(cfg, stack=None, rngs=nnx.Rngs(0))))
    mesh = sharding.make_mesh({"expert": args.cp})
    spec = sharding.batch_sharding(mesh, "fsdp_cp", ndim=3)
    S, k = args.seq, cfg.qk_rope_head_dim // 2
    x = jax.ShapeDtypeStruct((1, S, cfg.hidden_size), jnp.bfloat16, sharding=spec)
    cs = jax.ShapeDtypeStruct((1, S, k), jnp.float32, sharding=spec)
    seg = jax.ShapeDtypeStruct((1, S), jnp.int32, sharding=sharding.batch_sharding(mesh, "fsdp_cp"))
    rep = NamedSharding(mesh, P())
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), state)

    def loss(state, x, cos, sin, seg, graphdef=graphdef):
      out, _ = nnx.merge(graphdef, state)(x, cos, sin, seg)
      return jnp.sum(out.astype(jnp.float32))

    with sharding.use(mesh, "fsdp_cp"):
      text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x, cs, cs, seg).compile().as_text()
    s = hlo_stats.hlo_stats(text)
    # The gathered result counts S tokens; the segment ids (4 bytes per token) ride along on both paths.
    per_token = (s["all-gather_bytes"] - 4 * S) / S
    stats[gather] = (per_token, s["matmul_flops"])
    print(f"{gather}_all_gather_bytes_per_token={per_token:.0f}")
    print(f"{gather}_matmul_flops_per_device={s['matmul_flops']:.4e}")
  print(f"latent_over_heads_bytes={stats['latent'][0] / stats['heads'][0]:.4f}")
  print(f"latent_over_heads_flops={stats['latent'][1] / stats['heads'][1]:.4f}")
  print(f"seq={args.seq} cp={args.cp} jax={jax.__version__} backend=cpu (compiled, not run)")


if __name__ == "__main__":
  main()
