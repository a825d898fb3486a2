"""The K2 report's benchmark formats (k2jax/eval/formats/) read from JSONL, Parquet and CSV in their published
field names, graded by their own graders, and run end to end by the runner; bad rows name file, line and field."""

import csv

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k2jax.eval import EvalConfig, TaskFormatError, TaskSpec, load_docs, run
from k2jax.eval.formats import choices
from k2jax.eval.grading import grade
from k2jax.eval.tasks import get_format
from k2jax.sandbox.code import CodeRewardConfig

from .benchmark_rows import AIME24, AIME25, GPQA, IFEVAL, MATH500, MMLU_PRO
from .conftest import TextScorer, scripted_model, write_jsonl

CODE = CodeRewardConfig()


def write_parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), path)
  return str(path)


def write_csv(path, rows):
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  return str(path)


def _grade(fmt, doc, text):
  return grade(fmt, fmt, doc, text, "stop", CODE)


def test_aime_and_math500_through_the_math_reward(tmp_path):
  (a24,) = load_docs(write_parquet(tmp_path / "aime24.parquet", AIME24), "aime")
  (a25,) = load_docs(write_jsonl(tmp_path / "aime25.jsonl", AIME25), "aime")
  assert (a24.doc_id, a24.data["answer"], a25.doc_id, a25.data["answer"]) == ("60", "204", "0", "70")
  assert a24.prompt.startswith("Every morning Aya") and a24.prompt.endswith("within \\boxed{}.")
  v = _grade("aime", a24, "So the walk takes 204 minutes: $\\boxed{204}$")
  assert (v.score, v.answer) == (1.0, "204")
  assert _grade("aime", a25, "\\boxed{72}").score == 0.0 and _grade("aime", a25, "70").answer is None
  (m,) = load_docs(write_jsonl(tmp_path / "math500.jsonl", MATH500), "math500")
  assert m.doc_id == "test/precalculus/807.json" and m.data["subject"] == "Precalculus"
  assert _grade("math500", m, "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}").score == 1.0
  assert _grade("math500", m, "\\boxed{(3, \\pi)}").score == 0.0


def test_aime_rows_of_the_wrong_shape_name_file_line_and_field(tmp_path):
  bad = write_jsonl(tmp_path / "a.jsonl", [AIME25[0], {"question": "q", "answer": "1000"}])
  with pytest.raises(TaskFormatError, match=r"a.jsonl:2: not a aime record: field 'answer' must be an AIME"):
    load_docs(bad, "aime")
  with pytest.raises(TaskFormatError, match=r"b.jsonl:1: .*missing field 'problem' \(or 'Problem', 'question'\)"):
    load_docs(write_jsonl(tmp_path / "b.jsonl", [{"answer": "3"}]), "aime")


def test_gpqa_shuffles_with_a_recorded_seed_and_reads_the_letter(tmp_path):
  gen = load_docs(write_csv(tmp_path / "gpqa_diamond.csv", GPQA), "gpqa")
  again = load_docs(write_jsonl(tmp_path / "gpqa.jsonl", GPQA), "gpqa")
  assert [d.data for d in gen] == [d.data for d in again]  # one order whatever the file type
  for doc, row in zip(gen, GPQA):
    order, shown = doc.data["order"], doc.data["choices"]
    assert sorted(order) == [0, 1, 2, 3] and doc.data["shuffle_seed"] == choices.SHUFFLE_SEED
    assert shown[choices.LETTERS.index(doc.data["answer"])] == row["Correct Answer"]
    assert f"{doc.data['answer']}) {row['Correct Answer']}" in doc.prompt and "'Answer: $LETTER'" in doc.prompt
  orders = {tuple(d.data["order"]) for d in gen}
  assert orders != {(0, 1, 2, 3)}  # shuffled (the gold is not always A)
  doc = gen[0]
  gold, wrong = doc.data["answer"], next(c for c in "ABCD" if c != doc.data["answer"])
  # simple-evals' gpqa_eval: re.search, the first match, the letter as written.
  v = _grade("gpqa", doc, f"Answer: {wrong}\nOn reflection...\nAnswer: {gold}")
  assert (v.score, v.answer) == (0.0, wrong)  # the first Answer line, not the last
  assert _grade("gpqa", doc, f"Thinking... answer: ${gold}$\nAnswer: {wrong}").score == 1.0
  assert _grade("gpqa", doc, f"Answer: {gold.lower()}").score == 0.0  # (?i) matches it; "b" != "B"
  assert _grade("gpqa", doc, f"Answer: ({gold})\nAnswer: {wrong}").answer == wrong  # "(" is not in the pattern
  assert _grade("gpqa", doc, f"answer: ({wrong})").score == 0.0 and _grade("gpqa", doc, "no idea").answer is None
  assert get_format("gpqa").version == "2" and get_format("ifeval").version == "2"
  ll = load_docs(write_csv(tmp_path / "gpqa_ll.csv", GPQA), "gpqa.ll")
  assert ll[0].choices == (" (A)", " (B)", " (C)", " (D)") and ll[0].gold == "ABCD".index(gold)
  assert ll[0].prompt.startswith("What is the correct answer to this question:") and ll[0].prompt.endswith("Answer:")


