"""K2 1T on a TPU slice by XLA's own numbers: compile `configs/k2.py:1t`'s train step for `v5p-1024`
(no TPU needed; Python >= 3.12 with `pip install -e '.[tpu]'`), wired as the slice is (v5p-1024: an
8x8x8 torus, `wrap=true,true,true` on the first line), in each variant and print, per variant,

  <variant>_peak_gib_per_device=  <variant>_temp_gib_per_device=  <variant>_fits=  <variant>_host_state_gib_per_device=
  <variant>_flops_per_device=     <variant>_a2a_bytes_per_device=  <variant>_planner_over_xla=
  <variant>_custom_call_flops_per_device= (Mosaic kernels' own estimates: ragged_dot, flash; k2jax.train.hlo_stats)

Variants are <attention>_<dispatch>: attention 'einsum' (the [B,H,T,S] float32 logits) or 'flash'
(where the model has `model.attention`), EP dispatch 'fixed' (worst-case buffers) or 'ragged'
(ragged_all_to_all, exact rows). a2a bytes = all-to-all + ragged-all-to-all bytes per device per
step. planner_over_xla = k2jax.memory.plan's total over XLA's peak. Peak = the device bytes XLA's buffer
assignment allocates (`aot.peak_bytes`; XLA:TPU's temp_size_in_bytes alone exceeds it). `1t` keeps its
optimizer state in host memory (`optim.offload_state`, host_state_gib_per_device); `--set
optim.offload_state=False` compiles it on the device. Layers are scanned, so the compile
costs about the same at any depth: full depth by default.

  python bench/aot.py                                   # all variants, 61 layers (tens of minutes)
  python bench/aot.py --variants=einsum_ragged --layers=4 --set=data.num_microbatches=64
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))

import k2  # noqa: E402

from k2jax.train import aot  # noqa: E402


def _config(attention: str, dispatch: str, layers: int, sets: list[str]):
  c = k2.get_config("1t")
  with c.unlocked():
    c.model.moe_dispatch = dispatch
    if "attention" in c.model:
      c.model.attention = attention
    elif attention != "einsum":
      raise SystemExit("this checkout's model has no `model.attention`: only einsum variants run")
    if layers:
      c.model.num_hidden_layers = layers
    for item in sets:
      key, value = item.split("=", 1)
      *path, name = key.split(".")
      node = c
      for p in path:
        node = node[p]
      if isinstance(node[name], bool):
        node[name] = {"true": True, "false": False}[value.lower()]
      else:
        node[name] = type(node[name])(value) if node[name] is not None else int(value)
  return c


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--slice", default="v5p-1024")
  ap.add_argument("--variants", default="einsum_fixed,einsum_ragged,flash_fixed,flash_ragged")
  ap.add_argument("--layers", type=int, default=0, help="num_hidden_layers (0: the preset's 61)")
  ap.add_argument("--set", action="append", default=[], help="extra config override key=value")
  args = ap.parse_args()
  why = aot.libtpu_available()
  if why:
    raise SystemExit(why)
  variants = args.variants.split(",")
  if "attention" not in k2.get_config("1t").model:
    skipped = [v for v in variants if v.startswith("flash")]
    variants = [v for v in variants if not v.startswith("flash")]
    if skipped:
      print(f"skipped={','.join(skipped)} (no model.attention in this checkout)")
  s = aot.tpu_slice(args.slice)
  wrap = ",".join(str(w).lower() for w in s.wrap)  # compiled as the slice is wired (aot.tpu_slice)
  print(
    f"slice={args.slice} topology={s.topology} wiring={s.wiring} wrap={wrap} layers={args.layers or 61} "
    f"overrides={','.join(args.set) or 'none'}",
    flush=True,
  )
  for v in variants:
    attention, dispatch = v.split("_")
    cfg = _config(attention, dispatch, args.layers, args.set)
    t0 = time.perf_counter()
    r = aot.compile_step(cfg, args.slice)
    a2a = r.get("all-to-all_bytes_per_device", 0) + r.get("ragged-all-to-all_bytes_per_device", 0)
    out = {
      "peak_gib_per_device": r["peak_gib_per_device"],
      "temp_gib_per_device": r.get("temp_gib_per_device", r.get("xla_required_temp_gib_per_device")),
      "host_state_gib_per_device": round(r["host_state_bytes_per_device"] / 2**30, 2),
      "fits": str(r["fits"]).lower(),
      "headroom_gib_per_device": r.get("headroom_gib_per_device", "n/a"),
      "flops_per_device": f"{r.get('flops_per_device', float('nan')):.4e}",
      "custom_call_flops_per_device": f"{r.get('custom_call_flops_per_device', float('nan')):.4e}",
      "a2a_bytes_per_device": a2a if "flops_per_device" in r else "n/a",
      "all_gather_bytes_per_device": r.get("all-gather_bytes_per_device", "n/a"),
      "reduce_scatter_bytes_per_device": r.get("reduce-scatter_bytes_per_device", "n/a"),
      "planner_over_xla": f"{aot.planner_over_xla(cfg, r):.3f}",
      "compile_s": round(time.perf_counter() - t0, 1),
    }
    for k, val in out.items():
      print(f"{v}_{k}={val}", flush=True)


if __name__ == "__main__":
  main()
