"""The runner on a scripted engine: metrics from hand counts, few-shot and chat prompts, the report files,
resume after a failed run and a torn samples file (only the missing samples are made), a dead URL."""

import hashlib
import json
import math
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from k2jax.eval import EngineFailed, EvalConfig, TaskSpec, pass_at_k, run
from k2jax.eval.store import SAMPLES

from .conftest import GSM8K, MC, TextScorer, scripted_model, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHOTS = [{"question": "Shot one: 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}, {"question": "Shot two?", "answer": "#### 3"}]


def respond(prompt, seed):
  """Doc 0 right on even seeds, doc 1 always right, doc 2 always wrong."""
  question = prompt.rsplit("Question:", 1)[-1]
  if "Tom has" in question:
    return " 3 + 4 = 7\n#### 7" if seed % 2 == 0 else " #### 6"
  if "1,200 pens" in question:
    return " so 1000.\n#### 1,000\n\nQuestion: runaway"  # generation past the stop string is cut
  return " #### 41"


def _config(tmp_path, **kw):
  data = tmp_path / "data"
  data.mkdir(parents=True, exist_ok=True)
  tasks = (
    TaskSpec("gsm", write_jsonl(data / "gsm8k.jsonl", GSM8K), "gsm8k", write_jsonl(data / "shots.jsonl", SHOTS)),
    TaskSpec("mc", write_jsonl(data / "mc.jsonl", MC), "mc", num_fewshot=0),
  )
  base = dict(model="scripted", tasks=tasks, out=str(tmp_path / "out"), n=4, ks=(1, 2, 4), temperature=0.7)
  return EvalConfig(**{**base, "num_fewshot": 2, "concurrency": 3, "progress": False, **kw})


# "four" wins on the total (-5.5 > -6) but loses per character (-5.5/5 < -6/6): acc 1, acc_norm 0 on doc 1.
TABLE = {"Paris": -1.0, "Rome": -3.0, "Berlin": -2.0, "three": -6.0, "four": -5.5}


def test_metrics_prompts_and_report_files(tmp_path, tok):
  config = _config(tmp_path)
  model, engine = scripted_model(tok, respond, scorer=TextScorer(tok, TABLE))
  report = run(config, model)
  gsm = report["tasks"]["gsm"]
  assert len(engine.calls) == 12 and gsm["num_docs"] == 3 and gsm["n"] == 4
  even = [sum(s["seed"] % 2 == 0 for s in d["samples"]) for d in gsm["docs"]]
  for d, c_want in zip(gsm["docs"], [even[0], 4, 0]):  # hand count of correct samples per doc
    assert sum(s["score"] for s in d["samples"]) == c_want, d
  for k in (1, 2, 4):
    want = sum(pass_at_k(4, c, k) for c in (even[0], 4, 0)) / 3
    assert gsm["metrics"][f"pass@{k}"] == pytest.approx(want)
  assert gsm["metrics"]["mean@4"] == pytest.approx((even[0] / 4 + 1) / 3)
  assert gsm["metrics"]["maj@4"] == pytest.approx(
    (float(even[0] > 2 or (even[0] == 2 and gsm["docs"][0]["samples"][0]["seed"] % 2 == 0)) + 1) / 3
  )
  right = gsm["docs"][1]["samples"][0]
  assert right["text"] == " so 1000.\n#### 1,000\n\n" and right["answer"] == "1000"
  # Two shots, each prompt + target, before the question; seeds differ per sample.
  prompt = tok.decode(list(engine.calls[0].input_ids))
  assert prompt.startswith(
    "Question: Shot one: 1 + 1?\nAnswer: 1 + 1 = 2\n#### 2\n\nQuestion: Shot two?\nAnswer: #### 3\n\n"
  )
  assert len({r.sampling.seed for r in engine.calls}) == 12 and all(r.sampling.temperature == 0.7 for r in engine.calls)
  mc = report["tasks"]["mc"]
  assert mc["metrics"] == {"acc": 1.0, "acc_norm": 0.5} and mc["docs"][1]["samples"][0]["loglikelihoods"] == [
    -6.0,
    -5.5,
  ]
  # The report on disk is the one returned, with the config that made it; the table has every metric.
  out = config.out
  assert json.load(open(os.path.join(out, "report.json")))["tasks"]["gsm"]["metrics"] == gsm["metrics"]
  assert report["config"]["n"] == 4 and report["config"]["tasks"][0]["format"] == "gsm8k"
  # Each metric with its stderr over problems (sample std / sqrt(problems), as lm-eval) and their count.
  per_doc = [pass_at_k(4, c, 2) for c in (even[0], 4, 0)]
  assert gsm["stderr"]["pass@2"] == pytest.approx(float(np.std(per_doc, ddof=1) / math.sqrt(3)))
  assert gsm["count"] == {m: 3 for m in gsm["metrics"]} and gsm["num_samples"] == 12 and gsm["version"] == "1"
  assert mc["stderr"]["acc_norm"] == pytest.approx(0.5) and mc["count"]["acc"] == 2  # std([1, 0]) / sqrt(2)
  assert report["model"] == {
    "name": "scripted",
    "fingerprint": hashlib.sha256(b'{"label": "scripted"}').hexdigest(),
    "source": "the label of the engine handed to the run",
    "label": "scripted",
  }
  assert (
    gsm["fingerprint"]["model"] == report["model"]["fingerprint"][:16] and gsm["fingerprint"]["grader"] == "gsm8k/1"
  )
  md = open(os.path.join(out, "report.md")).read()
  assert md.startswith(f"model: scripted (fingerprint {report['model']['fingerprint']})\n")
  err = gsm["stderr"]["pass@2"]
  assert (
    f"| gsm | gsm8k | 3 | 4 | pass@2 | {gsm['metrics']['pass@2']:.4f} | {err:.4f} | 3 | 1 |" in md
    and "| mc | mc | 2 | 1 | acc_norm | 0.5000 | 0.5000 | 2 | 1 |" in md
  )
  assert len(open(os.path.join(out, SAMPLES)).read().splitlines()) == 12 + 2


def test_resume_scores_only_the_missing_samples(tmp_path, tok):
  config = _config(tmp_path)
  dying, dying_engine = scripted_model(tok, respond, fail_after=5, scorer=TextScorer(tok, TABLE))
  with pytest.raises(EngineFailed, match="engine at scripted failed on gsm doc"):
    run(config, dying)
  samples = os.path.join(config.out, SAMPLES)
  assert not os.path.exists(os.path.join(config.out, "report.json"))  # nothing half-written
  kept = open(samples).read().splitlines()
  # Every answer the engine gave before it died is kept, even when the failed call returned first (it
  # fails at once, the 5 answered calls still decode: the runner once raised before storing any of them).
  assert len(kept) == len(dying_engine.calls) == 5 and all(json.loads(line)["task"] == "gsm" for line in kept)
  with open(samples, "a") as f:
    f.write('{"task": "gsm", "doc_id": "2", "sam')  # a write the kill cut short
  model, engine = scripted_model(tok, respond, scorer=TextScorer(tok, TABLE))
  report = run(config, model)
  assert len(engine.calls) == 12 - len(kept)  # only the missing ones
  done = {(json.loads(line)["doc_id"], json.loads(line)["sample"]) for line in kept}
  assert not done & {(r.rid.split("/")[3], int(r.rid.split("/")[4])) for r in engine.calls}
  fresh_model, _ = scripted_model(tok, respond, scorer=TextScorer(tok, TABLE))
  fresh = run(_config(tmp_path / "fresh"), fresh_model)
  assert report["tasks"]["gsm"]["metrics"] == fresh["tasks"]["gsm"]["metrics"]
  assert [json.loads(line) for line in open(samples)][: len(kept)] == [json.loads(line) for line in kept]
  # A rerun of a finished run generates nothing; raising n makes only the new samples.
  again, engine = scripted_model(tok, respond, scorer=TextScorer(tok, TABLE))
  run(config, again)
  assert engine.calls == []
  more, engine = scripted_model(tok, respond, scorer=TextScorer(tok, TABLE))
  report = run(_config(tmp_path, n=6, ks=(1, 6)), more)
  assert len(engine.calls) == 6 and {int(r.rid.split("/")[4]) for r in engine.calls} == {4, 5}
  assert report["tasks"]["gsm"]["n"] == 6 and "pass@6" in report["tasks"]["gsm"]["metrics"]
  # Other sampling settings never mix with the stored samples.
  other, _ = scripted_model(tok, respond, scorer=TextScorer(tok, TABLE))
  with pytest.raises(ValueError, match="made with other settings"):
    run(_config(tmp_path, temperature=0.9), other)


def test_chat_template_prompts(tmp_path, tok):
  config = _config(tmp_path, chat=True, system="Be exact.", tasks=_config(tmp_path).tasks[:1])
  model, engine = scripted_model(tok, respond)
  run(config, model)
  ids = list(engine.calls[0].input_ids)
  sp = tok.special_ids
  assert ids.count(sp["<|im_user|>"]) == 3 and ids.count(sp["<|im_assistant|>"]) == 3  # 2 shots + the question
  assert ids[0] == sp["<|im_system|>"] and "Be exact." in tok.decode(ids)
  assert tok.decode(ids).endswith("assistant<|im_middle|>")


def test_bad_configs_are_refused(tmp_path, tok):
  with pytest.raises(ValueError, match="greedy samples would all be the same"):
    _config(tmp_path, temperature=0.0)
  with pytest.raises(ValueError, match="needs a fewshot_file"):
    run(_config(tmp_path, tasks=(TaskSpec("g", write_jsonl(tmp_path / "g.jsonl", GSM8K), "gsm8k"),)), None)
  model, _ = scripted_model(tok, respond)  # no scorer
  with pytest.raises(ValueError, match="multiple choice needs a scorer"):
    run(_config(tmp_path, tasks=_config(tmp_path).tasks[1:]), model)


def test_a_dead_url_fails_the_run_naming_it(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes
  config = _config(tmp_path, model=url, tokenizer="bundled")
  with pytest.raises(EngineFailed, match=f"engine at {url} is unreachable"):
    run(config)
  assert not os.path.exists(config.out)  # nothing written
  out = str(tmp_path / "cli_out")
  tasks = f"gsm=gsm8k:{config.tasks[0].path}"
  cmd = [sys.executable, "launch/eval.py", f"--model={url}", f"--tasks={tasks}", f"--out={out}", "--tokenizer=bundled"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and f"engine at {url} is unreachable" in proc.stderr, proc.stderr[-2000:]
  assert not os.path.exists(out)


def test_a_task_samples_as_its_own_entry_says(tmp_path, tok):
  """One run, one file: `greedy` decodes once at temperature 0 (its own n, ks, temperature, max_tokens),
  `sampled` four times at the run's 0.7; each report section has its own n and metrics."""
  base = _config(tmp_path).tasks[0]
  greedy = TaskSpec("greedy", base.path, "gsm8k", base.fewshot_file, n=1, ks=[1], temperature=0.0, max_tokens=7)
  config = _config(tmp_path, tasks=(greedy, TaskSpec("sampled", base.path, "gsm8k", base.fewshot_file)))
  model, engine = scripted_model(tok, respond)
  report = run(config, model)
  calls = {t: [r for r in engine.calls if f"/{t}/" in f"/{r.rid}/"] for t in ("greedy", "sampled")}
  assert len(calls["greedy"]) == 3 and len(calls["sampled"]) == 12
  assert all(r.sampling.temperature == 0.0 and r.sampling.max_new_tokens == 7 for r in calls["greedy"])
  assert all(r.sampling.temperature == 0.7 for r in calls["sampled"])
  g, s = report["tasks"]["greedy"], report["tasks"]["sampled"]
  assert g["n"] == 1 and set(g["metrics"]) == {"pass@1", "maj@1", "mean@1"} and s["n"] == 4
  assert g["metrics"]["pass@1"] == pytest.approx(sum(d["samples"][0]["score"] for d in g["docs"]) / 3)
  with pytest.raises(ValueError, match="task 'bad': .*greedy samples would all be the same"):
    run(_config(tmp_path, tasks=(TaskSpec("bad", base.path, "gsm8k", base.fewshot_file, n=2, temperature=0.0),)), model)
