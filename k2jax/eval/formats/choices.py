r"""GPQA-Diamond and MMLU-Pro, generative (the letter extracted from a generated answer, as K2 reports them)
and by log-likelihood of each choice (as lm-evaluation-harness scores multiple choice: acc, acc_norm).

  gpqa, gpqa.ll           Question, Correct Answer, Incorrect Answer 1, 2, 3, Record ID (optional): the
                          columns of Idavidrein/gpqa's gpqa_diamond.csv (also as JSONL or Parquet). The four
                          answers are shuffled by a seeded permutation (`SHUFFLE_SEED` and the record's id;
                          both, and the order, kept in the doc's data), so every run and every sample sees one
                          order and the gold letter is known.
  mmlu_pro, mmlu_pro.ll   question_id, question, options (up to 10), answer (a letter), answer_index,
                          category (optional): TIGER-Lab/MMLU-Pro's test parquet.

Generative prompts: GPQA as OpenAI simple-evals' multiple-choice template ("... The last line of your
response should be of the following format: 'Answer: $LETTER' ..."; the answer is simple-evals' own: the first
match of its `(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?`, compared as written, so "Answer: b" and "Answer: (B)"
score 0 there and here); MMLU-Pro as TIGER-Lab's evaluate_from_local.py (zero-shot: the category header, "Question: ...
Options: A. ...", "Answer: Let's think step by step."), extracted as it extracts: "answer is (X)", else
"Answer: X", else the last standalone letter. Log-likelihood prompts: lm-eval's gpqa zero-shot template
(choices "(A)".."(D)") and an MMLU-style "Answer:" followed by " A".." J".
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping
from typing import Any

from k2jax.eval.records import Doc, TaskFormat, record_id, str_field
from k2jax.eval.verdict import Verdict

LETTERS = "ABCDEFGHIJ"
SHUFFLE_SEED = 0  # GPQA's choice order: random.Random(sha256(f"{SHUFFLE_SEED}/{record id}")) (kept per doc)
_GPQA_FIELDS = ("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
_GPQA_GEN = (
  "Answer the following multiple choice question. The last line of your response should be of the following "
  "format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before "
  "answering.\n\n{question}\n\n{options}"
)
_GPQA_ANSWER = re.compile(r"(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?")  # simple-evals' ANSWER_PATTERN_MULTICHOICE
_MMLU_PRO_HEADER = (
  "The following are multiple choice questions (with answers) about {category}. Think step by step and then "
  'output the answer in the format of "The answer is (X)" at the end.\n\n'
)


# ---- GPQA ----------------------------------------------------------------------------------------------
def gpqa_choices(r: Mapping[str, Any], i: int) -> tuple[str, list[str], list[int], int]:
  """(question, the four answers in their shuffled order, the permutation, gold index) of one record."""
  question = str_field(r, "Question").strip()
  answers = [str_field(r, key).strip() for key in _GPQA_FIELDS]
  if any(not a for a in answers):
    raise ValueError(f"field '{_GPQA_FIELDS[[bool(a) for a in answers].index(False)]}' is empty")
  key = record_id(r, ("Record ID",), i)
  rng = random.Random(hashlib.sha256(f"{SHUFFLE_SEED}/{key}".encode()).digest())
  order = list(range(4))
  rng.shuffle(order)
  return question, [answers[j] for j in order], order, order.index(0)


def parse_gpqa(r: Mapping[str, Any], i: int) -> Doc:
  question, shown, order, gold = gpqa_choices(r, i)
  options = "\n".join(f"{LETTERS[j]}) {a}" for j, a in enumerate(shown))
  prompt = _GPQA_GEN.format(question=question, options=options)
  data = _choice_data(LETTERS[gold], shown) | {"order": order, "shuffle_seed": SHUFFLE_SEED}
  return Doc(record_id(r, ("Record ID",), i), prompt, f"\nAnswer: {LETTERS[gold]}", data)


def parse_gpqa_ll(r: Mapping[str, Any], i: int) -> Doc:
  question, shown, order, gold = gpqa_choices(r, i)
  options = "\n".join(f"({LETTERS[j]}) {a}" for j, a in enumerate(shown))
  prompt = f"What is the correct answer to this question:{question}\nChoices:\n{options}\nAnswer:"
  conts = tuple(f" ({LETTERS[j]})" for j in range(4))
  data = _choice_data(LETTERS[gold], shown) | {"order": order, "shuffle_seed": SHUFFLE_SEED}
  return Doc(record_id(r, ("Record ID",), i), prompt, conts[gold], data, conts, gold)


def grade_gpqa(doc: Doc, text: str, code: Any = None) -> Verdict:
  """simple-evals' gpqa_eval: `re.search` (the first match), the letter as matched (a lowercase one is wrong)."""
  found = _GPQA_ANSWER.search(text)
  return _letter_verdict(doc, found.group(1) if found else None, "no 'Answer: X' line")


