"""The one engine vocabulary: sampling parameters, requests, results, and the `Engine` interface.

An engine turns token ids into sampled continuations. Implementations: the in-process JAX engine
(`inference.py`), SGLang-compatible servers over HTTP (`http.py`, `routed.py`), and a scripted fake for
tests and benchmarks (`fake.py`). The HTTP server (`k2jax.serve`), RL rollouts and agentic episodes all
speak these types.

Conventions: token-in/token-out (reference §4.1): requests carry `input_ids`, never re-templated text;
`GenerateResult` holds one logprob and one weight version per generated token; version `UNKNOWN_VERSION`
(-1) marks tokens whose server did not report which weights produced them (never a guessed one). Bad requests raise
`InvalidRequest` naming the SGLang field, which the HTTP layer answers with 400.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal, Sequence

FinishType = Literal["stop", "length", "abort"]
FINISH_TYPES: tuple[str, ...] = ("stop", "length", "abort")
UNKNOWN_VERSION = -1  # a token whose engine did not confirm its weight version


class InvalidRequest(ValueError):
  """A request an engine cannot run; `field` names the offending SGLang request field."""

  def __init__(self, field: str, problem: str):
    super().__init__(f"{field}: {problem}")
    self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """SGLang's `sampling_params` (reference §2.2) as far as k2jax engines implement them."""

  max_new_tokens: int = 128
  temperature: float = 1.0  # 0 = greedy
  top_p: float = 1.0
  top_k: int = -1  # <= 0: no limit
  stop: tuple[str, ...] = ()  # stop strings (need a detokenizer in the engine)
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  seed: int | None = None  # SGLang `sampling_seed`: per-sample seeds keep resumed samples reproducible.

  def __post_init__(self):
    if self.max_new_tokens < 0:
      raise InvalidRequest("sampling_params.max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise InvalidRequest("sampling_params.temperature", f"must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise InvalidRequest("sampling_params.top_p", f"must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
  """One sampling request. `rid` must be unique among in-flight requests (used by `abort`)."""

  rid: str
  input_ids: tuple[int, ...]
  sampling: SamplingParams = SamplingParams()
  # SGLang's `logprob_start_len`: -1 = no prompt logprobs; p >= 0 = the logprob of every prompt token from
  # position p on (given the tokens before it; position 0 has none), computed in the request's prefill.
  logprob_start_len: int = -1
  # Top logprobs wanted at those prompt positions (-1: the engine's `num_top_logprobs`). The scored program
  # computes one or all of them: lm-eval asks for 1 (is the continuation greedy), and top-k over the vocab
  # at every prompt position costs as much as the forward itself.
  input_top_logprobs_num: int = -1

  def __post_init__(self):
    if not self.rid:
      raise InvalidRequest("rid", "must be a non-empty string")
    if len(self.input_ids) == 0:
      raise InvalidRequest("input_ids", f"request {self.rid}: the prompt is empty")
    if self.logprob_start_len < -1:
      raise InvalidRequest("logprob_start_len", f"must be -1 (none) or >= 0, got {self.logprob_start_len}")
    if self.input_top_logprobs_num < -1:
      raise InvalidRequest("input_top_logprobs_num", f"must be -1 (all) or >= 0, got {self.input_top_logprobs_num}")
    if self.logprob_start_len >= len(self.input_ids):
      raise InvalidRequest(
        "logprob_start_len",
        f"{self.logprob_start_len} is beyond the prompt of {len(self.input_ids)} tokens (at most {len(self.input_ids) - 1})",
      )


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """What an engine returns for one request; the per-token tuples have one entry per output token.

  `matched_stop` is the stop token id or stop string that ended a "stop" request (SGLang's
  `finish_reason.matched`); `abort_message` says why an "abort" request ended. `top_logprobs`
  (per token: (token id, logprob) pairs, most likely first) and `cached_tokens` (prompt tokens
  served from the prefix cache) are filled by engines that report them, empty/0 otherwise;
  `input_logprobs` only for a request with `logprob_start_len >= 0`.
  """

  rid: str
  output_ids: tuple[int, ...]
  output_logprobs: tuple[float, ...]
  weight_versions: tuple[int, ...]  # policy version that produced each output token
  finish_reason: FinishType | None  # None only in a running request's snapshot (`InferenceEngine.progress`)
  prompt_tokens: int
  text: str | None = None
  matched_stop: int | str | None = None
  abort_message: str | None = None
  top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
  cached_tokens: int = 0
  latency_s: float = 0.0
  # Prompt tokens from the request's logprob_start_len on: each one's logprob (None for position 0, which
  # has no context) and its position's top logprobs ((token id, logprob) pairs, most likely first).
  input_logprobs: tuple[float | None, ...] = ()
  input_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()

  def __post_init__(self):
    n = len(self.output_ids)
    if len(self.output_logprobs) != n or len(self.weight_versions) != n:
      raise ValueError(
        f"GenerateResult {self.rid}: {n} output_ids but {len(self.output_logprobs)} logprobs and "
        f"{len(self.weight_versions)} weight versions"
      )
    if self.top_logprobs and len(self.top_logprobs) != n:
      raise ValueError(f"GenerateResult {self.rid}: {len(self.top_logprobs)} top_logprobs rows for {n} output_ids")
    if self.finish_reason is not None and self.finish_reason not in FINISH_TYPES:
      raise ValueError(f"GenerateResult {self.rid}: finish_reason {self.finish_reason!r} not in {FINISH_TYPES}")

  @property
  def completion_tokens(self) -> int:
    return len(self.output_ids)


class EngineIncapable(RuntimeError):
  """The engine lacks a capability the run needs (e.g. a weight-update route for RL with weight sync)."""


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
  """What an engine is and supports, as learned at connect (HTTP: the server's info routes and a route probe).

  `weight_update`: the ways weights can be replaced while serving, a subset of ("disk", "tensors") (SGLang's
  `/update_weights_from_disk`, `/update_weights_from_tensor`); empty: only a restart loads new weights.
  `reports_weight_version`: every generation names the weights that produced it (`meta_info.weight_version`);
  without it per-token versions are `UNKNOWN_VERSION`. `seeded_sampling`: `SamplingParams.seed` makes a
  sample reproducible (sglang-jax only with `--enable-deterministic-sampling`, SGLang with
  `--enable-deterministic-inference`). `abort`: in-flight requests can be stopped (`/abort_request`).
  """

  server: str  # "sglang" | "sglang-jax" | "k2jax" | "in-process" | "unknown"
  server_version: str | None = None
  weight_update: tuple[str, ...] = ()
  reports_weight_version: bool = False
  seeded_sampling: bool = False
  abort: bool = False

  def missing(
    self, *, weight_update: bool = False, weight_version: bool = False, seeded: bool = False, abort: bool = False
  ) -> list[str]:
    """Names of the needed capabilities this engine lacks."""
    gaps = []
    if weight_update and "disk" not in self.weight_update:
      gaps.append("weight update from disk (/update_weights_from_disk)")
    if weight_version and not self.reports_weight_version:
      gaps.append("weight-version reporting (meta_info.weight_version)")
    if seeded and not self.seeded_sampling:
      gaps.append("seeded sampling (sampling_seed)")
    if abort and not self.abort:
      gaps.append("abort (/abort_request)")
    return gaps

  def require(self, purpose: str, where: str = "", **needs: bool) -> None:
    """Raises `EngineIncapable` naming every missing capability that `purpose` needs."""
    gaps = self.missing(**needs)
    if gaps:
      name = f"{self.server} {self.server_version or ''}".strip()
      raise EngineIncapable(
        f"{purpose} needs {', '.join(gaps)}, which the engine{' at ' + where if where else ''} ({name}) lacks"
      )


class Engine(abc.ABC):
  """A generation engine. Implementations must be safe to call from many threads at once."""

  @abc.abstractmethod
  def generate(self, request: GenerateRequest) -> GenerateResult:
    """Blocks until the request stops, hits its length, or is aborted (then returns the partial output).

    Raises `InvalidRequest` for a request this engine cannot run, and another exception when the engine
    itself failed (the result would say nothing about the policy).
    """

  @abc.abstractmethod
  def abort(self, rids: Sequence[str]) -> None:
    """Asks in-flight requests to return now with finish_reason 'abort'; unknown rids are ignored."""

  @abc.abstractmethod
  def update_weights(self, model_path: str, weight_version: int) -> None:
    """Loads HF safetensors from `model_path` (may hold only changed tensors); later tokens carry the version.

    Call between rollout phases: engines differ in whether in-flight requests survive an update.
    """

  def capabilities(self) -> EngineCapabilities:
    """What this engine supports; in-process engines support everything the interface names."""
    return EngineCapabilities(
      server="in-process",
      weight_update=("disk",),
      reports_weight_version=True,
      seeded_sampling=True,
      abort=True,
    )

  def metrics(self) -> dict[str, int]:
    """Cumulative counters of repaired or rejected engine replies (empty when the engine has none)."""
    return {}

  def close(self) -> None:
    """Releases connections or threads; the default has nothing to release."""
