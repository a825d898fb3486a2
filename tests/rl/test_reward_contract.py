"""The one reward contract: every kind through `make_reward` (group signature), with real numbers; task sets
(mixing, budgets, warm-start demos); agentic episodes in the rollout manager keep tool results out of the loss."""

import importlib.util
import json
import os

import numpy as np
import pytest

from k2jax.agentic.envs.simulated import SimToolsEnv
from k2jax.agentic.rollout import EpisodeRunner, MultiTurnConfig
from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import load_tokenizer
from k2jax.engine.base import Engine, GenerateResult
from k2jax.grading.base import Completion, Prompt
from k2jax.grading.contract import REWARD_KINDS, EngineJudge, RewardConfig, make_reward
from k2jax.rl.rollout import RolloutConfig, RolloutManager
from k2jax.rl.tasks import AgenticTask, JsonlTask, TaskSet, make_tasks, task_budgets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("rl_config_file", os.path.join(ROOT, "configs", "rl.py"))
rl_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rl_configs)

TOK = load_tokenizer()


def _c(text, finish="stop", **info):
  return Completion((), text, finish, finish == "length", info)


def _rewards(kind, prompt, completions, **kw):
  return [r.reward for r in make_reward(kind, **kw)(prompt, completions)]


class ScriptedJudge:
  """Answers like a judge model: a fixed SCORE, or the pairwise verdict for the answer containing 'good'."""

  def __init__(self, score="7"):
    self.score, self.seen = score, []

  def text(self, messages):
    text = messages[-1]["content"]
    self.seen.append(text)
    if "[[A]]" in text:  # pairwise rubric comparison
      a, b = text.split("[Answer A]")[-1].split("[Answer B]") if "[Answer A]" in text else (text, "")
      return "[[A]]" if "good" in a and "good" not in b else "[[B]]" if "good" in b else "[[TIE]]"
    return f"Reasoning.\nSCORE: {self.score}/10"


def test_exact_and_math():
  p = Prompt("p", "t", (1,), "2+3", {"answer": "5"})
  assert _rewards("exact", p, [_c("5"), _c(" 5 "), _c("6"), _c("5", "length")]) == [1.0, 1.0, 0.0, 0.0]
  assert _rewards("math", p, [_c("so \\boxed{5}"), _c("\\boxed{10/2}"), _c("5"), _c("\\boxed{4}")]) == [
    1.0,
    1.0,
    0.0,
    0.0,
  ]
  with pytest.raises(KeyError, match=r"math reward: prompt q \(task 't'\) has no data\['answer'\]"):
    make_reward("math")(Prompt("q", "t", (1,)), [_c("\\boxed{1}")])


def test_code_runs_tests_in_the_sandbox():
  p = Prompt("p", "code", (1,), "", {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]})
  right = "```python\ndef add(a, b):\n  return a + b\n```"
  half = "```python\ndef add(a, b):\n  return 3\n```"
  assert _rewards("code", p, [_c(right), _c(half), _c("no code")]) == [1.0, 0.5, 0.0]
  with pytest.raises(KeyError, match="tests"):
    make_reward("code")(Prompt("q", "code", (1,)), [_c(right)])


def test_instruction_from_task_data():
  cons = [
    {"kind": "word_count", "max_words": 3},
    {"kind": "no_commas"},
    {"kind": "include_keywords", "keywords": ["sea"]},
  ]
  p = Prompt("p", "if", (1,), "", {"constraints": cons})
  got = _rewards(
    "instruction", p, [_c("the sea"), _c("the sea, wide"), _c("a, b, c, d"), _c("I followed all the instructions, sea")]
  )
  assert got == pytest.approx([1.0, 1 / 3 * 2, 0.0, 0.0])  # the last: claims compliance it lacks (hack-check)
  with pytest.raises(ValueError, match=r"constraints\[0\]: unknown kind 'words'"):
    make_reward("instruction")(Prompt("q", "if", (1,), "", {"constraints": [{"kind": "words"}]}), [_c("x")])
  with pytest.raises(ValueError, match=r"constraints\[0\] \(word_count\)"):
    make_reward("instruction")(
      Prompt("q", "if", (1,), "", {"constraints": [{"kind": "word_count", "x": 1}]}), [_c("x")]
    )


