"""k2jax/accel.py: XLA's GPU flags set in one place, every name known to the installed XLA; and
`bench/gpu.py --smoke` (the accelerator bench's own code on CPU, so it keeps working between GPU runs)."""

import os
import re
import subprocess
import sys

import pytest

from k2jax import accel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_flag_is_known_to_this_xla():
  """An unknown name in XLA_FLAGS aborts XLA at startup: the whole set must parse (GPU flags parse on a CPU
  jaxlib too, one DebugOptions for all backends); a misspelt one is caught, so the check is not vacuous."""
  flags = " ".join(f.flag for f in accel.GPU_FLAGS + accel.MULTI_GPU_FLAGS)
  code = "import jax; print(len(jax.devices()))"
  ok = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, XLA_FLAGS=flags), capture_output=True)
  assert ok.returncode == 0, ok.stderr.decode()[-800:]
  bad = subprocess.run(
    [sys.executable, "-c", code],
    env=dict(os.environ, XLA_FLAGS="--xla_gpu_enable_latency_hiding_schedulr=true"),
    capture_output=True,
  )
  assert bad.returncode != 0


def test_configure_adds_gpu_flags_and_keeps_the_users_value(monkeypatch):
  monkeypatch.setattr(accel, "_backends_started", lambda: False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
  added = accel.configure(gpu=True)
  flags = os.environ["XLA_FLAGS"].split()
  assert "--xla_gpu_enable_triton_gemm=true" in flags and "--xla_gpu_enable_triton_gemm=false" not in flags
  assert {f.name for f in added} == {f.name for f in accel.GPU_FLAGS} - {"--xla_gpu_enable_triton_gemm"}
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
  assert accel.describe(added).startswith("xla_gpu_flags=--xla_gpu_enable_latency_hiding_scheduler=true")
  multi = accel.configure(gpu=True, multi_gpu=True)  # the GPU set is there now: only the multi-GPU ones join
  assert {f.name for f in multi} == {f.name for f in accel.MULTI_GPU_FLAGS}


def test_configure_on_cpu_or_switched_off_adds_nothing(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert accel.configure(gpu=False) == () and accel.describe(()) == "xla_gpu_flags=none"
  monkeypatch.setenv(accel.ENV_SWITCH, "0")
  assert accel.configure(gpu=True) == ()
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_configure_after_a_backend_started_is_an_error_not_a_silent_no_op(monkeypatch):
  import jax

  jax.devices()  # this process's backend is up
  monkeypatch.setenv("XLA_FLAGS", "")
  with pytest.raises(RuntimeError, match="already started"):
    accel.configure(gpu=True)


def test_gpu_bench_smoke_prints_every_key():
  """`bench/gpu.py --smoke`: every row's child runs (k2jax step, transformers step, the routed-expert layer
  per grouped GEMM) and the summary keys are printed; GPU-only figures (peak bytes) are nan on CPU."""
  cmd = [sys.executable, "bench/gpu.py", "--smoke", "--presets=small", "--reps=2", "--warmup=0", "--no_flags_row"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  text = out.stdout
  assert "failed" not in text, text
  keys = dict(re.findall(r"^(\w+)=(\S+)$", text, re.M))
  for key in ("small_hf_over_k2", "small_mfu", "large_mfu", "small_peak_gb", "hf_small_peak_gb"):
    assert key in keys, text
  assert float(keys["small_hf_over_k2"]) > 0 and float(keys["moe_kernel_over_dense_active"]) > 0
  assert re.search(r"small_step_ms=[\d.]+\[[\d.]+,[\d.]+\]", text) and re.search(r"hf_small_step_ms=", text)
  # The layer row checks every candidate against ragged_dot; the GPU kernels refuse a CPU target by name.
  assert float(re.search(r"moe_layer_tiled_max_diff_y=(\S+)", text).group(1)) < 1e-2
  assert "moe_layer_tokamax_error" in text and "compile target is cpu" in text
