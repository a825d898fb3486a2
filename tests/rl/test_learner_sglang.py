"""launch/sglang_server.sh: the SGLang commands it builds (--dry-run) and the errors it gives."""

import os
import subprocess

import pytest

SCRIPT = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "launch", "sglang_server.sh"
)


def _run(*args):
  return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=30)


def test_single_replica_command():
  out = _run("--model=/ckpt/k2-hf", "--tp=8", "--ep=8", "--host=10.0.0.1", "--dry-run")
  assert out.returncode == 0, out.stderr
  (cmd,) = out.stdout.splitlines()
  args = cmd.split()
  assert args[:3] == ["python", "-m", "sglang.launch_server"]
  pairs = dict(zip(args[3::1], args[4::1]))
  assert pairs["--model-path"] == "/ckpt/k2-hf" and pairs["--tp-size"] == "8" and pairs["--ep-size"] == "8"
  assert pairs["--tool-call-parser"] == "kimi_k2" and pairs["--port"] == "30000"
  assert "--trust-remote-code" in args and "--skip-tokenizer-init" in args
  assert "--config.rollout.engine_url=http://10.0.0.1:30000" in out.stderr


def test_sglang_jax_command_uses_only_its_own_flags():
  out = _run(
    "--engine=sglang-jax", "--model=/m", "--tp=4", "--ep=4", "--dp=2", "--device=cpu", "--deterministic", "--dry-run"
  )
  assert out.returncode == 0, out.stderr
  args = out.stdout.split()
  assert args[:3] == ["python", "-m", "sgl_jax.launch_server"]
  pairs = dict(zip(args[3::1], args[4::1]))
  assert (pairs["--tp-size"], pairs["--ep-size"], pairs["--dp-size"], pairs["--device"]) == ("4", "4", "2", "cpu")
  assert "--enable-deterministic-sampling" in args  # sglang-jax's seeded-sampling switch
  for flag in ("--tool-call-parser", "--enable-dp-attention", "--enable-deterministic-inference"):
    assert flag not in args  # SGLang-only: sglang-jax's argument parser rejects them
  # Every flag is one sglang-jax's server_args.py defines (commit cddbf6f).
  known = {"--model-path", "--host", "--port", "--device", "--tp-size", "--ep-size", "--dp-size", "--dtype"}
  known |= {"--mem-fraction-static", "--trust-remote-code", "--enable-deterministic-sampling", "--skip-tokenizer-init"}
  known |= {"--attention-backend"}  # native on CPU
  assert {a for a in args if a.startswith("--")} == known
  sglang = _run("--model=/m", "--deterministic", "--dry-run").stdout.split()
  assert "--enable-deterministic-inference" in sglang and "--tool-call-parser" in sglang


def test_sglang_jax_replicas_get_device_indexes():
  out = _run("--engine=sglang-jax", "--model=/m", "--tp=2", "--replicas=2", "--dry-run")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].endswith("--device-indexes 0 1") and lines[1].endswith("--device-indexes 2 3")
  assert "CUDA_VISIBLE_DEVICES" not in out.stdout and "sglang_router.launch_router" in lines[2]


def test_replicas_behind_router_get_gpu_slices_and_worker_urls():
  out = _run(
    "--model=/m",
    "--tp=4",
    "--replicas=2",
    "--host=h",
    "--tokenizer=/tok",
    "--dry-run",
    "--",
    "--enable-deterministic-inference",
  )
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert len(lines) == 3
  assert lines[0].startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 python -m sglang.launch_server")
  assert lines[1].startswith("CUDA_VISIBLE_DEVICES=4,5,6,7 python -m sglang.launch_server")
  assert "--port 30001" in lines[0] and "--port 30002" in lines[1]
  assert all("--tokenizer-path /tok" in l and "--enable-deterministic-inference" in l for l in lines[:2])
  assert lines[2] == (
    "python -m sglang_router.launch_router --worker-urls http://h:30001 http://h:30002 "
    "--policy cache_aware --host h --port 30000"
  )
  assert (
    "--config.rollout.engine_url=http://h:30000 --config.rollout.worker_urls=http://h:30001,http://h:30002"
  ) in out.stderr


def test_multi_node_and_router_only():
  out = _run(
    "--model=/m",
    "--tp=16",
    "--nnodes=2",
    "--node-rank=1",
    "--dist-init-addr=n0:5000",
    "--dp-attention",
    "--dp=2",
    "--dry-run",
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().endswith(
    "--dp-size 2 --enable-dp-attention --nnodes 2 --node-rank 1 --dist-init-addr n0:5000"
  )
  out = _run("--router-only", "--worker-urls=http://a:1,http://b:2", "--host=r", "--router-port=9", "--dry-run")
  assert out.stdout.strip() == (
    "python -m sglang_router.launch_router --worker-urls http://a:1 http://b:2 --policy cache_aware --host r --port 9"
  )


@pytest.mark.parametrize(
  "args, message",
  [
    (("--tp=8", "--dry-run"), "--model=HF_DIR is required"),
    (("--model=/m", "--tp=8", "--ep=3", "--dry-run"), "--ep=3 must divide --tp=8"),
    (("--model=/m", "--tp=x", "--dry-run"), "--tp must be an integer"),
    (("--model=/m", "--nnodes=2", "--dry-run"), "needs --dist-init-addr"),
    (("--model=/m", "--dp=2", "--dry-run"), "needs --dp-attention"),
    (("--model=/m", "--bogus"), "unknown argument '--bogus'"),
    (("--router-only", "--dry-run"), "needs --worker-urls"),
    (("--model=/does/not/exist",), "/does/not/exist/config.json not found"),
    (("--model=/m", "--engine=vllm", "--dry-run"), "--engine must be sglang or sglang-jax"),
    (("--model=/m", "--engine=sglang-jax", "--dp-attention", "--dry-run"), "--dp-attention is SGLang's"),
    (("--model=/m", "--engine=sglang-jax", "--device=cuda", "--dry-run"), "--device must be tpu, cpu or gpu"),
    (("--model=/m", "--device=cpu", "--dry-run"), "--device is for --engine=sglang-jax"),
  ],
)
def test_bad_arguments_are_named(args, message):
  out = _run(*args)
  assert out.returncode == 2 and message in out.stderr, out.stderr


def test_python_env_names_the_interpreter():
  """$PYTHON runs the servers and the router (a 3.12 venv's python without activating it)."""
  env = {**os.environ, "PYTHON": "/opt/venv312/bin/python"}
  cmd = ["bash", SCRIPT, "--engine=sglang-jax", "--model=/m", "--tp=1", "--replicas=2", "--device=cpu", "--dry-run"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert len(lines) == 3 and all(line.startswith("/opt/venv312/bin/python -m ") for line in lines)
