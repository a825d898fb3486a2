"""JAX's persistent compilation cache for the launchers, and one log line per slow compile.

  _CACHE_DIR = compile_cache.define_flag()      # at module level in a launcher
  compile_cache.enable(_CACHE_DIR.value)        # first thing in main(); '' leaves the cache off

A second run of the same program on the same backend then loads its executables from the directory
instead of compiling. Every compile of at least `log_min_secs` prints (stderr), e.g.

  compile jit(train_step): 14.2 s, persistent cache miss (written)
  compile jit(train_step): 0.31 s, persistent cache hit (saved 13.9 s)

so a run's log says what it spent compiling and whether the cache served it. The hit/miss state
comes from JAX's own monitoring events, recorded inside the compile they describe.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

# JAX's own variable wins, so a caller that already points JAX at a cache keeps it.
DEFAULT_DIR = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
  os.path.expanduser("~"), ".cache", "k2jax", "jax_compile"
)
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_LOOKUP_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_MISS_WRITTEN_EVENT = "/jax/compilation_cache/cache_misses"
_SAVED_EVENT = "/jax/compilation_cache/compile_time_saved_sec"


@dataclasses.dataclass
class Compile:
  fun_name: str
  seconds: float
  cache: str  # 'hit', 'miss' (compiled; written if `written`), or 'off' (cache not consulted)
  written: bool = False
  saved_seconds: float = 0.0


@dataclasses.dataclass
class _State:
  log_min_secs: float = 1.0
  out: object = None  # file to log to; None = sys.stderr at log time
  compiles: list = dataclasses.field(default_factory=list)
  pending: dict = dataclasses.field(default_factory=threading.local)
  log_flag: object = None  # the launcher's --compile_log_min_secs holder, once defined


_STATE = _State()
_LISTENING = False


def define_flag(name: str = "compile_cache_dir"):
  """The launchers' cache-directory flag (an absl FlagHolder), and `--compile_log_min_secs` beside it."""
  from absl import flags  # noqa: PLC0415 (only launchers define flags)

  _STATE.log_flag = flags.DEFINE_float(
    "compile_log_min_secs", 1.0, "Log every compile that took (or, on a cache hit, saved) at least this many seconds."
  )
  return flags.DEFINE_string(name, DEFAULT_DIR, "JAX persistent compilation cache directory; '' turns the cache off.")


def enable(cache_dir: str, *, log_min_secs: float | None = None, min_compile_secs: float = 0.5) -> None:
  """Use `cache_dir` as JAX's persistent compilation cache ('' = off) and log slow compiles.

  log_min_secs: None = the launcher's `--compile_log_min_secs` (1 s where no launcher defined it).
  min_compile_secs: compiles faster than this are not written (JAX's threshold; default 1 s there;
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS in the environment overrides both).
  """
  import jax  # noqa: PLC0415

  if log_min_secs is None:
    log_min_secs = _STATE.log_flag.value if _STATE.log_flag is not None else 1.0
  _STATE.log_min_secs = log_min_secs
  if cache_dir:
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
  else:
    jax.config.update("jax_compilation_cache_dir", None)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_secs)
  _listen()


def compiles() -> list[Compile]:
  """Every compile seen since `enable` (in order)."""
  return list(_STATE.compiles)


def _listen():
  global _LISTENING
  if _LISTENING:
    return
  from jax import monitoring  # noqa: PLC0415

  monitoring.register_event_listener(_on_event)
  monitoring.register_event_duration_secs_listener(_on_duration)
  _LISTENING = True


def _pending() -> dict:
  p = _STATE.pending
  if not hasattr(p, "cache"):
    p.cache, p.written, p.saved = "off", False, 0.0
  return p.__dict__


def _on_event(event: str, **kwargs) -> None:
  p = _pending()
  if event == _LOOKUP_EVENT:
    p["cache"] = "miss"
  elif event == _HIT_EVENT:
    p["cache"] = "hit"
  elif event == _MISS_WRITTEN_EVENT:
    p["written"] = True


def _on_duration(event: str, seconds: float, **kwargs) -> None:
  p = _pending()
  if event == _SAVED_EVENT:
    p["saved"] = seconds
    return
  if event != _COMPILE_EVENT:
    return
  c = Compile(str(kwargs.get("fun_name", "?")), seconds, p["cache"], p["written"], p["saved"])
  p.update(cache="off", written=False, saved=0.0)
  _STATE.compiles.append(c)
  if max(c.seconds, c.saved_seconds) >= _STATE.log_min_secs:
    print(f"compile {c.fun_name}: {c.seconds:.2f} s, {_describe(c)}", file=_STATE.out or sys.stderr, flush=True)


def _describe(c: Compile) -> str:
  if c.cache == "hit":
    return f"persistent cache hit (saved {c.saved_seconds:.1f} s)"
  if c.cache == "miss":
    return "persistent cache miss" + (" (written)" if c.written else " (not written)")
  return "persistent cache off"
