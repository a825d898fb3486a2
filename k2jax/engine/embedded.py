"""The embedded k2jax inference engine (`k2jax.engine.InferenceEngine`) behind the RL `Engine` interface.

Runs in the trainer's process, with no HTTP in between. Weight updates still go through disk exactly as
with SGLang: `update_weights(path, version)` reads the HF safetensors directory written by
`weight_sync.WeightSync` (which may hold only the tensors that changed), overlays those tensors on the
weights being served, and swaps them in between two decode steps. Every token of a request carries the
weight version the engine held when the request finished; the learner only updates between rollout
phases, when no request is in flight, so that is the version that produced every token.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from k2jax.api import model_from_state
from k2jax.convert.overlay import overlay_hf_tensors
from k2jax.model.transformer import K2Model
from k2jax.engine.base import Engine, GenerateRequest, GenerateResult
from k2jax.engine.inference import EngineConfig, InferenceEngine, Request, SamplingOptions


class EmbeddedEngine(Engine):
  """`Engine` over an in-process `InferenceEngine` serving `model`."""

  def __init__(
    self,
    model: K2Model,
    config: EngineConfig = EngineConfig(),
    *,
    eos_token_ids: Sequence[int] = (),
    decode: Callable[[list[int]], str] | None = None,
  ):
    self.cfg = model.cfg
    self._state = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model)))  # host copy: what is served
    self._decode = decode
    self.engine = InferenceEngine(model, config, eos_token_ids=eos_token_ids)

  @property
  def weight_version(self) -> int:
    return self.engine.weight_version

  def generate(self, request: GenerateRequest) -> GenerateResult:
    s = request.sampling
    done = self.engine.generate(
      Request(
        request.rid,
        tuple(request.input_ids),
        SamplingOptions(
          max_new_tokens=s.max_new_tokens,
          temperature=s.temperature,
          top_p=s.top_p,
          top_k=s.top_k,
          stop_token_ids=tuple(s.stop_token_ids),
          seed=s.seed,
        ),
      )
    )
    if done.finish["type"] == "abort" and done.finish.get("status_code", 200) >= 500:
      raise RuntimeError(f"embedded engine failed on {request.rid}: {done.finish.get('message')}")
    n = len(done.output_ids)
    return GenerateResult(
      rid=request.rid,
      output_ids=tuple(done.output_ids),
      output_logprobs=tuple(done.logprobs),
      weight_versions=(done.weight_version,) * n,
      finish_reason=done.finish["type"],
      prompt_tokens=done.prompt_tokens,
      completion_tokens=n,
      text=self._decode(done.output_ids) if self._decode else None,
    )

  def abort(self, rids: Sequence[str]) -> None:
    for rid in rids:
      self.engine.abort(rid)

  def update_weights(self, model_path: str, weight_version: int) -> None:
    """Overlays the HF tensors in `model_path` on the served weights; serves them as `weight_version`."""
    state = overlay_hf_tensors(self.cfg, self._state, model_path)
    self.engine.update_weights(model_from_state(self.cfg, state), weight_version)
    self._state = state

  def close(self) -> None:
    self.engine.close()
