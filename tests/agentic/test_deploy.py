"""The container recipe and Kubernetes manifests agree with the code: every environment they start
exists, every container has resource limits, environments have no egress, autoscalers target the
Deployments; `kubectl kustomize` renders them when kubectl is installed."""

import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from k2jax.agentic.envs.service import env_factories

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


def _objects():
  out = []
  for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
    if path.name != "kustomization.yaml":
      out += [o for o in yaml.safe_load_all(path.read_text()) if o]
  return out


def test_manifests_match_the_services():
  objs = _objects()
  deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
  assert set(deployments) == {"env-sim-tools", "env-code", "env-swe"}
  for name, d in deployments.items():
    pod = d["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--env="))
    assert env in env_factories(), env
    assert {"cpu", "memory"} <= set(c["resources"]["limits"]) and c["resources"]["requests"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["allowPrivilegeEscalation"] is False
  services = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
  hpas = [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
  assert services == set(deployments) and {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == set(deployments)
  (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
  assert policy["spec"]["egress"] == [] and "Egress" in policy["spec"]["policyTypes"]
  for d in deployments.values():  # the default-deny policy selects every environment pod
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
  dockerfile = (DEPLOY / "Dockerfile").read_text()
  assert re.search(r'ENTRYPOINT \["python", "-m", "k2jax.agentic.envs"', dockerfile)
  assert (pathlib.Path(__file__).resolve().parents[2] / "k2jax/agentic/envs/__main__.py").is_file()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_renders():
  out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  kinds = [o["kind"] for o in yaml.safe_load_all(out.stdout) if o]
  assert sorted(kinds) == sorted(
    [
      "Namespace",
      "Deployment",
      "Deployment",
      "Deployment",
      "Service",
      "Service",
      "Service",
      "HorizontalPodAutoscaler",
      "HorizontalPodAutoscaler",
      "HorizontalPodAutoscaler",
      "PersistentVolumeClaim",
      "NetworkPolicy",
    ]
  )