def test_judge_reads_criteria_and_scores():
  judge = ScriptedJudge("7")
  p = Prompt("p", "judge", (1,), "Capital of France?", {"criteria": "Names Paris."})
  assert _rewards("judge", p, [_c("Paris"), _c("Lyon")], judge=judge) == [0.7, 0.7]
  assert "Names Paris." in judge.seen[0] and "Capital of France?" in judge.seen[0] and "Lyon" in judge.seen[1]
  default = RewardConfig().judge_criteria
  make_reward("judge", judge=judge)(Prompt("q", "judge", (1,), "Hi"), [_c("x")])
  assert default in judge.seen[-1]
  assert _rewards("judge", p, [_c("x")], judge=ScriptedJudge("no verdict")) == [0.0]
  with pytest.raises(ValueError, match="needs a judge"):
    make_reward("judge")


def test_rubric_ranks_the_group_pairwise():
  p = Prompt("p", "rubric", (1,), "Greet.", {"rubrics": ["Friendly."]})
  judge = ScriptedJudge()
  got = _rewards("rubric", p, [_c("a good greeting"), _c("meh"), _c("meh too")], judge=judge)
  assert got == [1.0, 0.25, 0.25]  # wins all 4 games; the two others tie each other and lose to it
  assert any("Friendly." in s for s in judge.seen)


def test_env_reward_and_unknown_kind():
  p = Prompt("p", "sim", ())
  assert _rewards("env", p, [_c("", env_reward=0.75, end="env_done"), _c("", env_reward=0.0)]) == [0.75, 0.0]
  with pytest.raises(KeyError, match="env_reward"):
    make_reward("env")(p, [_c("")])
  with pytest.raises(ValueError, match="unknown reward kind 'bleu'"):
    make_reward("bleu")
  assert set(REWARD_KINDS) == {"exact", "math", "code", "instruction", "judge", "rubric", "env"}


class ScriptEngine(Engine):
  """Answers every request with the tokens of `script(request)`, logprob -0.5, version 1."""

  def __init__(self, script):
    self.script, self.requests = script, []

  def generate(self, request):
    self.requests.append(request)
    out = tuple(self.script(request))
    finish = "stop" if out and out[-1] in request.sampling.stop_token_ids else "length"
    out = out[: request.sampling.max_new_tokens]
    return GenerateResult(
      request.rid, out, (-0.5,) * len(out), (1,) * len(out), finish, prompt_tokens=len(request.input_ids)
    )

  def abort(self, rids):
    pass

  def update_weights(self, model_path, weight_version):
    pass


def test_engine_judge_renders_chat_and_decodes():
  engine = ScriptEngine(lambda r: TOK.encode_with_specials("SCORE: 9/10<|im_end|>"))
  judge = EngineJudge(engine, TOK, max_new_tokens=16)
  assert _rewards("judge", Prompt("p", "j", (1,), "Q"), [_c("A")], judge=judge) == [0.9]
  (req,) = engine.requests
  assert req.sampling.temperature == 0.0 and TOK.decode(list(req.input_ids)).endswith("assistant<|im_middle|>")


def _write(tmp_path, name, records):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def test_task_set_mixes_by_weight_and_dispatches_rewards(tmp_path):
  math = JsonlTask("math", _write(tmp_path, "m.jsonl", [{"question": "1+1?", "answer": 2}]), TOK, "math")
  code = JsonlTask("code", _write(tmp_path, "c.jsonl", [{"prompt": "f", "tests": ["assert True"]}]), TOK, "code")
  mix = TaskSet([(math, 2), (code, 1)])
  names = [mix.prompt(i).task for i in range(7)]
  assert names == ["math", "math", "code", "math", "math", "code", "math"]
  assert [mix.prompt(i).prompt_id for i in (0, 1, 3)] == ["math/0/0", "math/0/1", "math/0/2"]  # per-task index
  fn = mix.reward_fn()
  assert [r.reward for r in fn(mix.prompt(0), [_c("\\boxed{2}"), _c("\\boxed{3}")])] == [1.0, 0.0]
  assert [r.reward for r in fn(mix.prompt(2), [_c("```python\npass\n```")])] == [1.0]
  with pytest.raises(ValueError, match="not a single-turn reward kind"):
    JsonlTask("x", str(tmp_path / "m.jsonl"), TOK, "env")
  with pytest.raises(ValueError, match=r"c2.jsonl:1: a code record needs \['tests'\]"):
    JsonlTask("code", _write(tmp_path, "c2.jsonl", [{"prompt": "f"}]), TOK, "code")


