"""setup.py declares what the package imports: every third-party module imported anywhere in k2jax is a
requirement (or, where the import is optional, one of a named extra), and every one the tests import is a
requirement or in the test extra. Static: the import graph from the sources' ASTs, the requirements from
setup.py's AST, module -> distribution from the installed metadata (cheaper than building a venv)."""

import ast
import functools
import pathlib
import re
import sys
from importlib.metadata import packages_distributions

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Imported only where an optional feature runs (each import sits in the function that needs it).
OPTIONAL = {
  "libtpu": "tpu",  # k2jax/train/aot.py: ahead-of-time TPU compiles (jax[tpu] brings it)
  "tokamax": "gpu",  # k2jax/model/moe_gemm.py, attention_gpu.py: the GPU kernels
  "pytest_timeout": "swe",  # k2jax/swe/testrun.py: a per-test deadline when installed
}
# Installed from a source checkout (BUILD.md "RL with SGLang"), not from an index: no requirement can name it.
FROM_SOURCE = {"sgl_jax"}
LOCAL = {"k2jax", "tests", "bench", "launch", "configs", "conftest"}


def _requirements():
  tree = ast.parse((ROOT / "setup.py").read_text())
  call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
  kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
  name = lambda req: _norm(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))  # noqa: E731
  return {name(r) for r in kw["install_requires"]}, {e: {name(r) for r in rs} for e, rs in kw["extras_require"].items()}


def _norm(dist: str) -> str:
  return re.sub(r"[-_.]+", "-", dist).lower()


def _third_party_imports(root: pathlib.Path, local: set[str]) -> dict[str, str]:
  """{top-level module: a file importing it} over every .py under `root`, stdlib and local modules left out."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top not in local and not top.startswith("_"):
          out.setdefault(top, str(path.relative_to(ROOT)))
  return out


@functools.lru_cache(maxsize=1)
def _installed() -> dict[str, list[str]]:
  return packages_distributions()  # reads every installed distribution's file list: once


def _dists(module: str) -> set[str]:
  return {_norm(d) for d in _installed().get(module, ())}


def test_every_module_k2jax_imports_is_declared():
  required, extras = _requirements()
  missing = []
  for module, where in sorted(_third_party_imports(ROOT / "k2jax", LOCAL).items()):
    if module in FROM_SOURCE:
      continue
    if module in OPTIONAL:
      assert _dists(module) & extras[OPTIONAL[module]] or module == "libtpu", (module, OPTIONAL[module])
      continue
    dists = _dists(module)
    assert dists, f"{module} (imported by {where}) is not installed here: cannot tell its distribution"
    if not dists & required:
      missing.append(f"{module} ({'/'.join(sorted(dists))}, imported by {where})")
  assert not missing, f"imported by k2jax but not in setup.py's install_requires: {missing}"


def test_every_module_the_tests_import_is_declared():
  required, extras = _requirements()
  declared = required | extras["test"]
  local = LOCAL | {p.stem for p in (ROOT / "tests").rglob("*.py")}  # the tests' helper modules
  missing = []
  for module, where in sorted(_third_party_imports(ROOT / "tests", local).items()):
    dists = _dists(module)
    if dists and not dists & declared:
      missing.append(f"{module} ({'/'.join(sorted(dists))}, imported by {where})")
  assert not missing, f"imported by the tests but in neither install_requires nor the test extra: {missing}"


def test_the_math_grader_stack_is_pinned_and_requirements_name_real_extras():
  tree = ast.parse((ROOT / "setup.py").read_text())
  reqs = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
  for pinned in ("math-verify==", "sympy==", "antlr4-python3-runtime=="):
    assert any(r.startswith(pinned) for r in reqs), pinned
  assert not any(r.startswith("math-verify[") for r in reqs)  # 0.9.0 has no antlr4_13_2 extra
  uvicorn = next(r for r in reqs if r.startswith("uvicorn"))
  assert re.fullmatch(r"uvicorn>=[\d.]+,<0\.\d+", uvicorn), uvicorn  # capped below a minor version
