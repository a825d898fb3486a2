"""Accelerator settings in one place: XLA's GPU flags and the process-wide jax options kernels need.

XLA reads `XLA_FLAGS` once, when the first backend starts, so `configure()` runs in a launcher before
anything touches a device (`launch/train.py`, `bench/gpu.py`). It adds GPU_FLAGS (and, on meshes of
several GPUs, MULTI_GPU_FLAGS) to what the user already set — a flag the user set keeps the user's value —
and returns the flags it added, which the launcher prints with the run's config.

Each flag's effect on the `small` step has not been measured on a GPU yet (docs/results.md):
`bench/gpu.py` runs the step once with these flags and once without (`K2JAX_XLA_GPU_FLAGS=0`, a child
process, since XLA_FLAGS cannot change inside one) and prints `xla_flags_speedup=`. Every name is
checked against the installed XLA by tests/test_accel.py (an unknown name aborts XLA at startup).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import jax


@dataclasses.dataclass(frozen=True)
class Flag:
  flag: str  # --name=value
  why: str

  @property
  def name(self) -> str:
    return self.flag.split("=", 1)[0]


GPU_FLAGS = (
  Flag(
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "schedules copies and collectives to overlap compute (MaxText's and JAX's GPU performance guide default)",
  ),
  Flag(
    "--xla_gpu_enable_triton_gemm=false",
    "dense bf16 GEMMs by cuBLAS instead of XLA's own Triton GEMMs (MaxText's GPU default); "
    "the Pallas-Triton kernels (tokamax, moe_gemm) are custom calls and unaffected",
  ),
  Flag(
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "scan_layers: the next layer's loop iteration is unrolled by two so its inputs prefetch during this one",
  ),
)
MULTI_GPU_FLAGS = (
  Flag("--xla_gpu_all_reduce_combine_threshold_bytes=134217728", "combines small all-reduces (FSDP grads)"),
  Flag("--xla_gpu_all_gather_combine_threshold_bytes=134217728", "combines FSDP weight all-gathers per layer"),
  Flag("--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864", "combines FSDP gradient reduce-scatters"),
  Flag("--xla_gpu_enable_pipelined_all_gather=true", "overlaps the next layer's all-gather in scanned layers"),
  Flag("--xla_gpu_enable_pipelined_reduce_scatter=true", "overlaps the previous layer's reduce-scatter"),
  Flag("--xla_gpu_enable_pipelined_all_reduce=true", "overlaps all-reduces in scanned layers"),
)
ENV_SWITCH = "K2JAX_XLA_GPU_FLAGS"  # "0": add none (the bench's baseline)
_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def gpu_installed() -> bool:
  """Whether jax can start a CUDA backend here (a CUDA plugin is installed and JAX_PLATFORMS allows it)."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms and not any(p in platforms for p in ("cuda", "gpu")):
    return False
  return any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)


def configure(*, gpu: bool | None = None, multi_gpu: bool = False, moe_gemm: str = "auto") -> tuple[Flag, ...]:
  """Sets XLA_FLAGS (GPU only, before any backend starts) and jax options for `moe_gemm`; returns the
  flags added. `gpu=None`: when a CUDA plugin is installed."""
  if moe_gemm == "jax_triton":  # read when ragged_dot is lowered, for the whole program
    jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
  gpu = gpu_installed() if gpu is None else gpu
  if not gpu or os.environ.get(ENV_SWITCH, "1") == "0":
    return ()
  current = os.environ.get("XLA_FLAGS", "")
  user = {f.split("=", 1)[0] for f in current.split()}
  added = tuple(f for f in GPU_FLAGS + (MULTI_GPU_FLAGS if multi_gpu else ()) if f.name not in user)
  if added:
    if _backends_started():
      raise RuntimeError(
        "accel.configure: a jax backend has already started, so XLA_FLAGS can no longer change; call it in the "
        "launcher before anything touches a device"
      )
    os.environ["XLA_FLAGS"] = " ".join([current] + [f.flag for f in added]).strip()
  return added


def describe(flags: tuple[Flag, ...]) -> str:
  """One line for the run's printed config."""
  return "xla_gpu_flags=" + (",".join(f.flag for f in flags) if flags else "none")


def _backends_started() -> bool:
  from jax._src import xla_bridge  # private, but the only way to ask without starting one

  return bool(getattr(xla_bridge, "_backends", {}))
