"""The in-process JAX engine: continuous batching over fixed slots, prefix reuse, aborts, weight swaps.

It implements `Engine` directly: the HTTP server (`k2jax.serve`), RL rollouts and agentic episodes call
the same object. One scheduler thread owns the model and the cache. Callers (HTTP handlers, RL rollout
threads) `submit` requests and wait on them (`generate` does both). Each scheduler iteration, between
two decode steps:
  1. runs queued control operations (weight swap, cache flush),
  2. finishes requests whose abort was asked for (they return their partial output),
  3. admits waiting requests into free slots (`admission.py`): copy the longest cached prefix, prefill the
     rest (all the requests admitted in this step in one program), sample the first token,
  4. runs one decode step over all slots and appends one token to each running request.
Requests therefore join and leave between decode steps, while the decode step keeps one shape.

On a serving mesh (`EngineConfig.sharding` = tp | ep | tp_ep, `placement.py`) the weights and the cache
are sharded and every step is one SPMD program. A mesh that spans JAX processes runs the scheduler on
process 0 only; its device work goes out as a command stream that every other process's loop receives
and runs (`lockstep.py`), so all issue identical programs. Requests are submitted on process 0.

Colocated RL (the engine on the trainer's devices) alternates phases: `pause()` (every process; the loops
stop issuing programs, so the trainer's own collectives cannot interleave with them), `release_memory()`
(the KV cache and prefix rows freed, the served weights dropped), the update, `update_weights_from_params`
(the new weights resharded onto the serving layout), `resume()` (a fresh cache; the loops step again).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from k2jax import api
from k2jax.convert import overlay
from k2jax.convert.export_dir import recover
from k2jax.engine.admission import Admission
from k2jax.engine.base import Engine, GenerateRequest, GenerateResult, InvalidRequest
from k2jax.engine.lockstep import CLOSE, Executor
from k2jax.engine.placement import make_placement
from k2jax.engine.prefix_cache import PrefixCache
from k2jax.engine.requests import Live, check_request, finish_reason, sampling_of
from k2jax.engine.runner import ModelRunner
from k2jax.model.transformer import K2Model

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_slots: int = 8  # requests decoded together (the decode batch)
  max_seq_len: int = 2048  # prompt + generated tokens per request (cache row length)
  min_prefill_bucket: int = 16  # prefill lengths are padded to min_bucket * 2^i
  # The requests admitted in one step are prefilled together, their count padded to a power of two (<=
  # max_slots): at most this many padded tokens (rows * length) per batch (SGLang's --max-prefill-tokens);
  # 0 = max(max_seq_len, max_slots * min_prefill_bucket). A longer request runs alone.
  max_prefill_tokens: int = 0
  prefix_cache_entries: int = 16  # finished sequences kept for prefix reuse (0 disables)
  num_top_logprobs: int = 8  # top logprobs reported per token
  # Compile every prefill bucket (rows x length, `ModelRunner.prefill_buckets`) and the decode step before
  # serving, as SGLang's servers do: a request
  # never waits behind a compile, and an abort never waits for one (a compile cannot be interrupted).
  precompile: bool = False
  # Also compile the scored prefill's buckets (prompt logprobs with one top logprob: likelihood scoring,
  # lm-eval's `echo` + `logprobs: 1`), so scoring requests never wait behind a compile either.
  precompile_scored: bool = False
  # Serving layout: '' = this process's first device; 'tp' | 'ep' | 'tp_ep' = k2jax.sharding's serving
  # presets over `mesh` ("tensor:4,data:2"; '' = the preset's default over every device of every process).
  sharding: str = ""
  mesh: str = ""


class InferenceEngine(Admission, Engine):
  """Serves one K2 model. Thread-safe: `submit`/`generate`/`abort`/`update_weights` from any thread."""

  def __init__(
    self,
    model: K2Model,
    config: EngineConfig = EngineConfig(),
    *,
    eos_token_ids: Sequence[int] = (),
    detokenize: Callable[[list[int]], str] | None = None,
    paused: bool = False,
  ):
    """`paused`: start between phases (`resume()` starts stepping); with several processes sharing the
    mesh, every process constructs its engine at the same point of the program."""
    max_len = min(config.max_seq_len, model.cfg.max_position_embeddings)
    self.config = dataclasses.replace(config, max_seq_len=max_len)
    self.cfg = model.cfg
    self.eos_token_ids = tuple(eos_token_ids)
    self._detokenize = detokenize
    placement = make_placement(config.sharding, config.mesh)
    check_shards(self.config, placement.batch_shards)
    self._runner = ModelRunner(
      model,
      num_slots=config.max_slots,
      max_len=max_len,
      num_top=config.num_top_logprobs,
      min_bucket=config.min_prefill_bucket,
      max_prefill_tokens=config.max_prefill_tokens,
      placement=placement,
    )
    multi = placement.mesh is not None and jax.process_count() > 1
    self.leader = not multi or jax.process_index() == 0
    self._multi = multi
    self._exec = Executor(
      self._runner,
      prefix_entries=config.prefix_cache_entries,
      leader=self.leader,
      processes=jax.process_count() if multi else 1,
    )
    self._exec.on_update = self._update_everywhere
    self._next_entry = 0
    if config.precompile or config.precompile_scored:
      t0 = time.monotonic()
      self._runner.precompile(plain=config.precompile, scored=config.precompile_scored)
      log.info("precompiled prefill buckets (scored: %s) in %.1f s", config.precompile_scored, time.monotonic() - t0)
    self._update_lock = threading.Lock()  # one weight update at a time (the overlay reads the served params)
    self._prefix = PrefixCache(config.prefix_cache_entries)
    self._cv = threading.Condition()
    self._waiting: collections.deque[Live] = collections.deque()
    self._slots: list[Live | None] = [None] * config.max_slots
    self._by_rid: dict[str, Live] = {}
    self._ops: list[tuple[Callable[[], object], dict]] = []
    self._closed = False
    self._paused, self._pause_asked = paused, False
    self._device = threading.Lock()  # held by the loop for a step, by direct (paused) control operations
    self.weight_version = 0
    self._thread = threading.Thread(target=self._loop, name="k2jax-engine", daemon=True)
    self._thread.start()

  # ---- public API -------------------------------------------------------------------------------
  def submit(self, request: GenerateRequest, on_update: Callable[[], None] | None = None) -> Live:
    """Queues `request` and returns its handle for `wait`/`progress` (raises InvalidRequest for one that
    cannot run). `on_update` (optional) is called from the scheduler after every new token and when the
    request finishes (streaming, disconnect checks), and must not block."""
    if not self.leader:
      raise RuntimeError(f"process {jax.process_index()} follows process 0's engine: submit requests on process 0")
    self.check(request)
    s = request.sampling
    seed = secrets.randbits(32) if s.seed is None else s.seed % 2**32
    live = Live(request, seed=seed, t0=time.monotonic(), on_update=on_update)
    with self._cv:
      if self._closed:
        raise RuntimeError("engine is closed")
      if request.rid in self._by_rid:
        raise InvalidRequest("rid", f"request {request.rid!r} is already in flight")
      self._by_rid[request.rid] = live
      if s.max_new_tokens == 0 and request.logprob_start_len < 0:  # nothing to compute
        self._complete(live, "length")
      else:
        self._waiting.append(live)
        self._cv.notify_all()
    return live

  def submit_many(
    self, requests: Sequence[GenerateRequest], on_updates: Sequence[Callable[[], None] | None] | None = None
  ) -> list[Live | Exception]:
    """`submit` of each request, all queued before the scheduler looks (one lock held), so the ones that fit
    are admitted in one step and prefilled in one program, not the first alone while the rest are still
    being submitted. Per request: its handle, or the InvalidRequest/RuntimeError `submit` raised for it."""
    out: list[Live | Exception] = []
    with self._cv:  # an RLock: `submit` takes it again
      for i, request in enumerate(requests):
        try:
          out.append(self.submit(request, on_updates[i] if on_updates is not None else None))
        except (InvalidRequest, RuntimeError) as e:
          out.append(e)
    return out

  def wait(self, live: Live, timeout: float | None = None) -> GenerateResult:
    """The finished request's result; raises RuntimeError when the engine failed while running it."""
    if not live.done.wait(timeout):
      raise TimeoutError(f"request {live.request.rid!r} not finished after {timeout}s")
    if live.error is not None:
      raise RuntimeError(f"engine failed on request {live.request.rid!r}: {live.error}")
    return live.result

  def progress(self, live: Live) -> GenerateResult:
    """The request so far (finish_reason None while it runs); its final result once done."""
    return live.result if live.done.is_set() else live.snapshot(time.monotonic())

  def generate(self, request: GenerateRequest) -> GenerateResult:
    return self.wait(self.submit(request))

  def abort(self, rids: Sequence[str]) -> int:
    """Asks these requests to return now (finish_reason abort); returns how many were in flight."""
    with self._cv:
      targets = [self._by_rid[rid] for rid in rids if rid in self._by_rid]
      self._abort(targets, "Aborted by request")
    return len(targets)

  def abort_all(self) -> int:
    with self._cv:
      targets = list(self._by_rid.values())
      self._abort(targets, "Aborted (abort_all)")
    return len(targets)

  def update_weights(self, model_path: str, weight_version: int | None = None, *, flush_cache: bool = True) -> int:
    """Serves the weights in `model_path` from the next decode step on; returns the new weight version.

    `model_path` is a weight-sync delta (an HF safetensors index without config.json, holding only the
    tensors that changed: they replace those tensors of the served weights), or a whole HF directory
    or k2jax workdir of the same architecture. A failed load raises and changes nothing. On a mesh of
    several processes, process 0 takes the update while serving: it goes to every process in the command
    stream, each reads its own shards from `model_path` (on a filesystem they share), and the new weights
    serve only if every process read them. Paused (colocated RL phases), every process calls it itself.
    """
    if self._multi and not self._paused:
      if not self.leader:
        raise RuntimeError("update_weights while serving on several processes: call it on process 0 (it leads)")

      def send():
        version = self.weight_version + 1 if weight_version is None else int(weight_version)
        return self._exec.update(model_path, version, flush_cache)

      with self._update_lock:
        return self._run_op(send)
    with self._update_lock:
      return self._swap(self._read_weights(model_path), weight_version, flush_cache)

  def _read_weights(self, path: str) -> dict:
    """The weights in `path` on the served shardings (this process reads only its own shards)."""
    int4_served = self.cfg.expert_storage == "int4"
    if overlay.is_partial_hf_dir(path):
      if int4_served:
        raise ValueError(
          f"{path}: a weight-sync delta; an engine serving INT4 experts (expert_storage='int4') takes whole "
          "checkpoints or pushed params (update_weights_from_params)"
        )
      return overlay.overlay_hf_tensors(self.cfg, self._runner.params(), path)
    recover(path)  # an export that died between its two renames (as k2jax.load)
    # INT4-served experts are read as float (an INT4 release dequantized exactly) and quantized on arrival
    # (`ModelRunner.set_params`): the same codes, as the release is on the grid
    exec_fields = dict(
      param_dtype=self.cfg.param_dtype, compute_dtype=self.cfg.compute_dtype, expert_qat=self.cfg.expert_qat
    )
    cfg = api.source_config(path, **exec_fields)
    if cfg.replace(extra=(), expert_storage=self.cfg.expert_storage) != self.cfg.replace(extra=()):
      raise ValueError("its config.json describes a different architecture than the served model")
    shardings = None if int4_served else self._runner._pure_shardings()
    return api.source_state(path, cfg, shardings if isinstance(shardings, dict) else None)

  def _update_everywhere(self, path: str, version: int, flush_cache: bool) -> int:
    """A lockstep UPDATE, on every process: read, agree that every process has the new weights, swap."""
    try:
      params, error = self._read_weights(path), None
    except Exception as e:  # reported after the others have said how their reads went
      params, error = None, e
    from jax.experimental import multihost_utils

    failed = np.flatnonzero(multihost_utils.process_allgather(np.int32(error is not None))).tolist()
    if error is not None:
      raise error
    if failed:
      raise ValueError(f"process(es) {failed} could not read {path} (their logs say why); the old weights serve on")
    self._runner.set_params(params)
    if flush_cache:
      self._prefix.clear()
      self._exec.rows.clear()  # every process drops its prefix rows alike (no KEEP command from inside one)
    self.weight_version = version
    return version

  @property
  def shares_pushed_buffers(self) -> bool:
    """Whether pushed arrays may be served as they are (one device: the trainer's own buffers). On a
    serving mesh the engine holds its own copy in the serving layout, so the trainer may donate its."""
    return self._runner.placement.mesh is None

  def update_weights_from_params(
    self, params: dict, weight_version: int | None = None, *, flush_cache: bool = True
  ) -> int:
    """Serves `params` (the model's pure state dict, k2jax layout) from the next decode step on.

    Arrays already on the served devices are served as they are (others are resharded onto them): a
    colocated trainer hands its weights over with no copy and no file. The engine then reads these
    arrays until the next update, so the trainer must not donate them to a later step (unless
    `shares_pushed_buffers` is False). With several processes: every process calls it, while paused.
    """
    if self._multi and not self._paused:
      raise RuntimeError(
        "update_weights_from_params on a multi-process mesh: pause() the engine on every process first"
      )
    with self._update_lock:
      return self._swap(params, weight_version, flush_cache)

  def flush_cache(self) -> None:
    self._run_op(self._clear_prefix)

  def _clear_prefix(self) -> None:
    self._prefix.clear()
    if self._paused:  # every process runs this itself (no command stream between phases)
      self._exec.rows.clear()
    else:
      self._exec.keep(())

  # ---- phases (colocated RL) --------------------------------------------------------------------
  def pause(self) -> None:
    """Stops issuing device programs after the current step (running requests stay in their slots; new
    ones wait). Every process of a multi-process mesh calls it; it returns once this process's loop
    has stopped."""
    with self._cv:
      if self.leader:
        self._pause_asked = True
        self._cv.notify_all()
      while not (self._paused or self._closed):
        self._cv.wait()

  def resume(self) -> None:
    """Steps again (a fresh KV cache when `release_memory` freed it). Every process calls it."""
    with self._device:
      if self._runner._state is None:
        raise RuntimeError("resume: the engine has no weights since release_memory(); update_weights_from_params first")
      self._runner.allocate_cache()
    with self._cv:
      self._paused = False
      self._cv.notify_all()

  def release_memory(self, *, weights: bool = True) -> None:
    """Frees the KV cache and the prefix rows now, and drops the served weights (`weights`), between
    phases: paused, with no request in a slot. The next push and `resume()` bring them back."""
    with self._cv:
      if not self._paused:
        raise RuntimeError("release_memory: pause() the engine first")
      busy = [live.request.rid for live in self._slots if live is not None]
      if busy:
        raise RuntimeError(f"release_memory: requests {busy[:5]} are still in slots; abort and wait for them first")
    with self._device:
      self._prefix.clear()
      for row in self._exec.rows.values():
        for a in jax.tree.leaves(row):
          a.delete()
      self._exec.rows.clear()
      self._runner.release_cache()
      if weights:
        self._runner.release_params()

  def num_running(self) -> int:
    with self._cv:
      return len(self._by_rid)

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()
    self._thread.join(timeout=None if self._multi else 60)  # a follower leaves when the leader's CLOSE comes

  def wait_closed(self, timeout: float | None = None) -> bool:
    """Blocks until the engine's loop has ended (a follower's: when the leader closes); True if it has."""
    self._thread.join(timeout)
    return not self._thread.is_alive()

  @property
  def closed(self) -> bool:
    """Whether `close()` ran (on a follower: or the leader's close reached it). A follower whose loop ended
    and that is not closed stopped on an error."""
    return self._closed

  def _abort(self, targets: list[Live], message: str) -> None:
    """Marks `targets` aborted (caller holds the lock); waiting ones finish now, running ones next step."""
    for live in targets:
      live.abort_message = message
      if live in self._waiting:
        self._waiting.remove(live)
        self._complete(live, "abort")
    self._cv.notify_all()

  def _swap(self, params: dict, weight_version: int | None, flush_cache: bool) -> int:
    """Swaps in `params` between decode steps. Running requests continue on the new weights (SGLang's
    default); every token records the version that produced it. The prefix cache holds keys computed by
    the old weights, so it is flushed unless asked otherwise."""

    def swap():
      self._runner.set_params(params)
      if flush_cache:
        self._clear_prefix()
      self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
      return self.weight_version

    return self._run_op(swap)

  # ---- scheduler --------------------------------------------------------------------------------
  def _loop(self) -> None:
    if not self.leader:
      return self._follow()
    while True:
      with self._cv:
        while not (
          self._closed or self._pause_asked or (not self._paused and (self._waiting or self._ops or any(self._slots)))
        ):
          self._cv.wait()
        if self._closed:
          if self._multi and not self._paused:
            self._exec.close()  # the followers' loops return
          self._fail_all("engine shut down")
          return
        if self._pause_asked:
          self._pause_asked = False
          if not self._paused and self._multi:
            self._exec.pause()
          self._paused = True
          self._cv.notify_all()
          continue
        ops, self._ops = self._ops, []
      try:
        with self._device:
          for fn, box in ops:
            self._run_boxed(fn, box)
          self._finish_aborted()
          self._admit()
          if any(self._slots):
            self._decode_step()
      except Exception as e:  # a failed step must not strand waiting callers
        log.exception("engine step failed")
        with self._cv:
          self._fail_all(f"engine error: {type(e).__name__}: {e}")

  def _follow(self) -> None:
    """A follower's loop: run process 0's commands while not paused (lockstep.py)."""
    while True:
      with self._cv:
        while self._paused and not self._closed:
          self._cv.wait()
        if self._closed and self._paused:
          return
      with self._device:
        kind = self._exec.follow()
      with self._cv:
        self._paused = True
        self._closed = self._closed or kind == CLOSE
        self._cv.notify_all()
        if kind == CLOSE:
          return

  def _decode_step(self) -> None:
    n = self.config.max_slots
    tokens_N, positions_N = np.zeros(n, np.int32), np.full(n, self.config.max_seq_len, np.int32)
    for i, live in enumerate(self._slots):
      if live is not None:
        tokens_N[i], positions_N[i] = live.out[-1], len(live.fed)
    out = self._exec.decode(tokens_N, positions_N, sampling_of(self._slots))
    for i, live in enumerate(self._slots):
      if live is not None:
        live.fed.append(live.out[-1])
        self._emit(i, live, out, i)

  def _emit(self, slot: int, live: Live, out, i: int) -> None:
    """Appends row i's sampled token to `live`; finishes the request when a stop condition holds. An error
    here (e.g. a stop string this request's detokenizer chokes on) fails this request alone."""
    try:
      token = live.append(out, i, self.weight_version)
      finish = finish_reason(live, token, self.eos_token_ids, self._detokenize)
      if finish is not None:
        self._release(slot, live, *finish)
      else:
        live.notify()
    except Exception as e:
      log.exception("request %s failed", live.request.rid)
      with self._cv:
        self._fail(live, slot, f"engine error: {type(e).__name__}: {e}")

  def _finish_aborted(self) -> None:
    for i, live in enumerate(self._slots):
      if live is not None and live.abort_message is not None:
        self._release(i, live, "abort")

  def _release(self, slot: int, live: Live, reason: str, matched: int | str | None = None) -> None:
    # The row goes to a prefix entry (on every process); not a row that scored its prompt: scored prompts run
    # whole (no scored request reuses a prefix), and likelihood evaluation sends them by the thousand, which
    # would evict the prefixes generation requests share (and cost a row copy each).
    if self._prefix.capacity and live.fed and live.request.logprob_start_len < 0:
      entry, self._next_entry = self._next_entry, self._next_entry + 1
      self._exec.save(slot, entry)
      self._prefix.insert(live.fed, entry)
      self._exec.keep(self._prefix.values())
    with self._cv:
      self._slots[slot] = None
      self._complete(live, reason, matched)

  def _complete(self, live: Live, reason: str, matched: int | str | None = None) -> None:
    """Publishes the result (caller holds the lock)."""
    live.result = live.snapshot(time.monotonic(), reason, matched)
    self._by_rid.pop(live.request.rid, None)
    live.done.set()
    live.notify()

  def _fail(self, live: Live, slot: int | None, message: str) -> None:
    """Fails one request (caller holds the lock): `wait` raises, `progress` shows an abort with `message`."""
    live.drop_partial()  # a step may have failed midway
    live.error = live.abort_message = message
    if slot is not None:
      self._slots[slot] = None
    self._complete(live, "abort")

  def _fail_all(self, message: str) -> None:
    for live in list(self._waiting) + [s for s in self._slots if s is not None]:
      self._fail(live, None, message)
    self._waiting.clear()
    self._slots = [None] * self.config.max_slots
    for fn, box in self._ops:
      box["error"] = RuntimeError(message)
      box["done"].set()
    self._ops = []

  # ---- control operations -------------------------------------------------------------------------
  def _run_op(self, fn: Callable[[], object]):
    box = {"done": threading.Event()}
    with self._cv:
      if self._closed:
        raise RuntimeError("engine is closed")
      direct = self._paused  # between phases the loop issues nothing: run here (on every process)
      if not direct:
        self._ops.append((fn, box))
        self._cv.notify_all()
    if direct:
      with self._device:
        return fn()
    box["done"].wait()
    if "error" in box:
      raise box["error"]
    return box.get("result")

  @staticmethod
  def _run_boxed(fn, box) -> None:
    try:
      box["result"] = fn()
    except Exception as e:  # handed back to the caller of _run_op
      box["error"] = e
    box["done"].set()

  def check(self, request: GenerateRequest) -> None:
    """Raises InvalidRequest naming the field when the engine cannot run `request` (nothing is queued)."""
    check_request(request, self.config.max_seq_len, self.cfg.vocab_size, self._detokenize is not None)
    if request.logprob_start_len >= 0 and (self._multi or not self._runner.scores_prompts):
      raise InvalidRequest(
        "logprob_start_len", "prompt logprobs need a single-device engine; this one serves on a mesh"
      )


def check_shards(config: EngineConfig, shards: int) -> None:
  """Each step's tokens (slots at decode, a prefill bucket) are split over `shards` devices."""
  for name in ("max_slots", "min_prefill_bucket", "max_seq_len"):
    if getattr(config, name) % shards:
      raise ValueError(
        f"EngineConfig.{name}={getattr(config, name)} is not a multiple of the {shards} devices the serving "
        f"preset {config.sharding!r} splits requests over (mesh {config.mesh or 'default'})"
      )
