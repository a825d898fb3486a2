"""The pods' seccomp profile (deploy/seccomp/k2jax-sandbox.json): what `syscalls.pod_profile` writes, nothing
the inner filter refuses beyond the sandbox's own setup calls, and, applied here with libseccomp the way a
container runtime applies it (runc builds the same filter from the same JSON through libseccomp), the
sandbox still sets up and runs under it while the calls it leaves out are refused. No container runtime
runs on the test machines, so the kubelet/containerd path itself is not exercised."""

import json
import shutil
import pathlib
import subprocess
import sys

import pytest

from k2jax.sandbox import runner, syscalls

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROFILE = ROOT / "deploy" / "seccomp" / "k2jax-sandbox.json"
NOT_ISOLATED = runner.isolation_error()

# Loads the profile through libseccomp (OCI names -> libseccomp's), then runs the sandbox under it.
UNDER_PROFILE = r"""
import ctypes, errno, json, sys
import pyseccomp as sc
from k2jax.sandbox.runner import SandboxConfig, run_python

profile = json.load(open(sys.argv[1]))
ops = {"SCMP_CMP_EQ": sc.EQ, "SCMP_CMP_NE": sc.NE, "SCMP_CMP_MASKED_EQ": sc.MASKED_EQ}
f = sc.SyscallFilter(sc.ERRNO(profile["defaultErrnoRet"]))
for r in profile["syscalls"]:
  action = sc.ALLOW if r["action"] == "SCMP_ACT_ALLOW" else sc.ERRNO(r["errnoRet"])
  for name in r["names"]:
    try:
      f.add_rule(action, name, *(sc.Arg(a["index"], ops[a["op"]], a["value"], a["valueTwo"]) for a in r.get("args", [])))
    except ValueError:  # a name this arch lacks (arm64's cacheflush on x86-64), as runc skips it
      pass
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs, as a container's process has
cfg = SandboxConfig(cpu_time_s=5, wall_time_s=60)
ok = run_python({"main.py": "print('inside')"}, "main.py", cfg)
hostile = run_python({"main.py": "import ctypes; print(ctypes.CDLL(None).ptrace(0, 0, 0, 0))"}, "main.py", cfg)
f.load()
out = {"ok": [ok.stdout.strip(), list(ok.layers)], "hostile": [hostile.stdout.strip(), list(hostile.denied)]}
ok = run_python({"main.py": "print('inside')"}, "main.py", cfg)
hostile = run_python({"main.py": "import ctypes; print(ctypes.CDLL(None).ptrace(0, 0, 0, 0))"}, "main.py", cfg)
out["ok_under"] = [ok.stdout.strip(), list(ok.layers), ok.reason]
out["hostile_under"] = [hostile.stdout.strip(), list(hostile.denied)]
def call(nr, *args):
  ctypes.set_errno(0)
  r = libc.syscall(nr, *args)
  return ctypes.get_errno() if r == -1 else 0
out["pod"] = {
  "bpf": call(321, 0, 0, 0),
  "unshare_other_flags": call(272, 0x10020000),  # CLONE_NEWUSER | CLONE_NEWNS: a set the sandbox never asks for
  "mount_shared": call(165, 0, 0, 0, 1 << 20, 0),  # MS_SHARED: a flag outside the sandbox's own
  "keyctl": call(250, 0, 0, 0, 0, 0),
}
print(json.dumps(out))
"""


def test_the_committed_profile_is_what_the_code_writes():
  assert json.loads(PROFILE.read_text()) == syscalls.pod_profile()


def test_the_profile_adds_only_the_sandboxs_setup_to_the_inner_allow_list():
  profile = syscalls.pod_profile()
  allowed = {n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
  refused = {n for family in syscalls.REFUSED.values() for n in family}
  assert allowed & refused == {"unshare", "mount", "chroot", "clone"}
  conditional = {r["names"][0]: r.get("args") for r in profile["syscalls"] if r["names"][0] in ("unshare", "mount")}
  assert all(conditional.values())  # unshare and mount only with the sandbox's own arguments
  assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and "unconfined" not in PROFILE.read_text().lower()


@pytest.mark.skipif(NOT_ISOLATED is not None, reason=f"this machine cannot isolate code: {NOT_ISOLATED}")
def test_the_sandbox_runs_under_the_profile_and_what_it_leaves_out_is_refused():
  r = subprocess.run(
    [sys.executable, "-c", UNDER_PROFILE, str(PROFILE)],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
  )
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["ok_under"][0] == "inside" and "seccomp" in out["ok_under"][1], out
  assert out["hostile"] == ["-1", ["ptrace"]], out
  # Under both filters the kernel takes the strictest answer: the pod's EPERM comes before the inner filter's
  # notification, so a call both refuse is refused unnamed (only calls the pod allows are named inside).
  assert out["hostile_under"] == ["-1", []], out
  assert out["pod"] == {"bpf": 1, "unshare_other_flags": 1, "mount_shared": 1, "keyctl": 1}, out


def test_the_recipes_confine_the_sandbox_pods():
  """No Unconfined anywhere; the sandbox's pods name the Localhost profiles that deploy/ ships."""
  import yaml

  for path in sorted((ROOT / "deploy").rglob("*")):
    if path.is_file():
      assert "unconfined" not in path.read_text().lower(), path
  for name in ("env-code", "env-swe"):
    (deployment,) = [
      o
      for o in yaml.safe_load_all((ROOT / "deploy/k8s" / f"{name}.yaml").read_text())
      if o and o["kind"] == "Deployment"
    ]
    ctx = deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert ctx["seccompProfile"] == {"type": "Localhost", "localhostProfile": "profiles/k2jax-sandbox.json"}
    assert ctx["appArmorProfile"] == {"type": "Localhost", "localhostProfile": "k2jax-sandbox"}
  assert "profile k2jax-sandbox " in (ROOT / "deploy/apparmor/k2jax-sandbox").read_text()


@pytest.mark.skipif(shutil.which("apparmor_parser") is None, reason="apparmor_parser not installed (apt: apparmor)")
def test_the_apparmor_profile_parses():
  r = subprocess.run(
    ["apparmor_parser", "-Q", "-K", str(ROOT / "deploy/apparmor/k2jax-sandbox")], capture_output=True, text=True
  )
  assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_the_gvisor_variant_renders_with_its_runtime_class():
  import yaml

  r = subprocess.run(
    ["kubectl", "kustomize", str(ROOT / "deploy/k8s-gvisor")], capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 0, r.stderr
  objs = [o for o in yaml.safe_load_all(r.stdout) if o]
  (rc,) = [o for o in objs if o["kind"] == "RuntimeClass"]
  assert rc["handler"] == "runsc"
  pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment"}
  assert {n for n, p in pods.items() if p.get("runtimeClassName") == rc["metadata"]["name"]} == {"env-code", "env-swe"}
  for name in ("env-code", "env-swe"):
    assert pods[name]["containers"][0]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
