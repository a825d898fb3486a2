"""sglang-jax's offline engine inside this process, serving weights the trainer swaps in device to device.

`SglangJaxEngine` runs sglang-jax's Python `Engine` (sgl_jax/srt/entrypoints/engine.py) with
`enable_single_process=True`: its scheduler is a thread of this process and its model runner holds the
weights as a flat list of device arrays, `ModelRunner.model_state_leaves` (model_runner.py:214), which every
jitted forward reads when it is called (model_runner.py:363, :461). This is how Tunix colocates it
(`tunix/generate/sglang_jax_sampler.py` `update_params`). A weight update here:
  1. waits until no request is in flight and holds new ones back (updates run between rollout phases, so
     every result was produced by one weight version, stamped on each of its tokens);
  2. maps k2jax's state onto sglang-jax's DeepseekV3 parameters with sglang-jax's own HF-name table
     (`DeepseekV3ForCausalLM._create_weight_mappings`) and k2jax's (`k2jax.convert.layout.entries`): layer l
     of a stacked k2jax leaf is one sglang-jax parameter, transposed when exactly one side stores it [out, in];
     expert leaves [L, E, in, out] give the stacked [E, in, out] EPMoE weights;
  3. per k2jax leaf, one jitted copy lays the new arrays out with the dtype and sharding of the arrays they
     replace (no host copy, no file; shapes unchanged, so nothing recompiles) and drops the old ones, so the
     peak is the served weights plus one leaf's worth;
  4. rebinds `model_state_leaves` (as sglang-jax's own LoRA loading does, tp_worker.py:383) and flushes the
     prefix cache, whose KV entries the old weights computed.
With the absorbed-MLA attention (sglang-jax's default `fa` backend) `kv_b_proj` is folded into
`w_uk`/`w_uv` at load (deepseek_v3.py `post_load_weights`); the swap folds it the same way (untested here:
CPU runs the `native` backend, which is not absorbed).

sglang-jax needs Python >= 3.12; it is imported only when an engine is built. Requests go through its
tokenizer manager on the engine's own event-loop thread (`enable_engine_loop_run_forever_daemon`), so
`generate` and `abort` are safe from many threads. docs/rl.md "sglang-jax" has the install.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import functools
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from k2jax.convert.hf import _get
from k2jax.convert.layout import Entry, entries
from k2jax.convert.tokenizer import export_tokenizer
from k2jax.engine.base import Engine, EngineCapabilities, GenerateRequest, GenerateResult, InvalidRequest
from k2jax.engine.http import parse_generate_response
from k2jax.model.config import K2Config

_MOE = "__MOE_EXPERTS__"


@dataclasses.dataclass(frozen=True)
class SglangJaxConfig:
  """Options of the colocated sglang-jax backend only (names as sglang-jax's `ServerArgs`).

  The defaults fit a tiny model on CPU: without small precompile shapes sglang-jax sizes its KV pool and
  compiles for ~35 GB. On TPU raise `mem_fraction_static`, the token budgets and paddings, and use the
  `fa` attention backend.
  """

  device: str = "cpu"  # cpu | tpu | gpu
  tp_size: int = 1  # sglang-jax's mesh: the first tp_size local devices
  dtype: str = "float32"  # served weights and activations (float32 for logprob parity with the trainer)
  attention_backend: str = "native"  # CPU needs native (fa picks absorbed MLA, which native cannot run)
  context_length: int = 512
  mem_fraction_static: float = 0.1
  max_total_tokens: int = 4096
  max_running_requests: int = 8
  chunked_prefill_size: int = 256
  precompile_bs_paddings: tuple[int, ...] = (8,)
  precompile_token_paddings: tuple[int, ...] = (256,)
  deterministic_sampling: bool = True  # honour SamplingParams.seed (sglang-jax ignores sampling_seed otherwise)
  random_seed: int = 0

  def server_args(self, model_path: str) -> dict[str, Any]:
    return dict(
      model_path=model_path,
      device=self.device,
      tp_size=self.tp_size,
      dtype=self.dtype,
      attention_backend=self.attention_backend,
      context_length=self.context_length,
      mem_fraction_static=self.mem_fraction_static,
      max_total_tokens=self.max_total_tokens,
      max_running_requests=self.max_running_requests,
      chunked_prefill_size=self.chunked_prefill_size,
      precompile_bs_paddings=list(self.precompile_bs_paddings),
      precompile_token_paddings=list(self.precompile_token_paddings),
      enable_deterministic_sampling=self.deterministic_sampling,
      random_seed=self.random_seed,
      enable_single_process=True,  # the scheduler is a thread here: its weights are reachable
      enable_engine_loop_run_forever_daemon=True,  # requests from any thread via run_coroutine_threadsafe
      load_format="dummy",  # sglang's random-init load format: no weights read; the first push replaces every parameter
      skip_server_warmup=True,
      trust_remote_code=True,
      log_level="warning",
    )


def write_model_dir(cfg: K2Config, path: str) -> str:
  """An HF directory sglang-jax starts from: config.json and the tokenizer, no weights (they arrive by push)."""
  import json

  os.makedirs(path, exist_ok=True)
  hf_cfg = dict(cfg.to_hf_dict(), torch_dtype=cfg.param_dtype)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2, sort_keys=True)
  export_tokenizer(path, cfg.vocab_size)
  return path


@dataclasses.dataclass(frozen=True)
class _Target:
  """One sglang-jax parameter and where it comes from: `leaf[index]`, last two axes swapped if `transpose`."""

  path: str  # dotted path in sglang-jax's model (WeightMapping.target_path)
  index: tuple[int, ...]  # into the k2jax leaf's leading (layer) axis; () for global leaves
  transpose: bool
  fold: str = ""  # "w_uk" | "w_uv": absorbed MLA, a slice of the reshaped kv_b_proj


class SglangJaxEngine(Engine):
  """`Engine` over sglang-jax's in-process engine; `update_weights_from_params` swaps weights on device."""

  def __init__(self, model: K2Config, model_path: str, config: SglangJaxConfig = SglangJaxConfig()):
    self.cfg, self.config = model, config
    from sgl_jax.srt.entrypoints.engine import Engine as SglEngine  # Python >= 3.12 only

    # sglang-jax installs SIGCHLD (reaps any child: breaks subprocess.wait of the learner's services) and
    # SIGQUIT handlers, and kills this process's whole tree at exit: keep the learner's own.
    saved = {s: signal.getsignal(s) for s in (signal.SIGCHLD, signal.SIGQUIT)}
    try:
      self._sgl = SglEngine(**config.server_args(model_path))
    finally:
      for s, h in saved.items():
        signal.signal(s, h)
    atexit.unregister(self._sgl.shutdown)
    self._runner = self._sgl.scheduler_info["scheduler"].tp_worker.worker.model_runner
    self._loop = self._sgl.loop
    self._tm = self._sgl.tokenizer_manager
    self._cv = threading.Condition()
    self._in_flight: set[str] = set()
    self._updating = False
    self._closed = False
    self._version = 0  # the launch weights (random until the first push)
    self._counters: collections.Counter[str] = collections.Counter()
    self._plan = self._make_plan()
    self._copy_fns: dict[tuple[str, ...], Any] = {}

  # ---- Engine --------------------------------------------------------------------------------------
  def capabilities(self) -> EngineCapabilities:
    from sgl_jax.version import __version__

    return EngineCapabilities(
      server="sglang-jax",
      server_version=f"{__version__} (colocated)",
      weight_update=("disk", "tensors"),
      reports_weight_version=True,
      seeded_sampling=self.config.deterministic_sampling,
      abort=True,
    )

  def generate(self, request: GenerateRequest) -> GenerateResult:
    with self._cv:
      self._cv.wait_for(lambda: not self._updating or self._closed)
      if self._closed:
        raise RuntimeError("SglangJaxEngine is closed")
      if request.rid in self._in_flight:
        raise InvalidRequest("rid", f"{request.rid} is already in flight")
      self._in_flight.add(request.rid)
      version = self._version
    try:
      body = asyncio.run_coroutine_threadsafe(self._generate(request), self._loop).result()
    except ValueError as e:  # sglang-jax's own request validation (tokenizer_manager: too long, bad params)
      raise InvalidRequest("input_ids", f"sglang-jax refused request {request.rid}: {e}") from e
    finally:
      with self._cv:
        self._in_flight.discard(request.rid)
        self._cv.notify_all()
    result = parse_generate_response(body, request, self._count)  # its replies have the /generate shape
    return dataclasses.replace(result, weight_versions=(version,) * len(result.output_ids))

  def metrics(self) -> dict[str, int]:
    with self._cv:
      return dict(self._counters)

  def _count(self, name: str) -> None:
    if name != "replies_without_weight_version":  # versions are this adapter's own: it swapped the weights
      with self._cv:
        self._counters[name] += 1

  def abort(self, rids: Sequence[str], pending: Callable[[str], bool] | None = None) -> None:
    """Non-blocking. `pending(rid)`: the caller has handed `rid` to `generate` on another thread, which may
    not have reached this engine yet; the abort then waits for it instead of being dropped."""
    for rid in rids:
      asyncio.run_coroutine_threadsafe(self._abort(rid, pending), self._loop)

  def update_weights(self, model_path: str, weight_version: int) -> None:
    """Loads a whole HF directory or k2jax workdir of the served architecture (through device memory)."""
    from flax import nnx

    from k2jax import api
    from k2jax.convert.overlay import is_partial_hf_dir

    if is_partial_hf_dir(model_path):
      raise ValueError(f"{model_path}: a delta push; the colocated sglang-jax engine takes device arrays instead")
    model = api.load(model_path, param_dtype=self.cfg.param_dtype, compute_dtype=self.cfg.compute_dtype)
    if model.cfg.replace(extra=()) != self.cfg.replace(extra=()):
      raise ValueError(f"{model_path}: its config.json describes a different architecture than the served model")
    self.update_weights_from_params(nnx.to_pure_dict(nnx.state(model)), weight_version)

  def update_weights_from_params(
    self, params: dict, weight_version: int, *, only: set[tuple[str, ...]] | None = None, flush_cache: bool = True
  ) -> int:
    """Serves `params` (k2jax's pure state dict, device arrays on any placement) from the next request on.

    Waits for in-flight requests to finish (abort them first to hurry it), swaps every parameter on device
    (with `only`: just the sglang-jax parameters made from these k2jax leaf paths; a delta push), flushes
    the prefix cache unless told not to; every token generated afterwards carries `weight_version`.
    """
    with self._cv:
      self._cv.wait_for(lambda: not self._updating)
      self._updating = True
      self._cv.wait_for(lambda: not self._in_flight)
    try:
      self._swap(params, only)
      if flush_cache:
        self._flush_cache()
      with self._cv:
        self._version = weight_version
    finally:
      with self._cv:
        self._updating = False
        self._cv.notify_all()
    return weight_version

  def close(self) -> None:
    with self._cv:
      if self._closed:
        return
      self._closed = True
      self._cv.notify_all()
    self._loop.call_soon_threadsafe(functools.partial(self._tm.abort_request, abort_all=True))

  # ---- requests -------------------------------------------------------------------------------------
  async def _generate(self, request: GenerateRequest) -> dict:
    from sgl_jax.srt.managers.io_struct import GenerateReqInput

    s = request.sampling
    sampling = {
      "max_new_tokens": s.max_new_tokens,
      "temperature": s.temperature,
      "top_p": s.top_p,
      "top_k": s.top_k if s.top_k >= 1 else -1,  # sglang-jax: -1 = no limit, 0 is refused
      "stop_token_ids": list(s.stop_token_ids),
      "ignore_eos": s.ignore_eos,
    }
    if s.stop:
      sampling["stop"] = list(s.stop)
    if s.seed is not None:
      sampling["sampling_seed"] = s.seed
    obj = GenerateReqInput(
      input_ids=list(request.input_ids), sampling_params=sampling, return_logprob=True, rid=request.rid, stream=False
    )
    return await self._tm.generate_request(obj, None).__anext__()

  async def _abort(self, rid: str, pending: Callable[[str], bool] | None = None) -> None:
    """sglang-jax ignores an abort for a rid its tokenizer manager has not registered yet (it tokenizes
    first): wait for the rid while the request is still in flight here (or about to be: `pending`)."""
    for _ in range(500):
      if rid in self._tm.rid_to_state:
        self._tm.abort_request(rid=rid)
        return
      with self._cv:
        flying = rid in self._in_flight
      if not flying and not (pending is not None and pending(rid)):
        return
      await asyncio.sleep(0.01)

  def flush_cache(self) -> None:
    self._flush_cache()

  def _flush_cache(self) -> None:
    """The radix cache holds KV entries of the old weights; the scheduler flushes only when idle."""
    for _ in range(100):
      out = asyncio.run_coroutine_threadsafe(self._tm.flush_cache(), self._loop).result()
      if getattr(out, "success", True):
        return
      threading.Event().wait(0.05)
    raise RuntimeError("sglang-jax did not flush its prefix cache after a weight update (requests still running?)")

  # ---- weights --------------------------------------------------------------------------------------
  def _make_plan(self) -> list[tuple[Entry, list[_Target]]]:
    """[(k2jax leaf, the sglang-jax parameters made from it)], from both sides' HF name tables."""
    sgl_model = self._runner.model
    mappings = sgl_model._create_weight_mappings(self._runner.model_config)
    source = {key: (e, idx) for e in entries(self.cfg) for idx, key in e.keys(self.cfg)}
    per_leaf: dict[tuple[str, ...], tuple[Entry, list[_Target]]] = {}
    used = set()
    for hf_key, m in mappings.items():
      for field in ("transpose_axes", "reshape", "repeat", "physical_to_logical_map"):
        if getattr(m, field, None) is not None:
          raise ValueError(f"the colocated swap refuses sglang-jax's {field}={getattr(m, field)!r} mapping of {hf_key}")
      if getattr(m, "kv_head_padding", False) or getattr(m, "head_dim_padding", False):
        raise ValueError(f"the colocated swap refuses {hf_key}: sglang-jax pads its heads (serve it over HTTP instead)")
      if hf_key.startswith(_MOE):
        path, *keys = m.target_path
        srcs = [source.get(k) for k in keys]
        if None in srcs or len({(s[0].path, s[1][0]) for s in srcs}) != 1:
          raise ValueError(f"sglang-jax's {path} stacks {keys[:2]}..., which are not one k2jax expert leaf")
        if [s[1][1] for s in srcs] != list(range(len(srcs))):
          raise ValueError(f"sglang-jax's {path} stacks experts out of order")
        entry, index = srcs[0][0], srcs[0][1][:1]
        used.update(keys)
      else:
        if hf_key not in source:
          raise ValueError(f"sglang-jax loads {hf_key}, which k2jax's model {self.cfg} does not have")
        (entry, index), path = source[hf_key], m.target_path
        used.add(hf_key)
      targets = [_Target(path, index, entry.transpose != m.transpose)]
      if path.endswith("self_attn.kv_b_proj.weight") and _resolve(sgl_model, path) is None:  # absorbed MLA
        base = path.rsplit(".", 2)[0]
        targets = [dataclasses.replace(targets[0], path=f"{base}.{w}", fold=w) for w in ("w_uk", "w_uv")]
      per_leaf.setdefault(entry.path, (entry, []))[1].extend(targets)
    missing = sorted(set(source) - used)
    if missing:
      raise ValueError(f"sglang-jax's DeepseekV3 has no parameter for k2jax's {missing[:4]} ({len(missing)} in all)")
    return list(per_leaf.values())

  def _swap(self, params: dict, only: set[tuple[str, ...]] | None = None) -> None:
    sgl_model = self._runner.model
    leaves = list(self._runner.model_state_leaves)
    self._runner.model_state_leaves = leaves  # a new list: dispatchers that cache the old one drop it
    position = {id(x): i for i, x in enumerate(leaves)}
    for entry, targets in self._plan:
      if only is not None and entry.path not in only:
        continue
      variables = [_resolve(sgl_model, t.path) for t in targets]
      outs = self._copy_fn(entry, targets, variables)(_get(params, entry.path))
      for var, new in zip(variables, outs):
        i = position.pop(id(var.get_value()))
        var.set_value(new)
        leaves[i] = new
    jax.block_until_ready(leaves)  # the update is over when it returns (and timings mean what they say)

  def _copy_fn(self, entry: Entry, targets: list[_Target], variables: list) -> Any:
    """jit: k2jax leaf -> its sglang-jax arrays, each in the dtype and sharding of the array it replaces."""
    fn = self._copy_fns.get(entry.path)
    if fn is not None:
      return fn
    olds = [v.get_value() for v in variables]
    cfg = self.cfg

    def convert(leaf):
      outs = []
      for t, old in zip(targets, olds):
        x = leaf[t.index] if t.index else leaf
        if t.transpose:
          x = jnp.swapaxes(x, -1, -2)
        if t.fold:  # kv_b_proj [R, H*(K+V)] -> w_uk [R, H, K] / w_uv [R, H, V]
          nope = cfg.qk_nope_head_dim
          x = x.reshape(x.shape[0], cfg.num_attention_heads, nope + cfg.v_head_dim)
          x = x[..., :nope] if t.fold == "w_uk" else x[..., nope:]
        if x.shape != old.shape:
          raise ValueError(f"{t.path}: k2jax gives {x.shape}, sglang-jax serves {old.shape}")
        outs.append(x.astype(old.dtype))
      return tuple(outs)

    fn = self._copy_fns[entry.path] = jax.jit(convert, out_shardings=tuple(o.sharding for o in olds))
    return fn


def _resolve(module: Any, path: str) -> Any:
  """The attribute at dotted `path` of an nnx module tree (integers index lists); None where it is None."""
  node = module
  for key in path.split("."):
    node = node[int(key)] if key.isdigit() else getattr(node, key, None)
    if node is None:
      return None
  return node
