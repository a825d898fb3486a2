"""The embedded k2jax inference engine (`k2jax.serve.InferenceEngine`) behind the RL `Engine` interface.

Runs in the trainer's process, with no HTTP in between. Weight updates still go through disk exactly as
with SGLang: `update_weights(path, version)` reads the HF safetensors directory written by
`weight_sync.WeightSync` (which may hold only the tensors that changed), overlays those tensors on the
weights being served, and swaps them in between two decode steps. Every token of a request carries the
weight version the engine held when the request finished; the learner only updates between rollout
phases, when no request is in flight, so that is the version that produced every token.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open

from k2jax.api import model_from_state
from k2jax.convert.layout import entries
from k2jax.model.transformer import K2Model
from k2jax.rl.engine import Engine, GenerateRequest, GenerateResult
from k2jax.serve.engine import EngineConfig, InferenceEngine, Request, SamplingOptions

INDEX_NAME = "model.safetensors.index.json"


class EmbeddedEngine(Engine):
    """`Engine` over an in-process `InferenceEngine` serving `model`."""

    def __init__(self, model: K2Model, config: EngineConfig = EngineConfig(), *,
                 eos_token_ids: Sequence[int] = (), decode: Callable[[list[int]], str] | None = None):
        self.cfg = model.cfg
        self._state = jax.tree.map(np.array, nnx.state(model).to_pure_dict())  # host copy: what is served
        self._keys = {key: (entry, idx) for entry in entries(self.cfg) for idx, key in entry.keys(self.cfg)}
        self._decode = decode
        self.engine = InferenceEngine(model, config, eos_token_ids=eos_token_ids)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, request: GenerateRequest) -> GenerateResult:
        s = request.sampling
        done = self.engine.generate(Request(request.rid, tuple(request.input_ids), SamplingOptions(
            max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            stop_token_ids=tuple(s.stop_token_ids), seed=s.seed)))
        if done.finish["type"] == "abort" and done.finish.get("status_code", 200) >= 500:
            raise RuntimeError(f"embedded engine failed on {request.rid}: {done.finish.get('message')}")
        n = len(done.output_ids)
        return GenerateResult(
            rid=request.rid, output_ids=tuple(done.output_ids), output_logprobs=tuple(done.logprobs),
            weight_versions=(done.weight_version,) * n, finish_reason=done.finish["type"],
            prompt_tokens=done.prompt_tokens, completion_tokens=n,
            text=self._decode(done.output_ids) if self._decode else None)

    def abort(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)

    def update_weights(self, model_path: str, weight_version: int) -> None:
        """Overlays the HF tensors in `model_path` on the served weights; serves them as `weight_version`."""
        state = jax.tree.map(lambda a: a, self._state)  # new containers; untouched leaves shared
        for key, tensor in _read_hf_tensors(model_path):
            if key not in self._keys:
                raise ValueError(f"{model_path}: tensor {key!r} is not a parameter of the served model")
            entry, idx = self._keys[key]
            leaf = _leaf(state, entry.path)
            want = leaf[idx].shape
            value = tensor.T if entry.transpose else tensor
            if value.shape != want:
                raise ValueError(f"{model_path}: tensor {key!r} has shape {list(tensor.shape)}, the served "
                                 f"model needs {list(want[::-1] if entry.transpose else want)}")
            if leaf is _leaf(self._state, entry.path):  # copy-on-write: the old state stays intact on error
                leaf = leaf.copy()
                _set_leaf(state, entry.path, leaf)
            leaf[idx] = value.astype(leaf.dtype)
        self.engine.update_weights(model_from_state(self.cfg, state), weight_version)
        self._state = state

    def close(self) -> None:
        self.engine.close()


def _read_hf_tensors(path: str):
    index = os.path.join(path, INDEX_NAME)
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{path}: no {INDEX_NAME} (expected a weight-sync directory)")
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    for name in files:
        file = os.path.join(path, name)
        with safe_open(file, "numpy") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _leaf(tree: dict, path: tuple[str, ...]) -> np.ndarray:
    for p in path:
        tree = tree[p]
    return tree


def _set_leaf(tree: dict, path: tuple[str, ...], value) -> None:
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value
