"""Import direction around agentic: data and sandbox sit below agentic; synthesis (k2jax.synth) and RL sit
above it. Checked on the source (every import statement, including function-level ones)."""

import ast
import pathlib

K2JAX = pathlib.Path(__file__).resolve().parents[2] / "k2jax"


def _imports(package: str) -> set[tuple[str, str]]:
  out = set()
  for path in (K2JAX / package).rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        out.add((str(path.relative_to(K2JAX)), node.module))
      elif isinstance(node, ast.Import):
        out.update((str(path.relative_to(K2JAX)), a.name) for a in node.names)
  return out


def _offending(package: str, higher: tuple[str, ...]) -> list[tuple[str, str]]:
  return sorted((f, m) for f, m in _imports(package) if any(m == h or m.startswith(h + ".") for h in higher))


def test_data_and_sandbox_do_not_import_agentic_synth_or_rl():
  for package in ("data", "sandbox"):
    assert _offending(package, ("k2jax.agentic", "k2jax.synth", "k2jax.rl")) == [], package


def test_agentic_does_not_import_synth_and_synth_runs_the_agentic_loop():
  assert _offending("agentic", ("k2jax.synth",)) == []
  assert ("synth/trajectories.py", "k2jax.agentic.loop") in _imports("synth")
