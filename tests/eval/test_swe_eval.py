"""The `swe` task format of launch/eval.py's runner: each sample is one agentic episode (the RL tool loop and
TokenAgent, the SWE environment in-process) on the committed toy task set (data/swe/toy_tasks, RL's
`swe_tiny` tasks), graded by k2jax.swe.grade in the sandbox. A scripted engine emits known tool calls: the
gold fix scores 1.0 (resolved), doing nothing or a wrong fix 0.0, each with the grader's reason; a malformed
record names file, line and field; a rerun grades only what is missing; a grading infrastructure failure
fails the run naming the samples, never a 0."""

import json
import os
import pathlib
import shutil
import threading

import pytest

from k2jax.agentic.envs.swe import TOOLS, SweEnvConfig
from k2jax.agentic.tools import ToolRegistry
from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import load_tokenizer
from k2jax.engine.base import Engine, GenerateResult
from k2jax.eval import EngineFailed, EvalConfig, Model, TaskFormatError, TaskSpec, load_docs, run
from k2jax.eval.swe import InfraFailure
from k2jax.sandbox.runner import isolation_error
from k2jax.sandbox.workspace import WorkspaceRunConfig
from k2jax.swe.grade import GradeConfig
from k2jax.swe.instances import read_instances

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = os.path.join(ROOT, "data", "swe", "toy_tasks")
RL_TASKS = os.path.join(TASKS, "rl_tasks.jsonl")
NOT_ISOLATED = isolation_error()
needs_sandbox = pytest.mark.skipif(NOT_ISOLATED is not None, reason=f"no sandbox here: {NOT_ISOLATED}")
TOK = load_tokenizer()
INSTANCES = {i.instance_id: i for i in read_instances(os.path.join(TASKS, "instances.jsonl"))}
GOLD, NOTHING, WRONG = (
  "pypi__toycalc.1.1.negate_condition__1d2c69af",
  "pypi__toycalc.1.1.remove_return__d799422e",
  "pypi__toycalc.1.1.off_by_one__3a184be4",
)
SWE = SweEnvConfig(bash=WorkspaceRunConfig(timeout_s=30.0), grade=GradeConfig(run=WorkspaceRunConfig(timeout_s=60.0)))


def _call(name, **args):
  return (
    f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
    f"{json.dumps(args)}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
  )


def _gold_edit(instance_id):
  """The instance's gold patch as one editor str_replace (the toy patches change one hunk)."""
  patch = INSTANCES[instance_id].patch
  rel = patch.split("\n", 1)[0].split(" b/", 1)[1]
  minus = [x[1:] for x in patch.splitlines() if x.startswith("-") and not x.startswith("---")]
  plus = [x[1:] for x in patch.splitlines() if x.startswith("+") and not x.startswith("+++")]
  return _call("str_replace_editor", command="str_replace", path=rel, old_str="\n".join(minus), new_str="\n".join(plus))


SCRIPTS = {  # doc id -> the assistant turns the engine answers, in order
  GOLD: [_gold_edit(GOLD), _call("finish")],
  NOTHING: [_call("finish")],
  WRONG: [
    _call("str_replace_editor", command="create", path="toycalc/notes.py", file_text="NOTE = 'looked at it'\n"),
    _call("finish", message="done"),
  ],
}


class ScriptedAgentEngine(Engine):
  """Answers turn t of doc d (from the rid `eval/<run>/<task>/<doc>/<sample>-t<turn>`) with SCRIPTS[d][t]."""

  def __init__(self, scripts, die_at=None):
    self.scripts, self.die_at, self.rids, self._lock = scripts, die_at, [], threading.Lock()

  def generate(self, request):
    head, turn = request.rid.rsplit("-t", 1)
    doc = head.split("/")[3]
    with self._lock:
      self.rids.append(request.rid)
    if doc == self.die_at:
      raise RuntimeError("engine died")
    ids = tuple(TOK.encode_with_specials(self.scripts[doc][int(turn)]))[: request.sampling.max_new_tokens]
    return GenerateResult(request.rid, ids, (0.0,) * len(ids), (0,) * len(ids), "stop", len(request.input_ids))

  def abort(self, rids):
    pass

  def update_weights(self, model_path, weight_version):
    raise AssertionError("evaluation never updates weights")


def _model(engine):
  return Model(engine, TOK, (TOK.eos_id, TOK.special_ids["<|im_end|>"]), None, "scripted")


def _rows(path, ids):
  rows = {r["instance_id"]: r for r in map(json.loads, pathlib.Path(path).read_text().splitlines())}
  return [rows[i] for i in ids]