def test_mmlu_pro_generative_extraction_and_loglikelihood(tmp_path):
  path = write_parquet(tmp_path / "test-00000-of-00001.parquet", MMLU_PRO)
  gen = load_docs(path, "mmlu_pro")
  assert [d.doc_id for d in gen] == ["70001", "70002"] and "about physics." in gen[0].prompt
  assert "J. weber\n" in gen[0].prompt and gen[0].prompt.endswith("Answer: Let's think step by step.")
  assert choices.extract_mmlu_pro("so the answer is (D).") == "D"
  assert choices.extract_mmlu_pro("Answer: B") == "B" and choices.extract_mmlu_pro("I pick C here") == "C"
  assert _grade("mmlu_pro", gen[0], "Force is mass times acceleration. The answer is (D)").score == 1.0
  assert _grade("mmlu_pro", gen[1], "The answer is (J)").reason == "J is not one of the 4 choices"
  ll = load_docs(path, "mmlu_pro.ll")
  assert len(ll[0].choices) == 10 and len(ll[1].choices) == 4 and (ll[0].gold, ll[1].gold) == (3, 2)
  bad = dict(MMLU_PRO[1], answer_index=1)
  with pytest.raises(TaskFormatError, match=r"bad.parquet:2: .*'answer_index' 1 disagrees with 'answer' 'C'"):
    load_docs(write_parquet(tmp_path / "bad.parquet", [MMLU_PRO[0], bad]), "mmlu_pro")


def test_ifeval_rows_are_checked_when_read(tmp_path):
  (doc,) = load_docs(write_parquet(tmp_path / "ifeval.parquet", IFEVAL), "ifeval")
  assert doc.doc_id == "1000" and doc.data["kwargs"][1]["num_highlights"] == 3
  row = dict(IFEVAL[0], kwargs=[{}, {}, {"relation": "at least", "num_words": 300}])
  with pytest.raises(TaskFormatError, match=r"x.jsonl:1: .*'kwargs'\[1\]: .*kwarg 'num_highlights' is missing"):
    load_docs(write_jsonl(tmp_path / "x.jsonl", [row]), "ifeval")
  row = dict(IFEVAL[0], instruction_id_list=["punctuation:semicolon", "startend:quotation", "startend:quotation"])
  with pytest.raises(TaskFormatError, match=r"'instruction_id_list'\[0\]: unknown IFEval instruction"):
    load_docs(write_jsonl(tmp_path / "y.jsonl", [row]), "ifeval")


def test_the_runner_runs_each_format_from_its_file(tmp_path, tok):
  tasks = (
    TaskSpec("aime24", write_parquet(tmp_path / "aime.parquet", AIME24), "aime"),
    TaskSpec("gpqa", write_csv(tmp_path / "gpqa.csv", GPQA), "gpqa"),
    TaskSpec("gpqa_ll", write_csv(tmp_path / "gpqa_ll.csv", GPQA), "gpqa.ll"),
    TaskSpec("mmlu_pro", write_parquet(tmp_path / "mmlu.parquet", MMLU_PRO), "mmlu_pro"),
    TaskSpec("ifeval", write_jsonl(tmp_path / "ifeval.jsonl", IFEVAL), "ifeval"),
  )
  gpqa = {d.prompt: d.data["answer"] for d in load_docs(tasks[1].path, "gpqa")}
  summary = "*Raymond III* was a count. *His rule* was long. *His legacy* lives on. " + "word " * 300

  def respond(prompt, seed):
    if "Aya" in prompt:
      return "\\boxed{204}"
    if "'Answer: $LETTER'" in prompt:
      return f"Answer: {next(a for p, a in gpqa.items() if p in prompt)}"
    if "The answer is (X)" in prompt:
      return "The answer is (D)."  # right on the first question, wrong on the second
    return summary.replace("count.", "count, and")  # a comma: one instruction of three broken

  gold = {"(A)": 0.0, "(B)": 0.0, "(C)": 0.0, "(D)": 0.0}
  model, _ = scripted_model(tok, respond, scorer=TextScorer(tok, gold | {"(A)": -1.0, "(B)": 1.0}))
  config = EvalConfig(model="scripted", tasks=tasks, out=str(tmp_path / "out"), max_tokens=400, progress=False)
  report = run(config, model)["tasks"]
  assert report["aime24"]["metrics"]["pass@1"] == 1.0 and report["aime24"]["metrics"]["maj@1"] == 1.0
  assert report["gpqa"]["metrics"]["pass@1"] == 1.0
  ll_gold = [d.gold for d in load_docs(tasks[2].path, "gpqa.ll")]
  assert report["gpqa_ll"]["metrics"]["acc"] == pytest.approx(sum(g == 1 for g in ll_gold) / 2)
  assert report["mmlu_pro"]["metrics"]["pass@1"] == 0.5
  m = report["ifeval"]["metrics"]
  assert m["prompt_level_strict_acc"] == 0.0 and m["inst_level_strict_acc"] == pytest.approx(2 / 3)
  assert report["ifeval"]["docs"][0]["samples"][0]["inst_strict"] == [False, True, True]
