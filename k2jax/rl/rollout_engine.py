"""The rollout engine an RL run generates with (`make_engine`): SGLang over HTTP, the embedded k2jax engine on
one device or on a serving mesh, or sglang-jax's engine in process; and the model state it serves."""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from k2jax.api import model_from_state
from k2jax.engine.base import Engine
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.engine.inference import InferenceEngine
from k2jax.engine.routed import RoutedEngine
from k2jax.model import K2Model, int4
from k2jax.model.config import ConfigError, K2Config
from k2jax.rl.programs import rollout_model_config, serving_config


def make_engine(lc, state: dict, decode) -> Engine:
  """The rollout engine for `lc` (a `k2jax.rl.learner.LearnerConfig`; that module imports this one): SGLang
  over HTTP when `engine_url` is set (through a router when `worker_urls` are too), else one in this process
  (`rollout.engine`): the embedded k2jax engine, serving the model state `state` (device arrays) on this
  process's first device (the trainer's own arrays when they are there already), or sglang-jax's engine,
  whose parameters every push replaces on device (`k2jax.engine.sglang_jax`)."""
  if lc.engine_url:
    engine = HttpEngine(HttpEngineConfig(lc.engine_url))
    if lc.worker_urls:  # the router only forwards /generate: updates and aborts go to each worker
      engine = RoutedEngine(engine, [HttpEngine(HttpEngineConfig(u)) for u in lc.worker_urls])
    engine.wait_until_healthy(timeout_s=600)
    # Pushing weights and stamping tokens with versions the server confirms; over-sampling aborts stragglers.
    engine.capabilities().require(
      "RL with weight sync", lc.engine_url, weight_update=True, weight_version=True, abort=True
    )
    return engine
  if jax.process_count() > 1 and (lc.rollout_engine != "embedded" or not lc.engine.sharding):
    raise ConfigError(
      f"rollout.engine: {jax.process_count()} JAX processes share the policy; in-process rollouts then need "
      "the embedded engine on a serving mesh over every process's devices (engine.sharding = tp | ep | tp_ep). "
      "sglang-jax's colocated engine cannot span processes (it runs single-process, its mesh the first "
      "tp_size local devices); else give a remote engine (SGLang) URL"
    )
  if lc.rollout_engine == "sglang_jax_colocated":  # sglang-jax's engine in this process (Python >= 3.12)
    from k2jax.engine.sglang_jax import SglangJaxEngine, write_model_dir

    # It starts from the architecture alone (config.json + tokenizer); the first push brings the weights.
    model_dir = write_model_dir(lc.model, os.path.join(lc.sync.root, "sglang_jax_model"))
    return SglangJaxEngine(lc.model, model_dir, lc.sglang_jax)
  if lc.engine.sharding:  # every process: the serving mesh spans them all; paused until the first phase
    served = _serving_dtype(lc.model, state)
    model = model_from_state(serving_config(lc.model), served)
    return InferenceEngine(model, lc.engine, eos_token_ids=lc.rollout.stop_token_ids, paused=True)
  served = jax.device_put(state, SingleDeviceSharding(jax.local_devices()[0]))  # no copy when already there
  cfg = rollout_model_config(lc)  # INT4 rollouts: one device (RLConfig.validate refuses a serving mesh)
  model = model_from_state(cfg, _int4_experts(cfg, served))
  return InferenceEngine(model, lc.engine, eos_token_ids=lc.rollout.stop_token_ids)


def _int4_experts(cfg: K2Config, state: dict) -> dict:
  """`state` with the routed experts packed as INT4 when `cfg` serves them so (quantized from the trainer's
  float32 masters, as every later push is: the codes an expert_qat='int4' trainer trains on)."""
  if cfg.expert_storage != "int4":
    return state
  abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0)))))
  return int4.served_params(state, abstract)


def _serving_dtype(cfg: K2Config, state: dict) -> dict:
  """The model state as the engine serves it: float weights in the compute dtype (K2 serves bf16 from
  float32 master weights); the router's balancing bias stays float32 (it only selects experts, and a
  rounded bias would select others than the trainer)."""
  cdt = np.dtype(cfg.compute_dtype)

  def cast(path, x):
    bias = any(getattr(k, "key", None) == "bias" for k in path)
    return x if bias or not np.issubdtype(x.dtype, np.floating) else x.astype(cdt)

  return jax.tree_util.tree_map_with_path(cast, state)
