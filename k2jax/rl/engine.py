"""The rollout engine interface and the records that cross it.

An engine turns token ids into sampled continuations. Two implementations plug in here: SGLang (or the
embedded k2jax server) over HTTP (`engines/http.py`) and an in-process fake for tests and benchmarks
(`engines/fake.py`). The rollout manager only sees this interface.

Conventions: token-in/token-out (reference §4.1): requests carry `input_ids`, never re-templated text;
`GenerateResult` holds one logprob and one weight version per generated token; version `UNKNOWN_VERSION`
(-1) marks tokens whose server did not report which weights produced them (never a guessed version).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal, Sequence

import numpy as np

FinishType = Literal["stop", "length", "abort"]
FINISH_TYPES: tuple[str, ...] = ("stop", "length", "abort")
UNKNOWN_VERSION = -1  # a token whose engine did not confirm its weight version


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


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """SGLang `sampling_params` subset used by RL (reference §2.2)."""

  max_new_tokens: int = 128
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  stop_token_ids: tuple[int, ...] = ()
  seed: int | None = None  # SGLang `sampling_seed`: per-sample seeds keep resumed samples reproducible.

  def __post_init__(self):
    if self.max_new_tokens < 0:
      raise ValueError(f"SamplingParams.max_new_tokens must be >= 0, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
  """One sampling request. `rid` must be unique among in-flight requests (used by `abort`)."""

  rid: str
  input_ids: tuple[int, ...]
  sampling: SamplingParams = SamplingParams()

  def __post_init__(self):
    if not self.rid:
      raise ValueError("GenerateRequest.rid must be a non-empty string")
    if len(self.input_ids) == 0:
      raise ValueError(f"GenerateRequest {self.rid}: input_ids is empty")


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """What an engine returns for one request; lengths of the three per-token tuples agree."""

  rid: str
  output_ids: tuple[int, ...]
  output_logprobs: tuple[float, ...]
  weight_versions: tuple[int, ...]  # policy version that produced each output token
  finish_reason: FinishType
  prompt_tokens: int
  completion_tokens: int
  text: str | None = None

  def __post_init__(self):
    n = len(self.output_ids)
    if len(self.output_logprobs) != n or len(self.weight_versions) != n:
      raise ValueError(
        f"GenerateResult {self.rid}: {n} output_ids but {len(self.output_logprobs)} logprobs and "
        f"{len(self.weight_versions)} weight versions"
      )
    if self.completion_tokens != n:
      raise ValueError(f"GenerateResult {self.rid}: completion_tokens={self.completion_tokens} != len(output_ids)={n}")
    if self.finish_reason not in FINISH_TYPES:
      raise ValueError(f"GenerateResult {self.rid}: finish_reason {self.finish_reason!r} not in {FINISH_TYPES}")


class Engine(abc.ABC):
  """A rollout engine. Implementations must be safe to call from many threads at once."""

  @abc.abstractmethod
  def generate(self, request: GenerateRequest) -> GenerateResult:
    """Blocks until the request stops, hits its length, or is aborted (then returns the partial output)."""

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


def pad_token_rows(rows, *, pad_id: int) -> dict[str, np.ndarray]:
  """Right-pad per-sample token rows into RolloutBatch's [B, T] arrays.

  `rows`: (tokens, loss_mask, logprobs, versions) per sample, four sequences of one length each
  (prompt + response, with 0 / 0.0 / -1 on untrained positions). Returns tokens_BT, segment_ids_BT,
  loss_mask_BT, engine_logprobs_BT and weight_versions_BT.
  """
  B = len(rows)
  T = max((len(r[0]) for r in rows), default=1)
  out = dict(
    tokens_BT=np.full((B, T), pad_id, np.int32),
    segment_ids_BT=np.zeros((B, T), np.int32),
    loss_mask_BT=np.zeros((B, T), np.float32),
    engine_logprobs_BT=np.zeros((B, T), np.float32),
    weight_versions_BT=np.full((B, T), -1, np.int32),
  )
  for b, (tokens, mask, logprobs, versions) in enumerate(rows):
    n = len(tokens)
    out["tokens_BT"][b, :n], out["segment_ids_BT"][b, :n] = tokens, 1
    out["loss_mask_BT"][b, :n], out["engine_logprobs_BT"][b, :n] = mask, logprobs
    out["weight_versions_BT"][b, :n] = versions
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutBatch:
  """A trainer-ready batch of finished samples, right-padded to a common length T.

  Position t of `engine_logprobs_BT` holds log p(tokens[b, t] | tokens[b, :t]) as reported by the engine
  (0 on prompt and padding), so a trainer that recomputes logprobs must shift its logits by one.
  `group_ids_B` are dense 0..G-1; samples of one group answered the same prompt.
  """

  tokens_BT: np.ndarray  # int32 prompt + response ids, pad_id after
  segment_ids_BT: np.ndarray  # int32 1 on prompt+response, 0 on padding (model convention)
  loss_mask_BT: np.ndarray  # float32 1 on generated response tokens
  engine_logprobs_BT: np.ndarray  # float32 behaviour-policy logprobs from the engine
  weight_versions_BT: np.ndarray  # int32 policy version per response token, -1 elsewhere
  rewards_B: np.ndarray  # float32 final reward (truncation penalty included)
  group_ids_B: np.ndarray  # int32
  prompt_lengths_B: np.ndarray  # int32
  response_lengths_B: np.ndarray  # int32
  truncated_B: np.ndarray  # bool: hit the task token budget
  tasks: tuple[str, ...]
  iteration: int
  temperature: float

  def __post_init__(self):
    B, T = self.tokens_BT.shape
    for name in ("segment_ids_BT", "loss_mask_BT", "engine_logprobs_BT", "weight_versions_BT"):
      if getattr(self, name).shape != (B, T):
        raise ValueError(f"RolloutBatch.{name} has shape {getattr(self, name).shape}, want {(B, T)}")
    for name in ("rewards_B", "group_ids_B", "prompt_lengths_B", "response_lengths_B", "truncated_B"):
      if getattr(self, name).shape != (B,):
        raise ValueError(f"RolloutBatch.{name} has shape {getattr(self, name).shape}, want {(B,)}")
    if len(self.tasks) != B:
      raise ValueError(f"RolloutBatch.tasks has {len(self.tasks)} entries, want {B}")

  @property
  def num_groups(self) -> int:
    return int(self.group_ids_B.max()) + 1 if self.group_ids_B.size else 0