def _task_file(tmp_path, rows, name="swe.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _config(path, out, **kw):
  return EvalConfig("scripted", (TaskSpec("swe", path, "swe"),), str(out), progress=False, swe=SWE, **kw)


def test_the_rl_task_file_parses_as_swe_docs():
  docs = load_docs(RL_TASKS, "swe")
  assert [d.doc_id for d in docs] == [json.loads(x)["id"] for x in pathlib.Path(RL_TASKS).read_text().splitlines()]
  assert docs[0].prompt.startswith("Bug report:") and "demo" not in docs[0].data
  assert docs[0].data["instance_id"] == GOLD and docs[0].data["max_turns"] == 3


@pytest.mark.parametrize(
  "edit, where",
  [
    ({"instance_id": "no_such_instance"}, "field 'instance_id': no instance 'no_such_instance'"),
    ({"instance_id": 7}, "field 'instance_id' must be a non-empty string"),
    ({"task_set": "/nonexistent/tasks"}, "field 'task_set': /nonexistent/tasks has no instances.jsonl"),
    ({"max_turns": 0}, "field 'max_turns' must be an integer >= 1"),
    ({"instruction": None}, "field 'instruction' must be a non-empty string"),
  ],
)
def test_a_malformed_record_names_file_line_and_field(tmp_path, edit, where):
  rows = _rows(RL_TASKS, [GOLD, NOTHING])
  rows[1].update(edit)
  path = _task_file(tmp_path, rows)
  with pytest.raises(TaskFormatError) as e:
    load_docs(path, "swe")
  assert str(e.value).startswith(f"{path}:2: not a swe record: {where}"), str(e.value)


def test_a_record_without_its_task_set_names_the_field(tmp_path):
  rows = _rows(RL_TASKS, [GOLD])
  del rows[0]["task_set"]
  path = _task_file(tmp_path, rows)
  with pytest.raises(TaskFormatError, match=rf"^{path}:1: not a swe record: missing field 'task_set'"):
    run(_config(path, tmp_path / "out"), _model(ScriptedAgentEngine(SCRIPTS)))
  assert not os.path.exists(tmp_path / "out")  # read before any work: nothing written


@needs_sandbox
def test_gold_fix_resolves_nothing_and_wrong_fix_do_not_and_a_rerun_regrades_nothing(tmp_path):
  path = _task_file(tmp_path, _rows(RL_TASKS, [GOLD, NOTHING, WRONG]))
  out = tmp_path / "out"
  engine = ScriptedAgentEngine(SCRIPTS)
  first = run(_config(path, out, limit=1), _model(engine))  # the gold doc only
  assert first["tasks"]["swe"]["metrics"] == {"pass@1": 1.0, "mean@1": 1.0}
  assert [r.rsplit("/", 2)[1:] for r in engine.rids] == [[GOLD, "0-t0"], [GOLD, "0-t1"]]

  engine.rids.clear()
  report = run(_config(path, out), _model(engine))  # resumes: only the two docs the file lacks
  assert sorted({r.split("/")[3] for r in engine.rids}) == sorted([NOTHING, WRONG])
  task = report["tasks"]["swe"]
  assert task["format"] == "swe" and task["num_docs"] == 3
  assert task["metrics"]["pass@1"] == pytest.approx(1 / 3) and task["metrics"]["mean@1"] == pytest.approx(1 / 3)
  samples = {d["doc_id"]: d["samples"][0] for d in task["docs"]}
  gold, nothing, wrong = samples[GOLD], samples[NOTHING], samples[WRONG]
  assert gold == first["tasks"]["swe"]["docs"][0]["samples"][0]  # not rerun, not regraded
  assert (gold["score"], gold["verdict"], gold["resolved"], gold["pass_rate"]) == (1.0, "resolved", True, 1.0)
  assert gold["reason"].startswith("resolved: every FAIL_TO_PASS and PASS_TO_PASS test passed")
  assert gold["end"] == "env_done" and gold["turns"] == 2 and "+  if not values:" in gold["patch"]
  assert (nothing["score"], nothing["verdict"], nothing["reason"], nothing["patch"]) == (
    0.0,
    "unresolved",
    "no patch",
    "",
  )
  assert (wrong["score"], wrong["verdict"], wrong["pass_rate"]) == (0.0, "unresolved", 0.0)
  assert wrong["reason"].startswith("unresolved: 1 tests failed") and "test_median_even" in wrong["reason"]
  assert "toycalc/notes.py" in wrong["patch"]
  assert len((out / "samples.jsonl").read_text().splitlines()) == 3  # one line per sample, none written twice

  engine.rids.clear()
  again = run(_config(path, out), _model(engine))
  assert engine.rids == [] and again["tasks"]["swe"]["metrics"] == task["metrics"]
  assert "| swe | swe | 3 | 1 | pass@1 | 0.3333 |" in (out / "report.md").read_text()


@needs_sandbox
def test_a_patch_left_at_the_turn_limit_is_graded(tmp_path):
  """No finish: the record's max_turns ends the episode in the environment, which grades what is left."""
  row = _rows(RL_TASKS, [GOLD])[0]
  row["max_turns"] = 1
  path = _task_file(tmp_path, [row])
  engine = ScriptedAgentEngine({GOLD: [_gold_edit(GOLD)]})
  (sample,) = run(_config(path, tmp_path / "out"), _model(engine))["tasks"]["swe"]["docs"][0]["samples"]
  assert (sample["score"], sample["verdict"], sample["end"], sample["turns"]) == (1.0, "resolved", "env_done", 1)


@needs_sandbox
def test_a_patch_left_when_the_token_budget_runs_out_is_graded(tmp_path):
  """The episode's token budget stops the loop before the environment graded: the workspace as left is
  graded all the same (SWE-bench grades whatever patch the agent leaves)."""
  row = _rows(RL_TASKS, [GOLD])[0]
  path = _task_file(tmp_path, [row])
  tools = ToolRegistry(TOOLS).openai_tools()
  user = [{"role": "user", "content": row["instruction"]}]
  prompt = len(render_chat(user, tools, tokenizer=TOK, add_generation_prompt=True)[0])
  turn0 = len(TOK.encode_with_specials(_gold_edit(GOLD)))
  engine = ScriptedAgentEngine({GOLD: [_gold_edit(GOLD), _call("finish")]})
  # room for the prompt and the first turn (+ the budget's 1 spare token), none for a second turn
  config = _config(path, tmp_path / "out", max_tokens=turn0, max_episode_tokens=prompt + turn0 + 1)
  (sample,) = run(config, _model(engine))["tasks"]["swe"]["docs"][0]["samples"]
  assert [r.rsplit("-t", 1)[1] for r in engine.rids] == ["0"]
  assert (sample["end"], sample["turns"], sample["prompt_tokens"]) == ("budget", 1, prompt)
  assert (sample["score"], sample["verdict"], sample["pass_rate"]) == (1.0, "resolved", 1.0)
  assert "+  if not values:" in sample["patch"]


@needs_sandbox
def test_a_grading_infrastructure_failure_fails_the_run_and_is_retried_by_the_rerun(tmp_path):
  task_set = tmp_path / "tasks"
  shutil.copytree(TASKS, task_set)
  rows = _rows(RL_TASKS, [GOLD, WRONG])
  for r in rows:
    r["task_set"] = str(task_set)
  path = _task_file(tmp_path, rows)
  snapshot_file = os.path.join(INSTANCES[WRONG].snapshot_dir(str(task_set)), "CHANGELOG.md")
  pristine = pathlib.Path(snapshot_file).read_text()
  with open(snapshot_file, "a") as f:  # the snapshot no longer hashes to base_commit: grading cannot be trusted
    f.write("\nchanged after the build\n")
  out = tmp_path / "out"
  engine = ScriptedAgentEngine(SCRIPTS)
  with pytest.raises(InfraFailure, match=rf"task swe: 1 samples hit SWE grading infrastructure failures.*doc {WRONG}"):
    run(_config(path, out), _model(engine))
  stored = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
  assert [(r["doc_id"], r["score"]) for r in stored] == [(GOLD, 1.0)]  # the failure is not a stored 0
  assert not (out / "report.json").exists()

  with open(snapshot_file, "w") as f:
    f.write(pristine)
  engine.rids.clear()
  report = run(_config(path, out), _model(engine))
  assert {r.split("/")[3] for r in engine.rids} == {WRONG}
  assert report["tasks"]["swe"]["metrics"]["pass@1"] == 0.5


@needs_sandbox
def test_a_dying_engine_fails_the_run_naming_it(tmp_path):
  path = _task_file(tmp_path, _rows(RL_TASKS, [NOTHING]))
  with pytest.raises(EngineFailed, match=rf"engine at scripted failed on swe doc {NOTHING} sample 0: engine_error"):
    run(_config(path, tmp_path / "out"), _model(ScriptedAgentEngine(SCRIPTS, die_at=NOTHING)))
