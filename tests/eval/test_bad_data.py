"""Bad task data is refused by name (file, line, field) before any work, never with a raw traceback and never
with a report written: bytes that are not UTF-8, a `.gz` that is not gzip, NaN and infinite answers, a prompt
longer than the engine takes. What the files' publishers do write is read right: a UTF-8 byte-order mark, a
CSV field past the csv module's 128 KiB default, a float answer (1e20 is 100000000000000000000, not "1e+20").
A sample whose grading timed out is stored flagged, counted in the report, and graded again by a rerun."""

import csv
import gzip
import json
import os

import pytest

from k2jax.eval import EvalConfig, TaskFormatError, TaskSpec, load_docs, run
from k2jax.eval import runner as runner_lib
from k2jax.eval.grading import grade
from k2jax.eval.tasks import answer_text
from k2jax.eval.verdict import Verdict
from k2jax.sandbox.code import CodeRewardConfig

from .benchmark_rows import GPQA
from .conftest import scripted_model, write_jsonl


def _csv(path, rows, bom=False):
  with open(path, "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  return str(path)


def test_bytes_that_are_not_utf8_name_the_line_and_column(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n')
  with pytest.raises(TaskFormatError, match=r"bad.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
    load_docs(str(path), "answer.exact")
  gz = tmp_path / "bad.jsonl.gz"
  gz.write_bytes(gzip.compress(path.read_bytes()))
  with pytest.raises(TaskFormatError, match=r"bad.jsonl.gz:2: not UTF-8 text"):
    load_docs(str(gz), "answer.exact")
  rows = [dict(GPQA[0]), dict(GPQA[1])]
  bad_csv = tmp_path / "bad.csv"
  _csv(bad_csv, rows)
  data = bad_csv.read_bytes()
  cut = data.index(rows[1]["Question"].encode()[:8])
  bad_csv.write_bytes(data[:cut] + b"\xff" + data[cut:])
  with pytest.raises(TaskFormatError, match=r"bad.csv: file line 3: not UTF-8 text \(byte 0xff at column 12\)"):
    load_docs(str(bad_csv), "gpqa")


def test_json_nested_past_the_parsers_depth_names_the_line(tmp_path):
  path = tmp_path / "deep.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n' + '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
  with pytest.raises(TaskFormatError, match=r"deep.jsonl:2: not valid JSON \(nested too deep\)"):
    load_docs(str(path), "answer.exact")


def test_a_gz_that_is_not_gzip_or_is_cut_short(tmp_path):
  plain = tmp_path / "plain.jsonl.gz"
  plain.write_text('{"prompt": "1+1=", "answer": "2"}\n')  # named .gz, written plain
  with pytest.raises(TaskFormatError, match=r"plain.jsonl.gz: not a readable gzip file"):
    load_docs(str(plain), "answer.exact")
  whole = gzip.compress(
    b"".join(json.dumps({"prompt": f"{i}+0=", "answer": str(i)}).encode() + b"\n" for i in range(50))
  )
  cut = tmp_path / "cut.jsonl.gz"
  cut.write_bytes(whole[: len(whole) - 12])  # the trailer and the end of the stream lost
  with pytest.raises(TaskFormatError, match=r"cut.jsonl.gz: not a readable gzip file"):
    load_docs(str(cut), "answer.exact")


def test_csv_with_a_byte_order_mark_and_a_field_past_128_kib(tmp_path):
  long_question = "Which holds? " + "x" * (200 << 10)  # past the csv module's 131072-character default
  rows = [{**GPQA[0], "Question": long_question}, dict(GPQA[1])]
  docs = load_docs(_csv(tmp_path / "gpqa_diamond.csv", rows, bom=True), "gpqa")
  plain = load_docs(_csv(tmp_path / "plain.csv", rows), "gpqa")
  assert [d.data for d in docs] == [d.data for d in plain]  # the BOM is not part of the first column's name
  assert long_question in docs[0].prompt and docs[1].line == 2
  bom_jsonl = tmp_path / "bom.jsonl"
  bom_jsonl.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "1+1=", "answer": "2"}).encode() + b"\n")
  assert load_docs(str(bom_jsonl), "answer.exact")[0].data["answer"] == "2"
  extra = tmp_path / "extra.csv"
  extra.write_text("Question,Correct Answer\nq,a,surplus\n")
  with pytest.raises(TaskFormatError, match=r"extra.csv:1: 1 more cells than the header's 2"):
    load_docs(str(extra), "gpqa")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinite_answers_are_refused_by_line_and_field(tmp_path, token):
  path = tmp_path / "a.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "0/0=", "answer": ' + token + "}\n")
  for fmt in ("answer.exact", "answer.math"):
    with pytest.raises(TaskFormatError, match=rf"a.jsonl:2: not a {fmt} record: field 'answer' is -?(nan|inf)"):
      load_docs(str(path), fmt)
  with pytest.raises(TaskFormatError, match=r"b.jsonl:1: .*field 'answer' must be a string or a number, got bool"):
    load_docs(write_jsonl(tmp_path / "b.jsonl", [{"prompt": "t?", "answer": True}]), "answer.exact")


