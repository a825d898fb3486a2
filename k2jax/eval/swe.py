"""SWE-bench tasks in the benchmark runner (format "swe"): each sample is one agentic episode, graded by the
repository's tests; the score is 1.0 iff the final patch resolves the instance (SWE-bench's Pass@1 is the
resolved rate, pass@k and mean@n follow from the runner's metrics).

Docs are the records of the task file RL's agentic tasks read (`rl_tasks.jsonl`, written by
`launch/swe_build.py`; `configs/rl.py:swe_tiny`): `{"id"?, "instruction", "instance_id", "task_set",
"max_turns"?, "demo"?}`. A record is checked when the task is read, as the environment would check it at
reset (`k2jax.agentic.envs.swe.SweEnv`: the same task-set resolution and instance reader): the task set's
instances.jsonl must hold the instance and its snapshot must exist; else a `TaskFormatError` names file and
line.

A sample runs the one tool loop (`k2jax.agentic.loop.run_tool_loop`) with RL's token-in/token-out agent
(`k2jax.agentic.rollout.TokenAgent`, the K2 chat template) against the runner's engine, and the SWE
environment in-process (the `SweEnv` an RL env service runs per episode, its workspaces from the process's
shared pool). The verdict is `k2jax.swe.grade` of the workspace's diff against the pristine snapshot: the
environment's own grading when the episode ended there (the agent called finish, stopped calling tools, or
used its turns), else (the token budget ran out first) the same grading of the workspace as it was left,
as SWE-bench grades whatever patch the agent leaves. The sample records the patch, the episode's end, the
verdict and its reason.

A grading infrastructure failure (sandbox unavailable, pytest absent, a snapshot that no longer hashes to
its base commit) is not a 0: RL masks such a sample from the loss; here it is not stored, the task's other
samples are, and the run fails with `InfraFailure` listing them, so the score never has holes in it and a
rerun (which resumes) grades only those again. An engine that fails or aborts mid-episode fails the run as
for any other task (`EngineFailed`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

# The environment's own task-set resolution and (cached) instance reader, so a record checked here is one its
# reset accepts: not a second copy of either.
from k2jax.agentic.envs.swe import SweEnv, SweEnvConfig, resolve_task
from k2jax.agentic.loop import run_tool_loop
from k2jax.agentic.rollout import TokenAgent
from k2jax.eval.records import Doc
from k2jax.eval.verdict import Verdict
from k2jax.swe import snapshot

ENGINE_ENDS = ("engine_error", "abort")  # the engine failed: the run fails (EngineFailed), as for other tasks


class InfraFailure(RuntimeError):
  """Samples whose grading infrastructure failed (not scored; the others are stored, a rerun retries these)."""

  def __init__(self, task: str, records: Sequence[Mapping[str, Any]]):
    self.task, self.records = task, list(records)
    shown = "; ".join(f"doc {r['doc_id']} sample {r['sample']}: {r['reason']}" for r in self.records[:5])
    more = f" (+{len(self.records) - 5} more)" if len(self.records) > 5 else ""
    super().__init__(
      f"task {task}: {len(self.records)} samples hit SWE grading infrastructure failures, not scored "
      f"(the rest are stored; rerun to grade these): {shown}{more}"
    )


class EngineStopped(RuntimeError):
  """The engine failed or aborted during an episode (the runner raises EngineFailed naming the engine)."""


def parse_record(r: Mapping[str, Any], i: int) -> Doc:
  """A `swe` doc from one task-file record; KeyError / TypeError / ValueError name the field."""
  if not isinstance(r["instruction"], str) or not r["instruction"]:
    raise TypeError(f"field 'instruction' must be a non-empty string, got {r['instruction']!r:.80}")
  if "max_turns" in r and (
    isinstance(r["max_turns"], bool) or not isinstance(r["max_turns"], int) or r["max_turns"] < 1
  ):
    raise ValueError(f"field 'max_turns' must be an integer >= 1, got {r['max_turns']!r}")
  for key in ("instance_id", "task_set"):
    if key not in r:
      raise KeyError(key)  # the reader names it: "missing field"
  root, instance = resolve_task(r)
  if not os.path.isdir(instance.snapshot_dir(root)):
    raise ValueError(f"field 'instance_id': the snapshot {instance.snapshot_dir(root)} is missing")
  doc_id = (
    str(r["id"]) if isinstance(r.get("id"), (str, int)) and not isinstance(r.get("id"), bool) else r["instance_id"]
  )
  episode = {k: v for k, v in r.items() if k != "demo"}  # demo: RL's warm start only
  episode["id"] = doc_id
  return Doc(doc_id, r["instruction"], "", episode)


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
  """What one episode runs with (from EvalConfig and the model)."""

  max_turns: int  # assistant turns, unless the record gives its own max_turns (as in RL)
  max_new_tokens_per_turn: int
  max_total_tokens: int  # prompt + every turn
  temperature: float
  top_p: float
  env: SweEnvConfig


def sample(engine, tokenizer, doc: Doc, i: int, rid: str, seed: int, settings: EpisodeSettings) -> dict:
  """Runs sample `i` of `doc` and returns its record (without the runner's task / fingerprint keys).

  `infra_failure: True` in the record: the grading could not happen (the runner does not store it)."""
  max_turns = int(doc.data.get("max_turns", settings.max_turns))
  env = SweEnv(config=dataclasses.replace(settings.env, max_turns=max_turns))
  agent = TokenAgent(
    engine,
    tokenizer,
    rid,
    doc.data,
    max_new_tokens_per_turn=settings.max_new_tokens_per_turn,
    max_total_tokens=settings.max_total_tokens,
    response_budget=None,
    temperature=settings.temperature,
    top_p=settings.top_p,
    seed=seed,
  )
  try:
    result = run_tool_loop(agent, env, doc.data, max_turns)
    traj = agent.trajectory
    if result.end in ENGINE_ENDS:
      raise EngineStopped(f"{result.end} at turn {result.turns}: {result.info.get('error', '')}".strip(": "))
    if result.end == "budget" and result.turns == 0:
      raise ValueError(
        f"doc {doc.doc_id}: the episode's first prompt ({traj.prompt_length} tokens) leaves no room in the "
        f"{settings.max_total_tokens}-token episode budget"
      )
    details = dict(result.info)
    if result.end in ("max_turns", "budget"):  # the loop stopped before the environment graded: grade now
      _, details = env.score(env.task, env.state, {})
    patch = None
    if env.ws is not None:  # what the agent left (the patch the grader applied)
      patch = snapshot.diff_trees(env.state["instance"].snapshot_dir(env.state["root"]), env.ws.path)
  finally:
    env.close()
  infra = result.end == "env_error" or "env_error" in details
  verdict = episode_verdict(details, infra)
  generated = [t.output_ids for t in traj.turns]
  return {
    "seed": seed,
    "instance_id": doc.data["instance_id"],
    "end": result.end,
    "turns": result.turns,
    "prompt_tokens": traj.prompt_length,
    "completion_tokens": sum(len(g) for g in generated),
    "finish_reason": traj.turns[-1].finish_reason if traj.turns else "",
    "turn_texts": [tokenizer.decode(list(g)) for g in generated],  # each assistant turn as generated
    "patch": patch,
    "score": verdict.score,
    "answer": verdict.answer,
    "reason": verdict.reason,
    "verdict": "infra_failure" if infra else ("resolved" if details.get("resolved") else "unresolved"),
    "resolved": bool(details.get("resolved")) and not infra,
    "pass_rate": float(details.get("pass_rate", 0.0)),
    "infra_failure": infra,
  }


def episode_verdict(details: Mapping[str, Any], infra: bool) -> Verdict:
  """1.0 iff resolved; the grader's reason (an infrastructure failure: its error, scored by no one)."""
  if infra:
    return Verdict(0.0, None, str(details.get("env_error") or details.get("error") or "grading infrastructure failure"))
  return Verdict(float(bool(details.get("resolved"))), None, str(details.get("grade_reason", "")))