def test_agentic_tiny_config_builds_every_kind_with_its_budget():
  c = rl_configs.get_config("agentic_tiny")
  tasks = make_tasks(c, TOK)
  assert tasks.reward_kinds == {
    "code": "code",
    "instruction": "instruction",
    "judge": "judge",
    "math": "math",
    "rubric": "rubric",
    "sim_tools": "env",
  }
  assert dict(task_budgets(c)) == {"code": 16, "instruction": 12, "judge": 8, "math": 12, "rubric": 8, "sim_tools": 128}
  assert sorted(tasks.prompt(i).task for i in range(6)) == sorted(tasks.reward_kinds)  # one of each per 6 prompts
  assert tasks.envs == ["sim_tools"] and tasks.needs_judge
  # The warm start teaches the demo tool call after the environment's first observation.
  (prompt, response), *_ = tasks.format_examples(2, np.random.default_rng(0))
  assert TOK.decode(prompt).endswith("assistant<|im_middle|>") and "list_files" in TOK.decode(prompt)
  assert TOK.decode(response) == (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.list_files:0<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
  )
  c.unlock()
  c.tasks.math.reward = "env"
  with pytest.raises(Exception, match=r"tasks.math.reward: 'env' does not fit kind 'jsonl'"):
    make_tasks(c, TOK)


CALL = (
  "<|tool_calls_section_begin|><|tool_call_begin|>functions.list_files:0<|tool_call_argument_begin|>{}"
  "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
)


def test_rollout_manager_runs_episodes_next_to_single_turn_groups(tmp_path):
  """Mixed batch: a math group and an agentic group. The episode's tool result sits inside the response with
  loss mask 0; the env's reward reaches the batch through the contract's env kind."""
  path = os.path.join(rl_configs.TASK_DATA, "sim_tools.jsonl")
  agentic = AgenticTask("sim", path, "sim_tools", TOK)
  math = JsonlTask("math", _write(tmp_path, "m.jsonl", [{"question": "1+1?", "answer": 2}]), TOK, "math")
  mix = TaskSet([(math, 1), (agentic, 1)])

  def script(req):
    if "-t0" in req.rid:
      return TOK.encode_with_specials(CALL)
    if "-t1" in req.rid:
      return TOK.encode_with_specials("notes.txt is there.<|im_end|>")
    return TOK.encode_with_specials("\\boxed{2}<|im_end|>")

  engine = ScriptEngine(script)
  stop = (TOK.eos_id, TOK.special_ids["<|im_end|>"])
  cfg = RolloutConfig(
    group_size=2, target_groups=2, launch_groups=2, task_budgets=(("math", 16), ("sim", 64)), stop_token_ids=stop
  )
  episodes = EpisodeRunner(TOK, {"sim_tools": SimToolsEnv}, MultiTurnConfig(max_turns=3, max_total_tokens=512))
  manager = RolloutManager(cfg, engine, mix.prompts(0), mix.reward_fn(), decode=TOK.decode, episodes=episodes)
  try:
    batch, _ = manager.collect(1)
  finally:
    manager.close()
  assert sorted(batch.tasks) == ["math", "math", "sim", "sim"]  # groups in the order they completed
  assert batch.rewards_B.tolist() == [1.0, 1.0, 1.0, 1.0]  # boxed 2; "notes.txt" in the final answer
  for b in [i for i, t in enumerate(batch.tasks) if t == "sim"]:
    P, R = int(batch.prompt_lengths_B[b]), int(batch.response_lengths_B[b])
    tokens, mask = batch.tokens_BT[b, P : P + R].tolist(), batch.loss_mask_BT[b, P : P + R]
    n_call = len(TOK.encode_with_specials(CALL))
    assert mask[:n_call].all() and TOK.decode(tokens[:n_call]) == CALL  # the generated call: trained
    # The rendered tool result (and the next assistant header) is not trained; the final answer is.
    result_ids, _ = render_chat(
      [{"role": "tool", "tool_call_id": "functions.list_files:0", "name": "list_files", "content": '["notes.txt"]'}],
      tokenizer=TOK,
      add_generation_prompt=True,
    )
    assert tokens[n_call : n_call + len(result_ids)] == result_ids and not mask[n_call : n_call + len(result_ids)].any()
    assert mask[n_call + len(result_ids) :].all()
    assert (batch.engine_logprobs_BT[b, P : P + R][mask == 0] == 0).all()
