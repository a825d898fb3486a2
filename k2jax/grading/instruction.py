"""Instruction-following reward: verifiable constraints checked by code, plus K2's hack-check.

Each constraint is a frozen dataclass with `check(text) -> (ok, reason)`. The reward is the fraction of
constraints met; a response that *claims* compliance ("word count: 120", "I followed all the
instructions") while failing a constraint gets 0 (K2 §3.2.1 hack-check layer). Nuanced constraints go to
the LLM judge (`judge.llm_judge_reward`) and can be combined by the caller.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Protocol, Sequence

from k2jax.grading.base import RewardResult

_CLAIM = re.compile(
  r"(word count\s*[:=]|\(\s*\d+\s+words\s*\)|i (have )?(followed|complied with|met) (all )?"
  r"(the |your )?(instructions|constraints|requirements))",
  re.IGNORECASE,
)


class Constraint(Protocol):
  def check(self, text: str) -> tuple[bool, str]: ...


def _words(text: str) -> list[str]:
  return re.findall(r"\b[\w'-]+\b", text)


@dataclasses.dataclass(frozen=True)
class WordCount:
  min_words: int = 0
  max_words: int = 10**9

  def check(self, text):
    n = len(_words(text))
    return self.min_words <= n <= self.max_words, f"{n} words (want {self.min_words}..{self.max_words})"


@dataclasses.dataclass(frozen=True)
class CharCount:
  min_chars: int = 0
  max_chars: int = 10**9

  def check(self, text):
    n = len(text)
    return self.min_chars <= n <= self.max_chars, f"{n} characters (want {self.min_chars}..{self.max_chars})"


@dataclasses.dataclass(frozen=True)
class IncludeKeywords:
  keywords: tuple[str, ...]
  min_count: int = 1  # occurrences of each keyword (case-insensitive, whole words)

  def check(self, text):
    missing = [k for k in self.keywords if len(re.findall(rf"\b{re.escape(k)}\b", text, re.I)) < self.min_count]
    return not missing, f"missing keywords {missing}" if missing else "all keywords present"


@dataclasses.dataclass(frozen=True)
class ExcludeKeywords:
  keywords: tuple[str, ...]

  def check(self, text):
    found = [k for k in self.keywords if re.search(rf"\b{re.escape(k)}\b", text, re.I)]
    return not found, f"forbidden keywords {found}" if found else "no forbidden keywords"


@dataclasses.dataclass(frozen=True)
class JsonFormat:
  """The whole response (optionally inside one ```json fence) parses as JSON."""

  def check(self, text):
    body = re.sub(r"^```(json)?\s*|\s*```$", "", text.strip())
    try:
      json.loads(body)
      return True, "valid JSON"
    except ValueError as e:
      return False, f"not JSON: {e}"


@dataclasses.dataclass(frozen=True)
class BulletCount:
  count: int

  def check(self, text):
    n = len(re.findall(r"^\s*[*-]\s+\S", text, re.M))
    return n == self.count, f"{n} bullet points (want {self.count})"


@dataclasses.dataclass(frozen=True)
class ParagraphCount:
  count: int

  def check(self, text):
    n = len([p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()])
    return n == self.count, f"{n} paragraphs (want {self.count})"


@dataclasses.dataclass(frozen=True)
class StartsWith:
  prefix: str

  def check(self, text):
    ok = text.lstrip().startswith(self.prefix)
    return ok, f"{'starts' if ok else 'does not start'} with {self.prefix!r}"


@dataclasses.dataclass(frozen=True)
class EndsWith:
  suffix: str

  def check(self, text):
    ok = text.rstrip().endswith(self.suffix)
    return ok, f"{'ends' if ok else 'does not end'} with {self.suffix!r}"


@dataclasses.dataclass(frozen=True)
class NoCommas:
  def check(self, text):
    n = text.count(",")
    return n == 0, f"{n} commas"


@dataclasses.dataclass(frozen=True)
class LetterCase:
  case: str  # "lower" | "upper"

  def check(self, text):
    if self.case not in ("lower", "upper"):
      raise ValueError(f"LetterCase.case must be 'lower' or 'upper', got {self.case!r}")
    ok = text == (text.lower() if self.case == "lower" else text.upper())
    return ok, f"{'all' if ok else 'not all'} {self.case}case"


CONSTRAINTS = {
  "word_count": WordCount,
  "char_count": CharCount,
  "include_keywords": IncludeKeywords,
  "exclude_keywords": ExcludeKeywords,
  "json_format": JsonFormat,
  "bullet_count": BulletCount,
  "paragraph_count": ParagraphCount,
  "starts_with": StartsWith,
  "ends_with": EndsWith,
  "no_commas": NoCommas,
  "letter_case": LetterCase,
}


def constraints_from_dicts(specs: Sequence[Mapping[str, Any]]) -> list[Constraint]:
  """Task data -> constraints: `[{"kind": "word_count", "max_words": 50}, {"kind": "no_commas"}, ...]`."""
  if not isinstance(specs, (list, tuple)) or not specs:
    raise ValueError(f"instruction constraints must be a non-empty list of objects, got {specs!r:.200}")
  out = []
  for i, spec in enumerate(specs):
    kind = spec.get("kind") if isinstance(spec, Mapping) else None
    if kind not in CONSTRAINTS:
      raise ValueError(f"constraints[{i}]: unknown kind {kind!r}; known: {sorted(CONSTRAINTS)}")
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k != "kind"}
    try:
      out.append(CONSTRAINTS[kind](**params))
    except TypeError as e:
      raise ValueError(f"constraints[{i}] ({kind}): {e}") from None
  return out


def instruction_reward(text: str, constraints: Sequence[Constraint]) -> RewardResult:
  """Fraction of constraints met; 0 when the response claims compliance it does not have."""
  if not constraints:
    raise ValueError("instruction_reward: no constraints given")
  results = [(type(c).__name__, *c.check(text)) for c in constraints]
  failed = [f"{name}: {why}" for name, ok, why in results if not ok]
  info = {"checks": [{"constraint": n, "ok": ok, "reason": why} for n, ok, why in results]}
  if failed and _CLAIM.search(text):
    return RewardResult(0.0, "hack-check: claims compliance but fails " + "; ".join(failed), info)
  score = 1.0 - len(failed) / len(results)
  return RewardResult(score, "; ".join(failed) if failed else "all constraints met", info)
