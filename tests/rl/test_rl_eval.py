"""Evaluation during RL (k2jax/rl/evaluation.py): `eval.tasks.<name>` held-out files and the tasks' own prompts run
through k2jax.eval's runner on the rollout engine after each push, logged as `eval/<task>/<metric>`.

Fast tests check the config boundary (a malformed eval task fails naming its key, before any model is built)
and the own-prompts file. The slow one runs the tiny RL learner for 3 iterations with eval.every=2 and checks
the iterations evaluated (the warm start, 2, and the end), that each logged number is what its samples file
gives by hand (pass@k's closed form, mean@n, eval_accuracy), and that `launch/eval.py`'s runner on the final
checkpoint, in an engine of its own, computes the same greedy numbers and texts.
"""

import importlib.util
import json
import math
import os

import jax
import pytest

from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import load_tokenizer
from k2jax.eval import runner
from k2jax.model.config import ConfigError
from k2jax.rl import config as rl_config
from k2jax.rl.evaluation import Evaluator
from k2jax.rl.learner import Learner, from_config_dict
from k2jax.rl.tasks import ArithmeticTask, ArithmeticTaskConfig, JsonlTask, TaskSet, make_tasks, stop_ids, strip_stop
from tests.eval_task_cases import MALFORMED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("rl_config_file", os.path.join(ROOT, "configs", "rl.py"))
rl_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rl_configs)

HELD = [("2+3", "5"), ("2+0", "2"), ("0+4", "4"), ("3+3", "6"), ("2+6", "8")]  # a=0,2,3: never a training prompt


def _write_jsonl(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


def _config(eval_tasks=None, **overrides):
  c = rl_configs.get_config("tiny")
  c.unlock()
  for key, value in overrides.items():
    *sections, name = key.split(".")
    node = c
    for section in sections:
      node = node[section]
    node[name] = value
  for name, values in (eval_tasks or {}).items():
    c.eval.tasks[name] = rl_config.eval_task_section(**values)
  c.lock()
  return c


def _model(tok):
  return runner.Model(None, tok, (tok.eos_id,), None, "a test engine")


def _evaluator(tmp_path, tasks, spec=None, task_set=None):
  tok = load_tokenizer()
  lc = from_config_dict(_config(tasks), str(tmp_path), (tok.eos_id,))
  task_set = task_set or TaskSet([(ArithmeticTask(lc.task, tok.encode, tok.eos_id), 1)])
  return Evaluator(spec or lc.spec.eval, task_set, tok, _model(tok), str(tmp_path), lambda name: 4)


@pytest.mark.parametrize("values, key", MALFORMED)
def test_a_malformed_eval_task_fails_naming_the_key(tmp_path, values, key):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    from_config_dict(_config({"bad": values}), str(tmp_path), (1,))


def test_an_unknown_eval_task_key_fails_naming_it(tmp_path):
  c = _config()
  c.unlock()
  c.eval.tasks["bad"] = {"path": "x.jsonl", "shots": 3}
  with pytest.raises(ConfigError, match=r"eval\.tasks\.bad: unknown key\(s\) \['shots'\]"):
    from_config_dict(c, str(tmp_path), (1,))


def test_eval_task_files_and_names_are_checked_at_start(tmp_path):
  with pytest.raises(ConfigError, match=r"eval\.tasks\.bad\.path: no such file"):
    _evaluator(tmp_path, {"bad": {"path": str(tmp_path / "none.jsonl")}})
  broken = _write_jsonl(tmp_path / "broken.jsonl", [{"prompt": "1+1", "answer": "2"}, {"prompt": "1+2"}])
  with pytest.raises(ConfigError, match=r"eval\.tasks\.bad: .*broken\.jsonl:2: not a answer\.exact record"):
    _evaluator(tmp_path, {"bad": {"path": broken}})
  good = _write_jsonl(tmp_path / "good.jsonl", [{"prompt": "1+1", "answer": "2"}])
  with pytest.raises(ConfigError, match=r"eval\.tasks\.arith: the name is an RL task's"):
    _evaluator(tmp_path, {"arith": {"path": good}})
  mc = _write_jsonl(tmp_path / "mc.jsonl", [{"question": "1+1", "choices": ["2", "3"], "answer": 0}])
  with pytest.raises(ConfigError, match=r"eval\.tasks\.bad\.format: 'mc' is scored by log-likelihood"):
    _evaluator(tmp_path, {"bad": {"path": mc, "format": "mc"}})
  spec = rl_config.EvalSpec(train_prompts=False)
  with pytest.raises(ConfigError, match=r"eval\.every: no eval task"):
    _evaluator(tmp_path, {}, spec=spec)


def test_eval_tasks_file_adds_tasks_checked_like_sections(tmp_path):
  good = _write_jsonl(tmp_path / "good.jsonl", [{"prompt": "1+1", "answer": "2"}])
  items = [{"name": "a", "path": good}, {"name": "b", "path": good, "n": 3, "ks": [1, 3], "temperature": 0.7}]
  tasks_file = tmp_path / "tasks.json"
  tasks_file.write_text(json.dumps(items))
  tok = load_tokenizer()
  c = _config({"s": {"path": good}})
  c.unlock()
  c.eval.tasks_file = str(tasks_file)
  lc = from_config_dict(c, str(tmp_path), (tok.eos_id,))
  task_set = TaskSet([(ArithmeticTask(lc.task, tok.encode, tok.eos_id), 1)])
  ev = Evaluator(lc.spec.eval, task_set, tok, _model(tok), str(tmp_path), lambda name: 4)
  by_name = {t.name: t.config for t in ev.tasks}
  assert list(by_name) == ["arith", "s", "a", "b"]
  assert by_name["b"].n == 3 and by_name["b"].ks == (1, 3) and by_name["b"].temperature == 0.7
  assert by_name["a"].max_tokens == 4 and by_name["a"].temperature == 0.0
  for bad, match in (
    ([{"name": "a", "path": good}, {"name": "b", "path": good, "n": 2}], r"eval\.tasks_file\[1\]\.n: "),
    ([{"path": good}], r"eval\.tasks_file\[0\]: each task needs a 'name'"),
    ([{"name": "s", "path": good}], r"eval\.tasks_file: task names repeat"),
    ({"name": "a"}, r"eval\.tasks_file: .* a JSON list"),
  ):
    tasks_file.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=match):
      Evaluator(lc.spec.eval, task_set, tok, _model(tok), str(tmp_path), lambda name: 4)


