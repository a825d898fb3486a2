"""The rollout engine interface and the records that cross it.

An engine turns token ids into sampled continuations. Two implementations plug in here: SGLang (or the
embedded k2jax server) over HTTP (`http.py`) and an in-process fake for tests and benchmarks
(`fake.py`). The rollout manager only sees this interface.

Conventions: token-in/token-out (reference §4.1): requests carry `input_ids`, never re-templated text;
`GenerateResult` holds one logprob and one weight version per generated token.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal, Sequence

FinishType = Literal["stop", "length", "abort"]
FINISH_TYPES: tuple[str, ...] = ("stop", "length", "abort")


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

  def close(self) -> None:
    """Releases connections or threads; the default has nothing to release."""