# ---- MMLU-Pro ------------------------------------------------------------------------------------------
def mmlu_pro_fields(r: Mapping[str, Any]) -> tuple[str, list[str], int]:
  question = str_field(r, "question")
  options = r["options"]
  if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
    raise TypeError("field 'options' must be a non-empty list of strings")
  if len(options) > len(LETTERS):
    raise ValueError(f"field 'options' has {len(options)} options, more than MMLU-Pro's {len(LETTERS)}")
  letter = str_field(r, "answer").strip().upper()
  if len(letter) != 1 or letter not in LETTERS[: len(options)]:
    raise ValueError(f"field 'answer' must be one of the letters {LETTERS[: len(options)]}, got {r['answer']!r}")
  gold = LETTERS.index(letter)
  if "answer_index" in r and r["answer_index"] != gold:
    raise ValueError(f"field 'answer_index' {r['answer_index']!r} disagrees with 'answer' {letter!r}")
  return question, options, gold


def parse_mmlu_pro(r: Mapping[str, Any], i: int) -> Doc:
  question, options, gold = mmlu_pro_fields(r)
  category = r.get("category") if isinstance(r.get("category"), str) else "various subjects"
  body = _mmlu_pro_question(question, options)
  prompt = _MMLU_PRO_HEADER.format(category=category) + body + "Answer: Let's think step by step."
  doc_id = record_id(r, ("question_id",), i)
  return Doc(doc_id, prompt, f" The answer is ({LETTERS[gold]}).", _choice_data(LETTERS[gold], options))


def parse_mmlu_pro_ll(r: Mapping[str, Any], i: int) -> Doc:
  question, options, gold = mmlu_pro_fields(r)
  conts = tuple(f" {LETTERS[j]}" for j in range(len(options)))
  prompt = _mmlu_pro_question(question, options) + "Answer:"
  doc_id = record_id(r, ("question_id",), i)
  return Doc(doc_id, prompt, conts[gold], _choice_data(LETTERS[gold], options), conts, gold)


def extract_mmlu_pro(text: str) -> str | None:
  """TIGER-Lab's extraction: "answer is (X)", else "Answer: X", else the last standalone letter A-J."""
  m = re.search(r"answer is \(?([A-J])\)?", text)
  if m:
    return m.group(1)
  m = re.search(r".*[aA]nswer:\s*([A-J])", text)
  if m:
    return m.group(1)
  m = re.search(r"\b[A-J]\b(?!.*\b[A-J]\b)", text, re.DOTALL)
  return m.group(0) if m else None


def grade_mmlu_pro(doc: Doc, text: str, code: Any = None) -> Verdict:
  return _letter_verdict(doc, extract_mmlu_pro(text), "no answer letter")


# ---- shared --------------------------------------------------------------------------------------------
def _mmlu_pro_question(question: str, options: list[str]) -> str:
  lines = "".join(f"{LETTERS[j]}. {o}\n" for j, o in enumerate(options))
  return f"Question: {question}\nOptions:\n{lines}"


def _choice_data(letter: str, shown: list[str]) -> dict:
  return {"answer": letter, "choices": list(shown)}


def _letter_verdict(doc: Doc, got: str | None, missing: str) -> Verdict:
  if got is None:
    return Verdict(0.0, None, missing)
  want = doc.data["answer"]
  if got not in LETTERS[: len(doc.data["choices"])]:
    return Verdict(0.0, got, f"{got} is not one of the {len(doc.data['choices'])} choices")
  return Verdict(float(got == want), got, "correct" if got == want else f"{got} != {want}")


FORMATS = (
  # "2": the first `Answer: X` as simple-evals reads it (the last, and "(X)" and lowercase, in "1")
  TaskFormat("gpqa", "generate", parse_gpqa, grade=grade_gpqa, votes=True, version="2"),
  TaskFormat("gpqa.ll", "choice", parse_gpqa_ll),
  TaskFormat("mmlu_pro", "generate", parse_mmlu_pro, grade=grade_mmlu_pro, votes=True),
  TaskFormat("mmlu_pro.ll", "choice", parse_mmlu_pro_ll),
)