def test_own_prompts_are_written_as_an_answer_task_the_runner_renders_identically(tmp_path):
  tok = load_tokenizer()
  arith = ArithmeticTask(ArithmeticTaskConfig(1, 1, 0, 8, 0, "{a}+{b}"), tok.encode, tok.eos_id)
  records = [{"id": "x", "question": "2+2?", "answer": "4"}, {"id": "y", "prompt": "3+3?", "answer": 6}]
  chat = JsonlTask("chat", _write_jsonl(tmp_path / "chat.jsonl", records), tok, "exact")
  ev = Evaluator(rl_config.EvalSpec(), TaskSet([(arith, 1), (chat, 1)]), tok, _model(tok), str(tmp_path), len)
  by_name = {t.name: t for t in ev.tasks}
  assert set(by_name) == {"arith", "chat"} and all(t.own for t in ev.tasks)
  assert not by_name["arith"].config.chat and by_name["chat"].config.chat
  assert by_name["arith"].config.max_tokens == len("arith") and by_name["arith"].config.temperature == 0
  for name, task in (("arith", arith), ("chat", chat)):
    cfg = by_name[name].config
    spec = cfg.tasks[0]
    assert spec.format == "answer.exact" and spec.path == str(tmp_path / "eval" / "data" / f"{name}.jsonl")
    docs, shots = runner._docs(spec, cfg)
    prompts = task.all_prompts()
    assert [d.doc_id for d in docs] == [p.prompt_id for p in prompts]
    assert [d.data["answer"] for d in docs] == [p.data["answer"] for p in prompts]
    fmt = runner.get_format(spec.format)
    assert [runner._prompt_ids(cfg, tok, fmt, d, shots) for d in docs] == [list(p.input_ids) for p in prompts]
  # A per-record system prompt is not what the runner renders: the run fails at start, naming the knob.
  sys_task = JsonlTask(
    "sys", _write_jsonl(tmp_path / "sys.jsonl", [{**records[0], "system": "Be brief."}]), tok, "exact"
  )
  with pytest.raises(ConfigError, match=r"eval\.train_prompts: task 'sys'"):
    Evaluator(rl_config.EvalSpec(), TaskSet([(sys_task, 1)]), tok, _model(tok), str(tmp_path), len)
  ids, _ = render_chat([{"role": "user", "content": "2+2?"}], tokenizer=tok, add_generation_prompt=True)
  assert list(chat.all_prompts()[0].input_ids) == ids


def _pass_at_k(n, c, k):
  return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _samples(workdir, task, iteration):
  path = os.path.join(workdir, "eval", task, str(iteration), "samples.jsonl")
  by_doc = {}
  for line in open(path):
    r = json.loads(line)
    by_doc.setdefault(r["doc_id"], {})[r["sample"]] = r
  return {d: [s[i] for i in sorted(s)] for d, s in by_doc.items()}


