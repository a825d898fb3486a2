"""Embedded K2 inference: KV-cached decoding, continuous batching, prefix reuse, SGLang/OpenAI HTTP API."""

from k2jax.serve.engine import Completion, EngineConfig, InferenceEngine, InvalidRequest, Request, SamplingOptions
from k2jax.serve.server import Server

__all__ = ["Completion", "EngineConfig", "InferenceEngine", "InvalidRequest", "Request", "SamplingOptions", "Server"]