def test_float_answers_are_their_exact_decimals(tmp_path):
  assert [answer_text(v) for v in (1e20, 2.0, 0.1, 1.5e-7, -3.25, 1e23, 7, "1e20")] == [
    "100000000000000000000",
    "2",
    "0.1",
    "0.00000015",
    "-3.25",
    "100000000000000000000000",
    "7",
    "1e20",  # a string is the answer as written
  ]
  path = tmp_path / "big.jsonl"
  path.write_text('{"prompt": "10^20=", "answer": 1e20}\n')
  (doc,) = load_docs(str(path), "answer.exact")
  code = CodeRewardConfig()
  assert doc.data["answer"] == "100000000000000000000" and doc.target == " 100000000000000000000"
  assert grade("answer.exact", "t", doc, "100000000000000000000", "stop", code).score == 1.0
  assert grade("answer.exact", "t", doc, "1e+20", "stop", code).score == 0.0
  (math_doc,) = load_docs(str(path), "answer.math")
  assert math_doc.data["answer"] == "100000000000000000000"


def test_a_prompt_longer_than_the_engine_takes_names_the_row_before_any_request(tmp_path, tok):
  rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "word " * 400, "answer": "0"}]
  path = write_jsonl(tmp_path / "long.jsonl", rows)
  model, engine = scripted_model(tok, lambda prompt, seed: "2")
  model.max_seq_len = 64
  out = tmp_path / "out"
  config = EvalConfig("scripted", (TaskSpec("t", path, "answer.exact"),), str(out), max_tokens=8, progress=False)
  with pytest.raises(runner_lib.PromptTooLong, match=r"long.jsonl:2: task t doc 1: the prompt is \d+ tokens; the en"):
    run(config, model)
  assert engine.calls == [] and not os.path.exists(out / "report.json")
  assert issubclass(runner_lib.PromptTooLong, TaskFormatError)  # launch/eval.py prints it, without a traceback
  # A server's length is what its /get_model_info says (launch/serve.py: max_seq_len; others: context_length).
  assert runner_lib._served_length({"max_seq_len": 4096, "model_path": "/m"}) == 4096
  assert runner_lib._served_length({"context_length": 8192}) == 8192
  assert runner_lib._served_length({"max_seq_len": None}) is None and runner_lib._served_length(None) is None


def test_a_timed_out_grading_is_counted_and_graded_again_by_a_rerun(tmp_path, tok, monkeypatch):
  path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
  model, engine = scripted_model(tok, lambda prompt, seed: "2" if "1+1" in prompt else "4")
  config = EvalConfig("scripted", (TaskSpec("t", path, "answer.exact"),), str(tmp_path / "out"), progress=False)
  real = runner_lib.grade

  def slow_once(fmt, task, doc, text, finish, code):  # the grader ran out of time on doc 1
    v = real(fmt, task, doc, text, finish, code)
    return Verdict(0.0, None, "grader timed out", timed_out=True) if doc.doc_id == "1" else v

  monkeypatch.setattr(runner_lib, "grade", slow_once)
  first = run(config, model)["tasks"]["t"]
  assert (first["metrics"]["pass@1"], first["timed_out_samples"], len(engine.calls)) == (0.5, 1, 2)
  assert first["docs"][1]["samples"][0]["timed_out"] is True
  monkeypatch.setattr(runner_lib, "grade", real)
  again = run(config, model)["tasks"]["t"]
  assert (again["metrics"]["pass@1"], again["timed_out_samples"]) == (1.0, 0)
  assert len(engine.calls) == 2  # graded again from the stored text: nothing generated twice
  assert "timed_out" not in again["docs"][1]["samples"][0]


def test_graders_flag_a_math_timeout(monkeypatch):
  from k2jax.eval import grading
  from k2jax.eval.tasks import Doc

  monkeypatch.setattr(grading, "equivalent", lambda a, b: (False, "grader timed out (math-verify's 3 s limit)"))
  v = grading.grade("math", "m", Doc("0", "p", "", {"answer": "2"}), "\\boxed{2}", "stop", CodeRewardConfig())
  assert (v.score, v.timed_out) == (0.0, True)
  monkeypatch.setattr(grading, "equivalent", lambda a, b: (False, "3 != 2 (math-verify)"))
  v = grading.grade("math", "m", Doc("0", "p", "", {"answer": "2"}), "\\boxed{3}", "stop", CodeRewardConfig())
  assert (v.score, v.timed_out) == (0.0, False)
