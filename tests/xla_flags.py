"""XLA_FLAGS for the suite's processes and the children they start (tests/conftest.py sets the suite's own).

XLA:CPU compiles at LLVM optimisation level 0 in the suite, children included: the suite is compile-bound
(tiny models, hundreds of programs, one per shape), and level 0 halves a compile (the tiny train step: 13.8 ->
7.0 s here, the whole 3-step `launch/train.py` run 27.5 -> 17.6 s) while a step runs ~2x slower (recipe_pretrain:
8.6k -> 4.0k tokens/s) and computes the same floats (LLVM does not reassociate them without fast-math: the tiny
run's loss printed equal to the last digit, 8.28056812286377). Every child gets the same flags as the test that
compares against it, so bitwise checks compare like with like.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int = 0) -> str:
  """`devices` fake CPU devices (0: the platform's own, one) at FAST_COMPILE."""
  return (f"--xla_force_host_platform_device_count={devices} " if devices else "") + FAST_COMPILE