@pytest.mark.slow  # one compiled tiny RL run (3 iterations) and a second engine on its checkpoint
def test_rl_logs_held_out_tasks_through_the_eval_runner(tmp_path):
  held = _write_jsonl(tmp_path / "held.jsonl", [{"id": q, "prompt": q, "answer": a} for q, a in HELD])
  workdir = str(tmp_path / "rl")
  config = _config(
    {
      "held": {"path": held},
      "held_sampled": {"path": held, "n": 4, "ks": (1, 2, 4), "temperature": 1.0, "seed": 3},
    },
    **{
      "iterations": 3,
      "eval.every": 2,
      "checkpoint.every": 3,
      "warm_start.steps": 20,  # the format (a digit, then EOS): samples stop, so answers can be right
      "warm_start.batch_size": 8,
      "loss.ptx_coef": 0.0,
      "rollout.group_size": 4,
      "rollout.target_groups": 2,
      "rollout.launch_groups": 2,
    },
  )
  tok = load_tokenizer()
  task = make_tasks(config, tok)
  lc = from_config_dict(config, workdir, stop_ids(task, tok))
  # One trainer device: the evaluation is the subject, not the mesh (the suite's 8 fake devices would cost
  # 8-device compiles and collectives).
  learner = Learner(lc, workdir, task, strip_stop(tok.decode, lc.rollout.stop_token_ids), devices=jax.devices()[:1])
  try:
    assert learner.core.mesh.devices.size == 1 and learner.state.step.sharding.device_set == {jax.devices()[0]}
    learner.train()
  finally:
    learner.close()
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evaluated = {r["step"]: r for r in records if "eval/held/pass@1" in r}
  assert sorted(evaluated) == [0, 2, 3]  # after the warm start, every 2 iterations, and at the end
  assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2, 3]
  assert all("reward_mean" in r for s, r in evaluated.items() if s > 0)  # beside the training reward
  # Non-trivial numbers: some samples stop and some are right, so the checks below compare real counts.
  sampled_all = [x for step in evaluated for s in _samples(workdir, "held_sampled", step).values() for x in s]
  assert any(x["finish_reason"] == "stop" for x in sampled_all) and 0 < sum(x["score"] for x in sampled_all)
  for step, rec in evaluated.items():
    assert rec["eval_weight_version"] == rec["weight_version"]
    # Held-out greedy task: pass@1 = mean@1 = the share of exact answers.
    greedy = _samples(workdir, "held", step)
    assert sorted(greedy) == sorted(q for q, _ in HELD) and all(len(s) == 1 for s in greedy.values())
    want = sum(s[0]["score"] for s in greedy.values()) / len(HELD)
    assert rec["eval/held/pass@1"] == pytest.approx(want) and rec["eval/held/mean@1"] == pytest.approx(want)
    for s in greedy.values():
      assert s[0]["score"] == float(s[0]["text"].strip() == dict(HELD)[s[0]["doc_id"]])
    # Sampled task: pass@k is the closed form per doc, averaged; mean@4 the mean score.
    sampled = _samples(workdir, "held_sampled", step)
    assert all(len(s) == 4 for s in sampled.values())
    for k in (1, 2, 4):
      want = sum(_pass_at_k(4, sum(x["score"] == 1 for x in s), k) for s in sampled.values()) / len(HELD)
      assert rec[f"eval/held_sampled/pass@{k}"] == pytest.approx(want), k
    mean = sum(x["score"] for s in sampled.values() for x in s) / (4 * len(HELD))
    assert rec["eval/held_sampled/mean@4"] == pytest.approx(mean)
    assert "eval/held_sampled/maj@2" in rec
    # The toy accuracy is the task's own prompts (every distinct 1+b), now one task among the others.
    own = _samples(workdir, "arith", step)
    assert len(own) == 9
    assert rec["eval_accuracy"] == pytest.approx(sum(s[0]["score"] for s in own.values()) / 9)
    assert rec["eval/arith/pass@1"] == rec["eval_accuracy"]
  # launch/eval.py's runner on the final checkpoint (its own engine) gives the same greedy samples.
  cfg = runner.EvalConfig(
    model=workdir,
    tasks=(runner.TaskSpec("held", held, "answer.exact"),),
    out=str(tmp_path / "eval_cli"),
    max_tokens=lc.rollout.budget("arith"),
    max_seq_len=lc.engine.max_seq_len,
    progress=False,
  )
  report = runner.run(cfg)
  assert report["tasks"]["held"]["metrics"]["pass@1"] == pytest.approx(evaluated[3]["eval/held/pass@1"])
  final = _samples(workdir, "held", 3)
  assert {d["doc_id"]: d["samples"][0]["text"] for d in report["tasks"]["held"]["docs"]} == {
    d: s[0]["text"] for d, s in final.items()
  }
