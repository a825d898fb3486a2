"""IFEval's verifiable instructions (Zhou et al. 2023, google-research `instruction_following_eval`), as
lm-evaluation-harness's `ifeval` task checks them (`lm_eval/tasks/ifeval/instructions.py`, 0.4.x): one
implementation for the benchmark (`k2jax.eval.formats.ifeval`) and the RL instruction reward
(`grading.instruction`, whose constraint kinds include every instruction id here).

`check(instruction_id, kwargs, prompt, response)` says whether `response` follows one instruction; `follows`
runs a row's list strictly or loosely (the loose variants: the response without its first and/or last line
and/or without `*`). The kwargs are IFEval's (`None` values dropped, as the dataset's Parquet rows carry every
key); a missing or wrong one is a `ValueError` naming it, never the random default the generator code falls
back on. Two instruction types need NLTK's English Punkt model (`length_constraints:number_sentences`,
`change_case:capital_word_frequency`), which NLTK fetches from the network: where it is not installed
(`python -m nltk.downloader punkt punkt_tab`) they raise `MissingData` naming it. `language:response_language`
and `change_case:english_*` use `langdetect` (its language profiles ship in the package).
"""

from __future__ import annotations

import collections
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RELATIONS = ("less than", "at least")
PUNKT_TYPES = ("length_constraints:number_sentences", "change_case:capital_word_frequency")


class MissingData(RuntimeError):
  """An instruction type whose checker needs data that is not installed here (NLTK's Punkt model)."""


def check(instruction_id: str, kwargs: Mapping[str, Any], prompt: str, response: str) -> bool:
  """Whether `response` follows instruction `instruction_id` with IFEval's `kwargs` (lm-eval's strict test)."""
  fn, _ = _spec(instruction_id)
  args = checked_kwargs(instruction_id, kwargs)
  return bool(response.strip()) and fn(response, prompt=prompt, **args)


def follows(
  ids: Sequence[str], kwargs: Sequence[Mapping[str, Any]], prompt: str, response: str, loose: bool
) -> list[bool]:
  """Each instruction's verdict on `response`: strict, or loose (any of lm-eval's eight variants follows)."""
  variants = loose_variants(response) if loose else [response]
  return [any(check(i, kw, prompt, r) for r in variants) for i, kw in zip(ids, kwargs, strict=True)]


def loose_variants(response: str) -> list[str]:
  """lm-eval's loose responses: as is, without `*`, without the first / last / both lines, and both."""
  lines = response.split("\n")
  first, last, both = ("\n".join(part).strip() for part in (lines[1:], lines[:-1], lines[1:-1]))
  out = [response, response.replace("*", ""), first, last, both]
  return out + [x.replace("*", "") for x in (first, last, both)]


def checked_kwargs(instruction_id: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
  """The instruction's own kwargs (falsy values dropped, as lm-eval drops them), each checked; ValueError names
  the one missing or wrong."""
  if not isinstance(kwargs, Mapping):
    raise TypeError(f"{instruction_id}: kwargs must be an object, got {type(kwargs).__name__}")
  _, needs = _spec(instruction_id)
  given = {k: v for k, v in kwargs.items() if v}
  out = {}
  for name, kind in needs.items():
    if name not in given:
      raise ValueError(f"{instruction_id}: kwarg '{name}' is missing")
    out[name] = _checked(instruction_id, name, kind, given[name])
  if instruction_id in PUNKT_TYPES:
    _punkt()
  return out


def known(instruction_id: str) -> bool:
  return instruction_id in _INSTRUCTIONS


# ---- counting helpers (shared with grading.instruction) -------------------------------------------------
def count_words(text: str) -> int:
  """IFEval's word count: runs of `\\w` (NLTK's RegexpTokenizer(r"\\w+"))."""
  return len(re.findall(r"\w+", text))


def count_bullets(text: str) -> int:
  """Markdown bullet lines: `* item` (not `**`) and `- item`."""
  return len(re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)) + len(
    re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
  )


def is_json(text: str) -> bool:
  """The whole response parses as JSON, optionally inside one ``` (```json) fence."""
  value = text.strip()
  for prefix in ("```json", "```Json", "```JSON", "```"):
    value = value.removeprefix(prefix)
  try:
    json.loads(value.removesuffix("```").strip())
  except ValueError:
    return False
  return True


def no_comma(text: str) -> bool:
  return "," not in text


# ---- the instructions ------------------------------------------------------------------------------------
def _compare(n: int, relation: str, threshold: int) -> bool:
  return n < threshold if relation == RELATIONS[0] else n >= threshold


