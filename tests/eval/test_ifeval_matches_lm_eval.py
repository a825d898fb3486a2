"""k2jax's IFEval checks give lm-evaluation-harness's `ifeval` verdicts (its own `lm_eval/tasks/ifeval/utils.py`)
on the same responses: every instruction type that runs offline, strict and loose, each instruction and the
four aggregate metrics. `length_constraints:number_sentences` and `change_case:capital_word_frequency` need
NLTK's Punkt model, which NLTK downloads and which this machine lacks: both sides raise for them (checked)."""

import pytest

from k2jax.eval.formats import ifeval as ifeval_format
from k2jax.eval.records import Doc
from k2jax.grading import ifeval

lm_utils = pytest.importorskip("lm_eval.tasks.ifeval.utils")

ROWS = [  # (instruction id, kwargs, prompt)
  ("keywords:existence", {"keywords": ["jax", "flax"]}, "p"),
  ("keywords:frequency", {"keyword": "sea", "frequency": 2, "relation": "at least"}, "p"),
  ("keywords:frequency", {"keyword": "sea", "frequency": 2, "relation": "less than"}, "p"),
  ("keywords:forbidden_words", {"forbidden_words": ["torch", "keras"]}, "p"),
  ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "at least"}, "p"),
  ("language:response_language", {"language": "de"}, "p"),
  ("language:response_language", {"language": "en"}, "p"),
  ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "p"),
  ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "p"),
  ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "p"),
  ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"}, "p"),
  ("detectable_content:number_placeholders", {"num_placeholders": 2}, "p"),
  ("detectable_content:postscript", {"postscript_marker": "P.S."}, "p"),
  ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "p"),
  ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "p"),
  ("detectable_format:constrained_response", {}, "p"),
  ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "p"),
  ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2}, "p"),
  ("detectable_format:json_format", {}, "p"),
  ("detectable_format:title", {}, "p"),
  ("combination:two_responses", {}, "p"),
  ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi to the sea."}, "Say hi to the sea. Then answer."),
  ("startend:end_checker", {"end_phrase": "Any other questions?"}, "p"),
  ("startend:quotation", {}, "p"),
  ("change_case:english_capital", {}, "p"),
  ("change_case:english_lowercase", {}, "p"),
  ("punctuation:no_comma", {}, "p"),
]
RESPONSES = [
  "Say hi to the sea. The sea, the sea: jax and flax. P.S. see you",
  "<<A Title>>\n* one [x]\n* two [y]\n\nthen *bold part* and **strong part**. Any other questions?",
  '"Section 1\nthe sea is blue\nSection 2\nzebra zone"',
  '```json\n{"a": [1, 2]}\n```',
  "First answer here.\n******\nSecond answer here.",
  "Ein Hund läuft schnell über die Straße, und die Katze schläft im Garten.\n\n***\n\nNoch ein Absatz.",
  "HELLO WORLD THIS IS ALL CAPITAL ENGLISH TEXT",
  "this is all lowercase english text about the weather today",
  "My answer is yes.\np.p.s. later\n- dash item\n- another",
  "Intro line\nthen the body without commas\n*outro*",
  "",
]
OFFLINE = [r for r in ROWS if r[0] not in ifeval.PUNKT_TYPES]


@pytest.fixture(autouse=True)
def _seeded_langdetect(monkeypatch):
  """lm-eval calls langdetect unseeded, so its verdict on short text ("First answer here. ... Second answer
  here.") changes from run to run; k2jax seeds its detector with 0. Seeding lm-eval's side the same way
  compares the two deterministically."""
  from langdetect import detector_factory

  monkeypatch.setattr(detector_factory.DetectorFactory, "seed", 0)


def _lm_eval(rows, response):
  doc = {"key": 0, "prompt": rows[0][2], "instruction_id_list": [r[0] for r in rows], "kwargs": [r[1] for r in rows]}
  return lm_utils.process_results(doc, [response])


def test_every_offline_instruction_type_is_covered():
  assert {r[0] for r in ROWS} == set(ifeval.INSTRUCTION_IDS) - set(ifeval.PUNKT_TYPES)


@pytest.mark.parametrize("response", RESPONSES)
def test_each_instruction_strict_and_loose_as_lm_eval(response):
  for row in OFFLINE:
    want = _lm_eval([row], response)
    for loose in (False, True):
      got = ifeval.follows([row[0]], [row[1]], row[2], response, loose=loose)
      assert got == want["inst_level_loose_acc" if loose else "inst_level_strict_acc"], (row, response, loose)


def test_the_four_metrics_as_lm_eval_aggregates_them():
  docs = [OFFLINE[i : i + 4] for i in range(0, len(OFFLINE), 4)]  # rows of several instructions
  samples, lm = [], []
  for j, (rows, response) in enumerate((rows, r) for rows in docs for r in RESPONSES):
    data = {"prompt": rows[0][2], "instruction_id_list": [r[0] for r in rows], "kwargs": [r[1] for r in rows]}
    verdict = ifeval_format.grade(Doc(str(j), rows[0][2], "", data), response)
    samples.append([{"score": verdict.score, **verdict.extra}])
    lm.append(_lm_eval(rows, response))
  got = ifeval_format.aggregate(samples)
  want = {
    "prompt_level_strict_acc": sum(r["prompt_level_strict_acc"] for r in lm) / len(lm),
    "prompt_level_loose_acc": sum(r["prompt_level_loose_acc"] for r in lm) / len(lm),
    "inst_level_strict_acc": lm_utils.agg_inst_level_acc([r["inst_level_strict_acc"] for r in lm]),
    "inst_level_loose_acc": lm_utils.agg_inst_level_acc([r["inst_level_loose_acc"] for r in lm]),
  }
  assert got == pytest.approx(want)
  assert 0 < want["inst_level_strict_acc"] < want["inst_level_loose_acc"] < 1  # the responses tell them apart


def test_punkt_types_need_the_nltk_model_on_both_sides():
  try:
    ifeval._punkt()
  except ifeval.MissingData as e:
    assert "nltk.downloader punkt" in str(e)
    with pytest.raises(LookupError):
      _lm_eval([("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "p")], "A. B.")
  else:  # the model is installed here: then the verdicts agree too
    for row in [("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "p")]:
      assert (
        ifeval.follows([row[0]], [row[1]], "p", "A b. C d.", False)
        == _lm_eval([row], "A b. C d.")["inst_level_strict_acc"]
      )
