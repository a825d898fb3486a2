"""Engine backends: SGLang-compatible HTTP and an in-process fake for tests and benchmarks."""

from k2jax.rl.engines.fake import FakeEngine, FakeEngineConfig
from k2jax.rl.engines.http import HttpEngine, HttpEngineConfig