def _existence(v, *, prompt, keywords):
  return all(re.search(k, v, flags=re.IGNORECASE) for k in keywords)


def _frequency(v, *, prompt, keyword, frequency, relation):
  return _compare(len(re.findall(keyword.strip(), v, flags=re.IGNORECASE)), relation, frequency)


def _forbidden(v, *, prompt, forbidden_words):
  return not any(re.search(r"\b" + w + r"\b", v, flags=re.IGNORECASE) for w in set(forbidden_words))


def _letter_frequency(v, *, prompt, letter, let_frequency, let_relation):
  return _compare(collections.Counter(v.lower())[letter.strip().lower()], let_relation, let_frequency)


def _language(v, *, prompt, language):
  return _detect(v, language)


def _sentences(v, *, prompt, num_sentences, relation):
  return _compare(len(_punkt().tokenize(v)), relation, num_sentences)


def _paragraphs(v, *, prompt, num_paragraphs):
  parts = re.split(r"\s?\*\*\*\s?", v)
  n = len(parts)
  for i, p in enumerate(parts):
    if not p.strip():
      if i in (0, len(parts) - 1):
        n -= 1
      else:
        return False
  return n == num_paragraphs


def _words(v, *, prompt, num_words, relation):
  return _compare(count_words(v), relation, num_words)


def _nth_first_word(v, *, prompt, num_paragraphs, nth_paragraph, first_word):
  parts = re.split(r"\n\n", v)
  n = len(parts) - sum(not p.strip() for p in parts)
  if nth_paragraph > n or not parts[nth_paragraph - 1].strip():
    return False
  word = parts[nth_paragraph - 1].strip().split()[0].strip().lstrip("'").lstrip('"')
  got = ""
  for ch in word:
    if ch in {".", ",", "?", "!", "'", '"'}:
      break
    got += ch.lower()
  return n == num_paragraphs and got == first_word.lower()


def _placeholders(v, *, prompt, num_placeholders):
  return len(re.findall(r"\[.*?\]", v)) >= num_placeholders


def _postscript(v, *, prompt, postscript_marker):
  marker = postscript_marker.strip()
  if marker == "P.P.S":
    pattern = r"\s*p\.\s?p\.\s?s.*$"
  elif marker == "P.S.":
    pattern = r"\s*p\.\s?s\..*$"
  else:
    pattern = r"\s*" + marker.lower() + r".*$"
  return bool(re.findall(pattern, v.lower(), flags=re.MULTILINE))


def _bullets(v, *, prompt, num_bullets):
  return count_bullets(v) == num_bullets


def _constrained(v, *, prompt):
  return any(o in v.strip() for o in ("My answer is yes.", "My answer is no.", "My answer is maybe."))


def _highlights(v, *, prompt, num_highlights):
  single = [h for h in re.findall(r"\*[^\n\*]*\*", v) if h.strip("*").strip()]
  double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", v) if h.removeprefix("**").removesuffix("**").strip()]
  return len(single) + len(double) >= num_highlights


def _sections(v, *, prompt, section_spliter, num_sections):
  return len(re.split(r"\s?" + section_spliter.strip() + r"\s?\d+\s?", v)) - 1 >= num_sections


def _json(v, *, prompt):
  return is_json(v)


def _title(v, *, prompt):
  return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", v))


def _two_responses(v, *, prompt):
  parts = v.split("******")
  valid = []
  for i, p in enumerate(parts):
    if not p.strip():
      if i not in (0, len(parts) - 1):
        return False
    else:
      valid.append(p)
  return len(valid) == 2 and valid[0].strip() != valid[1].strip()


def _repeat_prompt(v, *, prompt, prompt_to_repeat):
  return v.strip().lower().startswith(prompt_to_repeat.strip().lower())


def _end(v, *, prompt, end_phrase):
  return v.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def _quotation(v, *, prompt):
  v = v.strip()
  return len(v) > 1 and v[0] == '"' and v[-1] == '"'


def _capital_frequency(v, *, prompt, capital_frequency, capital_relation):
  import nltk

  _punkt()
  return _compare(sum(w.isupper() for w in nltk.word_tokenize(v)), capital_relation, capital_frequency)


def _english_capital(v, *, prompt):
  return v.isupper() and _detect(v, "en")


def _english_lowercase(v, *, prompt):
  return v.islower() and _detect(v, "en")


def _comma(v, *, prompt):
  return no_comma(v)


