"""tests/xla_flags.py's `compile_level`: the LLVM level it sets reaches the options XLA compiles a jitted
program with, and None leaves XLA_FLAGS' level (no override)."""

import jax
import jax.numpy as jnp
import pytest
from jax._src import compiler

from tests.xla_flags import _LEVEL, compile_level


@pytest.fixture
def seen_options(monkeypatch):
  """The XLA compile options of each compile in the test (a persistent cache hit passes through it too)."""
  seen = []
  original = compiler.compile_or_get_cached

  def spy(backend, computation, devices, compile_options, *args, **kwargs):
    seen.append(dict(compile_options.env_option_overrides))
    return original(backend, computation, devices, compile_options, *args, **kwargs)

  monkeypatch.setattr(compiler, "compile_or_get_cached", spy)
  before = _LEVEL[0]
  yield seen
  compile_level(before)


@pytest.mark.parametrize("level", [0, 1, None])
def test_the_level_reaches_a_real_compile(level, seen_options):
  compile_level(level)
  x = jnp.arange(7.0 + (level or 0))  # a shape of its own per case: each compiles afresh
  assert float(jax.jit(lambda v: (v * 3.0).sum())(x)) == pytest.approx(3.0 * float(x.sum()))
  assert seen_options, "no compile seen"
  if level is None:
    assert all("xla_backend_optimization_level" not in o for o in seen_options), seen_options
  else:
    assert seen_options[-1]["xla_backend_optimization_level"] == level, seen_options


def test_a_jits_own_options_win(seen_options):
  compile_level(0)
  f = jax.jit(lambda v: v - 1.0, compiler_options={"xla_backend_optimization_level": 2})
  assert float(f(jnp.float32(5.0))) == 4.0
  assert seen_options[-1]["xla_backend_optimization_level"] == 2
