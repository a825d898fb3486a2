"""k2jax.pyparse: parsing from many threads at once never raises CPython gh-106905's SystemError.

The stress runs 400 parses of a source of nested expressions on 64 threads through the callers that parse in
threads (the SWE hack check, the code verifier's test splitter). So that the race does not hang on what else
the host runs, the fixture lets threads switch at every garbage collection (a gc callback that sleeps 0 s:
jax's own gc callback is what lets them switch mid-parse in k2jax). Measured here on Python 3.11.7 without
the lock: 4 to 14 of 400 calls raise, through either caller or plain `ast.parse`.
"""

import ast
import contextlib
import gc
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from k2jax import pyparse
from k2jax.sandbox import code
from k2jax.swe import hackcheck

_NESTED = "[" * 100 + "1" + "]" * 100
SOURCE = f"x = {'1 + ' * 200}1\nassert f(x) == {_NESTED}\n"
CALLERS = {
  "hackcheck.check_source": lambda: hackcheck.check_source(SOURCE),
  "code.split_test": lambda: code.split_test(SOURCE),
}


@pytest.fixture
def switchy():
  """Threads may switch at every garbage collection, for the test's duration."""

  def yield_gil(phase, info):
    time.sleep(0)

  gc.callbacks.append(yield_gil)
  try:
    yield
  finally:
    gc.callbacks.remove(yield_gil)


def _mismatches(fn, calls: int = 400, threads: int = 64) -> int:
  """How many of `calls` calls of `fn` on `threads` threads raise gh-106905's SystemError."""

  def one(_):
    try:
      fn()
    except SystemError as e:
      assert "recursion depth mismatch" in str(e), e
      return 1
    return 0

  with ThreadPoolExecutor(threads) as pool:
    return sum(pool.map(one, range(calls)))


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_parsing_from_64_threads_never_raises(switchy, caller):
  assert _mismatches(CALLERS[caller]) == 0


def test_without_the_lock_the_stress_reproduces_gh106905(switchy, monkeypatch):
  """The test above would fail without `pyparse`'s lock (where this CPython has the bug at all)."""
  if not any(_mismatches(lambda: ast.parse(SOURCE)) for _ in range(3)):
    pytest.skip(f"plain ast.parse never raised in 3 x 400 threaded calls: Python {sys.version.split()[0]} is fixed")
  monkeypatch.setattr(pyparse, "_LOCK", contextlib.nullcontext())
  for caller in sorted(CALLERS):
    assert any(_mismatches(CALLERS[caller]) for _ in range(3)), caller


def test_parse_and_compile_tree_are_ast_parse_and_compile():
  tree = pyparse.parse("def f(x):\n  return x + 1\n", "m.py")
  assert ast.dump(tree) == ast.dump(ast.parse("def f(x):\n  return x + 1\n"))
  assert ast.dump(pyparse.parse("1 + 2", mode="eval")) == ast.dump(ast.parse("1 + 2", mode="eval"))
  ns = {}
  exec(pyparse.compile_tree(tree, "m.py"), ns)  # noqa: S102  (our own two-line source)
  assert ns["f"](41) == 42
  with pytest.raises(SyntaxError, match="m.py"):
    pyparse.parse("def f(:\n", "m.py")
  with pytest.raises(TypeError, match="expected an ast.AST, got str"):
    pyparse.compile_tree("x = 1", "m.py")
