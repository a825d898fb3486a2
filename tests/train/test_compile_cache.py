"""The launchers' persistent compilation cache: a second identical run loads instead of compiling."""

import re

import jax
import jax.numpy as jnp
import pytest

from k2jax import compile_cache
from tests.train import _util

_LINE = re.compile(r"^compile (\S+): ([0-9.]+) s, persistent cache (hit|miss|off)", re.M)


def _compiles(stderr: str) -> dict[str, tuple[float, str]]:
  return {name: (float(s), state) for name, s, state in _LINE.findall(stderr)}


@pytest.mark.slow
def test_second_train_run_hits_the_cache(tmp_path):
  cache = str(tmp_path / "cache")
  # Every compile is logged (--compile_log_min_secs=0) and written (run_train's cache_dir= sets JAX's write
  # thresholds to 0), however fast this host compiles: a hit that saved under the default 1 s would print nothing.
  args = (
    f"--compile_cache_dir={cache}",
    "--compile_log_min_secs=0",
    *_util.flags(steps=1, **{"data.global_batch_size": 4, "data.seq_len": 32}),
  )
  first = _compiles(_util.run_train(str(tmp_path / "a"), *args, devices=1, cache_dir=cache, timeout=1500).stderr)
  step_name = max(first, key=lambda n: first[n][0])  # the slowest compile: the train step
  assert first[step_name][1] == "miss", first
  second = _compiles(_util.run_train(str(tmp_path / "b"), *args, devices=1, cache_dir=cache, timeout=1500).stderr)
  assert second[step_name][1] == "hit", (step_name, second)
  assert second[step_name][0] < first[step_name][0]


def test_empty_dir_turns_the_cache_off_and_compiles_are_logged(capsys):
  compile_cache.enable("", log_min_secs=0.0)
  assert jax.config.jax_compilation_cache_dir is None
  jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25)(jnp.ones(7)).block_until_ready()
  last = compile_cache.compiles()[-1]
  # JAX opens its cache once per process: if the suite compiled with a cache dir before this test,
  # lookups still go there ('miss'); the launchers call enable() before any compile.
  assert last.cache in ("off", "miss") and last.seconds > 0
  assert re.search(r"compile \S+: [0-9.]+ s, persistent cache (off|miss)", capsys.readouterr().err)
