"""The embedded k2jax inference engine (`k2jax.serve.InferenceEngine`) behind the RL `Engine` interface.

Runs in the trainer's process, with no HTTP in between. The learner hands it new weights as a pytree of
device arrays (`update_params`: copied onto the engine's own devices, no host, no disk); an HF safetensors
directory (`update_weights(path, version)`, as SGLang takes them, possibly only the changed tensors) is
overlaid on the weights being served. Either way the swap happens between two decode steps. Every token of a request carries the
weight version the engine held when the request finished; the learner only updates between rollout
phases, when no request is in flight, so that is the version that produced every token.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k2jax.api import model_from_state
from k2jax.convert.overlay import overlay_hf_tensors
from k2jax.model.transformer import K2Model
from k2jax.rl.engine import Engine, GenerateRequest, GenerateResult
from k2jax.serve.engine import EngineConfig, InferenceEngine, Request, SamplingOptions


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
    self._state = nnx.to_pure_dict(nnx.state(model))  # what is served (device arrays)
    # Where the engine keeps its weights: trainer pytrees are copied there (resharded when they differ).
    self._shardings = jax.tree.map(lambda x: x.sharding, self._state)
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

  def update_params(self, state: dict, weight_version: int) -> None:
    """Serves the pure state dict `state` (device arrays, any sharding) as `weight_version`.

    The arrays are copied device to device onto the engine's placement (never aliased: the trainer
    donates its state to the next step)."""
    state = copy_to(state, self._shardings)
    self.engine.update_weights(model_from_state(self.cfg, state), weight_version)
    self._state = state

  def close(self) -> None:
    self.engine.close()


def copy_to(state, shardings):
  """`state` copied device to device onto `shardings` (a sharding or a tree of them); no result shares a
  buffer with `state`, so the trainer may donate its arrays afterwards."""
  return jax.tree.map(_own_copy, state, jax.device_put(state, shardings, may_alias=False))


def _own_copy(src: jax.Array, dst: jax.Array) -> jax.Array:
  """`dst`, copied when it still shares a buffer with `src` (device_put hands back the source's own
  shard when moving a replicated array onto one of its devices, whatever `may_alias` says)."""
  src_buffers = {s.data.unsafe_buffer_pointer() for s in src.addressable_shards}
  if any(s.data.unsafe_buffer_pointer() in src_buffers for s in dst.addressable_shards):
    return jnp.copy(dst)
  return dst