@functools.cache
def _detector_factory():
  from langdetect import detector_factory

  factory = detector_factory.DetectorFactory()
  factory.load_profile(detector_factory.PROFILES_DIRECTORY)
  # langdetect samples n-grams at random and, unseeded, draws from os.urandom: on short or mixed text its
  # answer changes from call to call (lm-eval's own verdicts do). A fixed seed makes a grade reproducible.
  factory.set_seed(0)
  return factory


def _detect(text: str, language: str) -> bool:
  from langdetect import LangDetectException

  detector = _detector_factory().create()
  try:
    detector.append(text)
    return detector.detect() == language
  except LangDetectException:  # no features to detect (lm-eval counts it as followed)
    return True


@functools.cache
def _punkt():
  import nltk

  try:
    return nltk.data.load("nltk:tokenizers/punkt/english.pickle")
  except LookupError:
    raise MissingData(
      f"IFEval's {' and '.join(PUNKT_TYPES)} need NLTK's English Punkt model, not installed here: "
      "python -m nltk.downloader punkt punkt_tab"
    ) from None


# kind of each kwarg: int (>= 0) | str | relation | words (a list of strings) | letter
_Instruction = tuple[Callable[..., bool], dict[str, str]]
_INSTRUCTIONS: dict[str, _Instruction] = {
  "keywords:existence": (_existence, {"keywords": "words"}),
  "keywords:frequency": (_frequency, {"keyword": "str", "frequency": "int", "relation": "relation"}),
  "keywords:forbidden_words": (_forbidden, {"forbidden_words": "words"}),
  "keywords:letter_frequency": (
    _letter_frequency,
    {"letter": "letter", "let_frequency": "int", "let_relation": "relation"},
  ),
  "language:response_language": (_language, {"language": "str"}),
  "length_constraints:number_sentences": (_sentences, {"num_sentences": "int", "relation": "relation"}),
  "length_constraints:number_paragraphs": (_paragraphs, {"num_paragraphs": "int"}),
  "length_constraints:number_words": (_words, {"num_words": "int", "relation": "relation"}),
  "length_constraints:nth_paragraph_first_word": (
    _nth_first_word,
    {"num_paragraphs": "int", "nth_paragraph": "int", "first_word": "str"},
  ),
  "detectable_content:number_placeholders": (_placeholders, {"num_placeholders": "int"}),
  "detectable_content:postscript": (_postscript, {"postscript_marker": "str"}),
  "detectable_format:number_bullet_lists": (_bullets, {"num_bullets": "int"}),
  "detectable_format:constrained_response": (_constrained, {}),
  "detectable_format:number_highlighted_sections": (_highlights, {"num_highlights": "int"}),
  "detectable_format:multiple_sections": (_sections, {"section_spliter": "str", "num_sections": "int"}),
  "detectable_format:json_format": (_json, {}),
  "detectable_format:title": (_title, {}),
  "combination:two_responses": (_two_responses, {}),
  "combination:repeat_prompt": (_repeat_prompt, {"prompt_to_repeat": "str"}),
  "startend:end_checker": (_end, {"end_phrase": "str"}),
  "startend:quotation": (_quotation, {}),
  "change_case:capital_word_frequency": (
    _capital_frequency,
    {"capital_frequency": "int", "capital_relation": "relation"},
  ),
  "change_case:english_capital": (_english_capital, {}),
  "change_case:english_lowercase": (_english_lowercase, {}),
  "punctuation:no_comma": (_comma, {}),
}
INSTRUCTION_IDS = tuple(_INSTRUCTIONS)


def _spec(instruction_id: str) -> _Instruction:
  if instruction_id not in _INSTRUCTIONS:
    raise ValueError(f"unknown IFEval instruction {instruction_id!r}")
  return _INSTRUCTIONS[instruction_id]


def _checked(instruction_id: str, name: str, kind: str, value: Any) -> Any:
  bad = ValueError(f"{instruction_id}: kwarg '{name}' must be {_KINDS[kind]}, got {value!r:.80}")
  if kind == "int":
    if isinstance(value, float) and value.is_integer():
      value = int(value)  # Parquet stores the dataset's integers as float64 beside nulls
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise bad
  elif kind == "relation" and value not in RELATIONS:
    raise bad
  elif kind == "str" and not isinstance(value, str):
    raise bad
  elif kind == "letter" and not (isinstance(value, str) and len(value.strip()) == 1 and value.strip().isalpha()):
    raise bad
  elif kind == "words":
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(w, str) for w in value):
      raise bad
    value = list(value)
  return value


_KINDS = {
  "int": "an integer >= 0",
  "relation": f"one of {RELATIONS}",
  "str": "a string",
  "letter": "one letter",
  "words": "a non-empty list of strings",
}
