"""Engines: one request/sampling/result vocabulary, the `Engine` interface and its implementations.

`base` holds the vocabulary and the interface; `inference` is the in-process JAX engine (KV cache,
continuous batching, prefix reuse) over `runner`, `decode`, `sampling` and `prefix_cache`, on one device
or a serving mesh (`placement`: presets tp | ep | tp_ep) across processes in lockstep (`lockstep`); `http` and
`routed` talk to SGLang-compatible servers; `sglang_jax` runs sglang-jax's engine in this process with weights
swapped on device (imports sgl_jax only when built); `fake` is a scripted engine for tests and benchmarks.
"""

from k2jax.engine.base import FINISH_TYPES, Engine, GenerateRequest, GenerateResult, InvalidRequest, SamplingParams
from k2jax.engine.fake import FakeEngine, FakeEngineConfig
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.engine.inference import EngineConfig, InferenceEngine
from k2jax.engine.routed import RoutedEngine
from k2jax.engine.sglang_jax import SglangJaxConfig, SglangJaxEngine

__all__ = [
  "FINISH_TYPES",
  "Engine",
  "GenerateRequest",
  "GenerateResult",
  "SamplingParams",
  "FakeEngine",
  "FakeEngineConfig",
  "HttpEngine",
  "HttpEngineConfig",
  "EngineConfig",
  "InferenceEngine",
  "InvalidRequest",
  "RoutedEngine",
  "SglangJaxConfig",
  "SglangJaxEngine",
]
