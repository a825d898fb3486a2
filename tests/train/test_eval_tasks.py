"""Benchmark tasks inside pretraining / SFT (`eval.tasks.<name>`, `eval.tasks_file`; k2jax.eval.inloop): the
same runner as launch/eval.py on an embedded engine over the trainer's current weights, at the held-out
loss's steps (every `eval.every_steps` and at the end), logged as `eval/<task>/<metric>` in metrics.jsonl.

Tests here check the config boundary (a malformed entry fails naming its key, before anything compiles). The
2-process run with tasks is tests/train/test_multihost.py's (one 2-process launch for both): a generation task
and a multiple-choice task evaluated every 2 steps, then launch/eval.py on the checkpoints of steps 2 and 4 gives
the same numbers, the same greedy texts and the same log-likelihoods (`check_against_launch_eval` below).
"""

import json
import os
import subprocess
import sys

import pytest

from k2jax.data.eval_tasks import FORMATS, eval_task_section
from k2jax.eval import tasks as eval_tasks
from k2jax.model.config import ConfigError
from k2jax.train import loop
from k2jax.train.config import from_config_dict
from tests.eval_task_cases import MALFORMED
from tests.train import _util


def _write_jsonl(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


def _with_tasks(tasks=None, **overrides):
  c = _util.tiny_config(**overrides)
  c.unlock()
  for name, values in (tasks or {}).items():
    c.eval.tasks[name] = eval_task_section(**values)
  c.lock()
  return c


def test_the_format_names_are_the_runners():
  """The data layer declares the formats every loop's config accepts; k2jax.eval.tasks parses each."""
  assert set(FORMATS) == set(eval_tasks._FORMATS)
  for fmt in FORMATS:
    assert eval_tasks.get_format(fmt).name == fmt


@pytest.mark.parametrize("values, key", MALFORMED)
def test_a_malformed_eval_task_fails_naming_the_key(values, key):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    from_config_dict(_with_tasks({"bad": values}))


def test_eval_tasks_alone_enable_every_steps():
  """eval.every_steps needs something to evaluate: held-out loss or eval.tasks."""
  with pytest.raises(ConfigError, match=r"eval\.every_steps"):
    from_config_dict(_util.tiny_config(**{"eval.every_steps": 2}))
  tc = from_config_dict(_with_tasks({"t": {"path": "x.jsonl"}}, **{"eval.every_steps": 2}))
  assert tc.eval.has_tasks and not tc.eval.enabled and tc.eval.tasks["t"].format == "answer.exact"


def test_the_loop_checks_the_tasks_before_compiling(tmp_path):
  """A missing task file, a bad record and a bad tasks_file item fail loop.run at start, naming the key
  (and file and line); eval.tasks without an evaluator (loop.run called without launch/train.py's) too."""
  from k2jax.eval.inloop import train_evaluator

  workdir = str(tmp_path / "w")
  c = _with_tasks({"gen": {"path": str(tmp_path / "none.jsonl")}}, **{"steps": 2})
  with pytest.raises(ConfigError, match=r"eval\.tasks\.gen\.path: no such file .*none\.jsonl"):
    loop.run(c, workdir, task_eval=train_evaluator)
  with pytest.raises(ConfigError, match=r"eval\.tasks: benchmark tasks need an evaluator"):
    loop.run(c, workdir)
  bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "no answer"}])
  c = _with_tasks({"gen": {"path": bad}}, **{"steps": 2})
  with pytest.raises(ConfigError, match=r"eval\.tasks\.gen: .*bad\.jsonl:2: .*missing field .answer."):
    loop.run(c, workdir, task_eval=train_evaluator)
  items = tmp_path / "tasks.json"
  items.write_text(json.dumps([{"name": "more", "path": bad, "temperature": -1.0}]))
  c = _util.tiny_config(**{"steps": 2, "eval.tasks_file": str(items)})
  with pytest.raises(ConfigError, match=r"eval\.tasks_file\[0\]\.temperature"):
    loop.run(c, workdir, task_eval=train_evaluator)
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))


GEN = [{"id": f"g{i}", "prompt": p, "answer": "alpha"} for i, p in enumerate(["The", "Once upon", "A cat", "1 2 3"])]
MC = [
  {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
  {"question": "Two plus two is", "choices": ["four", "five"], "answer": "A"},
  {"question": "A cat says", "choices": ["woof", "meow", "moo"], "answer": 1},
  {"question": "Ice is", "choices": ["hot", "cold"], "answer": 1},
  {"question": "The sun rises in the", "choices": ["west", "east", "north", "south"], "answer": 1},
]


def samples(out: str) -> dict:
  with open(os.path.join(out, "samples.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return {(r["task"], r["doc_id"], r["sample"]): r for r in rows}


def tasks_file(tmp_path) -> tuple[str, str, str]:
  gen = _write_jsonl(tmp_path / "gen.jsonl", GEN)
  mc = _write_jsonl(tmp_path / "mc.jsonl", MC)
  items = tmp_path / "tasks.json"
  tasks = [
    {"name": "gen", "format": "answer.exact", "path": gen, "max_tokens": 6},
    {"name": "choice", "format": "mc", "path": mc},
  ]
  items.write_text(json.dumps(tasks))
  return str(items), gen, mc


def check_against_launch_eval(model: str, out: str, workdir: str, step: int, record: dict, gen: str, mc: str, cache):
  """launch/eval.py on `model` (a workdir whose newest checkpoint is `step`) into `out`: the same metrics as
  the training run's eval line `record`, the same greedy texts, log-likelihoods within 1e-5."""
  cmd = [
    sys.executable,
    os.path.join(_util.ROOT, "launch/eval.py"),
    f"--model={model}",
    f"--tasks=gen=answer.exact:{gen},choice=mc:{mc}",
    f"--out={out}",
    "--max_tokens=6",
    "--max_running_requests=8",
    "--max_seq_len=128",
    "--noprogress",
  ]
  e = subprocess.run(cmd, cwd=_util.ROOT, env=_util.env(cache_dir=cache), capture_output=True, text=True, timeout=600)
  assert e.returncode == 0, e.stdout[-3000:] + e.stderr[-5000:]
  with open(os.path.join(out, "report.json")) as f:
    report = json.load(f)
  for task in ("gen", "choice"):
    for metric, value in report["tasks"][task]["metrics"].items():
      assert record[f"eval/{task}/{metric}"] == pytest.approx(value, abs=1e-12), (step, task, metric)
  theirs = samples(out)
  ours = {
    **samples(os.path.join(workdir, "eval", "gen", str(step))),
    **samples(os.path.join(workdir, "eval", "choice", str(step))),
  }
  assert ours.keys() == theirs.keys() and len(ours) == len(GEN) + len(MC)
  for k, row in ours.items():
    if k[0] == "gen":
      assert row["text"] == theirs[k]["text"] and row["completion_tokens"] == theirs[k]["completion_tokens"] > 0
    else:
      assert row["loglikelihoods"] == pytest.approx(theirs[k]["loglikelihoods"], abs=1e-5)
      assert (row["acc"], row["acc_norm"]) == (theirs[k]["acc"], theirs[k]["acc_norm"])


# The training flags of the 2-process run with tasks (tests/train/test_multihost.py).
COMMON = {
  "checkpoint.async_save": False,
  "log.every_steps": 1,
  "optim.peak_lr": 3e-3,
  "eval.engine_max_seq_len": 128,
}
