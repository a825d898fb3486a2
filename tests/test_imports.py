"""Imports inside k2jax point down: no module imports from a package in its own or a higher layer.

Read from the source (ast), so nothing is imported and imports under `if TYPE_CHECKING:` or inside
functions count too: they are dependencies all the same.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "k2jax"

# Lowest first. A package may import only packages of strictly lower layers (and itself). Entries are
# paths under k2jax/ (a subpackage may be its own entry: the longest match wins); the
# package root (`k2jax.load`, `k2jax.save_hf`) re-exports `api` and counts as it.
LAYERS = (
  # configlib: typed config trees; pyparse: the one thread-safe ast.parse; accel: XLA GPU flags
  ("configlib", "sharding", "distributed", "transport", "httpservice", "pyparse", "accel"),
  ("model", "sandbox", "llm_client", "data.tokenizer"),  # the tokenizer is a leaf: exports write it
  ("convert", "optim", "swe"),  # swe: SWE tasks and grading over the sandbox
  ("api", "memory", "data"),
  ("engine", "train"),
  # grading: the one reward contract (math, code, instruction, judge, rubric), graded by RL and benchmarks alike
  ("serve", "agentic", "grading"),
  ("eval",),  # benchmarks: any engine (embedded or a URL) graded by k2jax.grading; RL evaluates through it
  ("rl", "synth"),  # synthesis drives agentic tools and the multi-turn loop, like RL rollouts
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}

# Known edges that point the wrong way, each with who removes it. The test fails when one disappears,
# so this list only shrinks.
PENDING: dict[tuple[str, str], str] = {}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
  rel = ROOT.parent.joinpath(*name.split("."))
  return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def _imported(path: pathlib.Path, module: str) -> set[str]:
  """The k2jax modules `path` imports (`from pkg import submodule` resolves to the submodule)."""
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
      for a in node.names:
        out.add(f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base)
  return {m for m in out if m == "k2jax" or m.startswith("k2jax.")}


def _layer_key(module: str) -> str:
  """The LAYERS entry a module belongs to (longest matching prefix)."""
  parts = module.split(".")[1:]
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in LAYER:
      return ".".join(parts[:n])
  return "api" if not parts else parts[0]


def import_edges() -> dict[tuple[str, str], str]:
  """(importer, imported) -> 'ok' | a problem, for every cross-package import inside k2jax."""
  edges = {}
  for path in sorted(ROOT.rglob("*.py")):
    module = _module_name(path)
    src = _layer_key(module)
    for target in _imported(path, module):
      dst = _layer_key(target)
      if src == dst:
        continue
      if src not in LAYER or dst not in LAYER:
        edges[(module, target)] = f"{src if src not in LAYER else dst!r} has no layer: add it to LAYERS"
      elif LAYER[dst] >= LAYER[src]:
        edges[(module, target)] = f"{src} (layer {LAYER[src]}) imports {dst} (layer {LAYER[dst]})"
      else:
        edges[(module, target)] = "ok"
  return edges


def test_imports_point_down():
  edges = import_edges()
  bad = {edge: why for edge, why in edges.items() if why != "ok" and edge not in PENDING}
  assert not bad, "imports that point up or sideways:\n" + "\n".join(f"{a} -> {b}: {w}" for (a, b), w in bad.items())
  stale = [edge for edge in PENDING if edges.get(edge, "ok") == "ok"]
  assert not stale, f"fixed, remove from PENDING: {stale}"


def test_the_checker_resolves_relative_and_submodule_imports(tmp_path):
  src = tmp_path / "probe.py"
  src.write_text(
    "from . import http\nfrom .base import Engine\nfrom ..model import config\nimport k2jax\nfrom k2jax import load\n"
    "import numpy\nif True:\n  from k2jax.synth import llm\n"
  )
  assert _imported(src, "k2jax.engine.probe") == {
    "k2jax.engine.http",
    "k2jax.engine.base",
    "k2jax.model.config",
    "k2jax",
    "k2jax.synth.llm",
  }
  assert _layer_key("k2jax.synth.llm") == "synth" and _layer_key("k2jax.data.chat") == "data"
  assert _layer_key("k2jax.grading.math") == "grading" and _layer_key("k2jax.rl.learner") == "rl"
  assert _layer_key("k2jax") == "api" and _layer_key("k2jax.engine.http") == "engine"


def import_graph() -> dict[str, set[str]]:
  """k2jax module -> the k2jax modules it imports (every import: module level, in functions, TYPE_CHECKING)."""
  graph = {}
  for path in sorted(ROOT.rglob("*.py")):
    module = _module_name(path)
    graph[module] = _imported(path, module) - {module}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  for root in sorted(graph):
    if root in state:
      continue
    path, stack = [root], [iter(sorted(graph.get(root, ())))]
    state[root] = 1
    while stack:
      nxt = next(stack[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        stack.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      elif nxt not in state:
        state[nxt] = 1
        path.append(nxt)
        stack.append(iter(sorted(graph.get(nxt, ()))))
  return None


def test_no_import_circle():
  graph = import_graph()
  assert len(graph) > 100 and graph["k2jax.engine.admission"] >= {"k2jax.engine.requests"}
  cycle = find_cycle(graph)
  assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_circles_through_function_and_type_checking_imports(tmp_path):
  a, b, c = (tmp_path / f"{n}.py" for n in "abc")
  a.write_text("from k2jax.engine import b\n")
  b.write_text("def f():\n  from k2jax.engine.c import X\n")
  c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  import k2jax.engine.a\n")
  graph = {f"k2jax.engine.{p.stem}": _imported(p, f"k2jax.engine.{p.stem}") for p in (a, b, c)}
  # b's `from k2jax.engine.c import X` names c itself (c is not a file under k2jax/: it resolves to the module)
  assert graph["k2jax.engine.b"] == {"k2jax.engine.c"} and graph["k2jax.engine.c"] == {"k2jax.engine.a"}
  graph["k2jax.engine.a"] = {"k2jax.engine.b"}  # `from k2jax.engine import b`: b is no real submodule here
  assert find_cycle(graph) == ["k2jax.engine.a", "k2jax.engine.b", "k2jax.engine.c", "k2jax.engine.a"]
  graph["k2jax.engine.c"] = set()
  assert find_cycle(graph) is None
  assert find_cycle({"x": {"y"}, "y": {"y", "z"}}) == ["y", "y"]
