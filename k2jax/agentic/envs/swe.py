"""The software-engineering environment: fix an issue in a repository, graded by its hidden verdict tests.

Per episode a fresh copy of the instance's snapshot (no .git) from a bounded pool of prepared workspaces
(`k2jax.swe.workspace`). Tools, in K2's tool-call format through the one multi-turn loop:
  bash(command)              runs in the sandbox (k2jax.sandbox.workspace): the workspace read-write at
                             /testbed, no network, rlimits, a per-call deadline, output head + tail; every
                             process it starts dies when the call ends
  str_replace_editor(...)    view / create / str_replace / insert / undo_edit, host-side, confined to the
                             workspace (paths are resolved and must stay inside it; symlinks out are refused)
  finish(message?)           ends the episode
Budgets: `max_turns` assistant turns, `episode_timeout_s` wall clock from reset (setup included: a wedged
setup cannot run past it), observations capped to `max_observation_chars`; the rollout's K2 token budget
caps the whole response. The reward is `k2jax.swe.grade` of the workspace's diff in a *fresh* sandbox:
resolved (0/1), with K2's pass rate in the info. A grading infrastructure failure puts `env_error` in the
info, which the rollout masks from the loss instead of scoring 0.

Task record: {"id", "instruction" (the problem statement), "instance_id", "task_set" (the dir holding
instances.jsonl; a relative path is taken from the working directory, else from the k2jax checkout),
"max_turns"?}.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from typing import Any, Mapping

from k2jax.agentic.envs.base import StepResult, ToolEnvironment
from k2jax.agentic.guards import Guard, GuardConfig, ToolFailure
from k2jax.agentic.tools import Impact, ToolRegistry, ToolSpec
from k2jax.sandbox.workspace import WORKSPACE_MOUNT, WorkspaceRunConfig, default_python_paths, run_command, sandbox_uid
from k2jax.swe import snapshot
from k2jax.swe.grade import GradeConfig, grade
from k2jax.swe.instances import Instance, read_instances
from k2jax.swe.workspace import PoolConfig, Workspace, WorkspacePool

_STR = {"type": "string", "maxLength": 100000}
TOOLS = (
  ToolSpec(
    "bash",
    "Run a bash command in the repository (/testbed); no network.",
    {"type": "object", "properties": {"command": {"type": "string", "minLength": 1, "maxLength": 20000}}, "required": ["command"], "additionalProperties": False},
    Impact.REVERSIBLE_WRITE,
  ),
  ToolSpec(
    "str_replace_editor",
    "View, create or edit a file: view, create, str_replace, insert, undo_edit.",
    {
      "type": "object",
      "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
        "path": {"type": "string", "minLength": 1, "maxLength": 1000},
        "file_text": _STR,
        "old_str": _STR,
        "new_str": _STR,
        "insert_line": {"type": "integer", "minimum": 0},
        "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
      },
      "required": ["command", "path"],
      "additionalProperties": False,
    },
    Impact.REVERSIBLE_WRITE,
  ),
  ToolSpec(
    "finish",
    "Submit the repository as it is now.",
    {"type": "object", "properties": {"message": {"type": "string", "maxLength": 2000}}, "additionalProperties": False},
    Impact.REVERSIBLE_WRITE,
  ),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SweEnvConfig:
  max_turns: int = 30
  episode_timeout_s: float = 1800.0  # DeepSWE: 5,400 s; counted from reset
  bash: WorkspaceRunConfig = WorkspaceRunConfig(timeout_s=90.0, head_bytes=4000, tail_bytes=4000)  # rLLM: 90 s/step
  grade: GradeConfig = GradeConfig()
  max_observation_chars: int = 10000
  reward: str = "resolved"  # resolved (SWE-bench, binary) | pass_rate (K2 §3.2.1)
  pool: PoolConfig = PoolConfig()


class SweEnv(ToolEnvironment):
  def __init__(
    self, guard: Guard | None = None, config: SweEnvConfig = SweEnvConfig(), pool: WorkspacePool | None = None
  ):
    if config.reward not in ("resolved", "pass_rate"):
      raise ValueError(f"SweEnvConfig.reward: {config.reward!r} is not resolved or pass_rate")
    self.config = config
    self.pool = pool or shared_pool(config.pool)
    self.ws: Workspace | None = None
    paths = config.bash.python_paths or default_python_paths()
    self._bash = dataclasses.replace(config.bash, python_paths=paths)
    self._grade = dataclasses.replace(config.grade, run=dataclasses.replace(config.grade.run, python_paths=paths))
    impls = {"bash": self._run_bash, "str_replace_editor": self._edit, "finish": self._finish}
    super().__init__(ToolRegistry(TOOLS), impls, guard or Guard(GuardConfig()), config.max_turns)

  def reset(self, task: Mapping[str, Any]) -> dict:
    try:
      root, instance = resolve_task(task)
    except ValueError as e:
      raise ValueError(f"SweEnv: task {task.get('id')!r}: {e}") from None
    self.close()
    t0 = time.monotonic()
    self.ws = self.pool.acquire(instance.snapshot_dir(root))
    try:
      obs = super().reset(task)
      self.state.update(instance=instance, root=root, deadline=t0 + self.config.episode_timeout_s, history={})
      self.state["ready_s"] = self.ws.ready_s
    except BaseException:  # a reset that fails gives its workspace back: no caller has to close it
      self.close()
      raise
    return obs

  def step(self, action: Mapping[str, Any]) -> StepResult:
    if self.ws is None:
      raise ValueError("SweEnv: step before reset")
    try:
      result = super().step(action)
      late = time.monotonic() > self.state["deadline"]
      if not result.done and (self.state.get("finished") or late):
        reward, details = self.score(self.task, self.state, action)
        return StepResult(result.observation, reward, True, {**result.info, **details, "out_of_time": late})
    except BaseException:  # the episode is over (its caller records the error): its workspace goes now
      self.close()
      raise
    return result

  def score(self, task, state, final) -> tuple[float, dict]:
    inst: Instance = state["instance"]
    pristine = inst.snapshot_dir(state["root"])
    diff = snapshot.diff_trees(pristine, self.ws.path)
    rep = grade(inst, diff, state["root"], self._grade)
    details = {"resolved": rep.resolved, "pass_rate": rep.pass_rate, "grade_reason": rep.reason[:300]}
    details.update(ready_s=state["ready_s"], grade_s=rep.grade_s, finished=bool(state.get("finished")))
    if rep.infra_failure:
      details["env_error"] = f"grading infrastructure failure: {rep.reason}"[:500]
    reward = float(rep.resolved) if self.config.reward == "resolved" else rep.pass_rate
    return reward, details

  def close(self) -> None:
    ws, self.ws = self.ws, None
    if ws is not None:
      self.pool.release(ws)

  # ---- tools ---------------------------------------------------------------------------------------
  def _run_bash(self, args, net, state) -> str:
    left = state["deadline"] - time.monotonic()
    if left <= 1:
      raise ToolFailure("timeout", "out_of_time: the episode's time budget is spent")
    cfg = dataclasses.replace(self._bash, timeout_s=min(self._bash.timeout_s, left))
    r = run_command(["bash", "-c", args["command"]], self.ws.path, cfg)
    return self._cap(f"exit code: {r.returncode}\n{r.output}")

  def _finish(self, args, net, state) -> str:
    state["finished"] = True
    return "submitted"

  def _edit(self, args, net, state) -> str:
    cmd, rel, path = args["command"], *self._resolve(args["path"])
    history = state["history"]
    if cmd == "view":
      return self._cap(_view(path, rel, args.get("view_range")))
    if cmd == "undo_edit":
      if not history.get(rel):
        raise ToolFailure("tool_failed", f"no edit of {rel} to undo")
      _write(path, history[rel].pop())
      return f"undid the last edit of {rel}"
    old = _read(path) if os.path.lexists(path) else None
    if cmd == "create":
      if "file_text" not in args:
        raise ToolFailure("bad_arguments", "create needs file_text")
      new = args["file_text"]
    elif old is None:
      raise ToolFailure("tool_failed", f"{rel} does not exist")
    elif cmd == "str_replace":
      if "old_str" not in args or not args["old_str"]:
        raise ToolFailure("bad_arguments", "str_replace needs a non-empty old_str")
      n = old.count(args["old_str"])
      if n != 1:
        raise ToolFailure("tool_failed", f"old_str occurs {n} times in {rel}; it must occur exactly once")
      new = old.replace(args["old_str"], args.get("new_str", ""), 1)
    else:  # insert
      lines = old.splitlines(keepends=True)
      at = args.get("insert_line")
      if at is None or at > len(lines) or "new_str" not in args:
        raise ToolFailure("bad_arguments", f"insert needs new_str and insert_line in 0..{len(lines)}")
      text = args["new_str"] if args["new_str"].endswith("\n") else args["new_str"] + "\n"
      new = "".join(lines[:at] + [text] + lines[at:])
    history.setdefault(rel, []).append(old)
    _write(path, new)
    return f"{'created' if old is None else 'edited'} {rel}"

  def _resolve(self, given: str) -> tuple[str, str]:
    """(path relative to the workspace, host path) for a path the agent gave; never outside the workspace."""
    inside = given == WORKSPACE_MOUNT or given.startswith(WORKSPACE_MOUNT + "/")
    p = given[len(WORKSPACE_MOUNT) :].lstrip("/") if inside else given
    root = os.path.realpath(self.ws.path)
    host = os.path.realpath(os.path.join(root, p))
    if os.path.isabs(p) or (host != root and not host.startswith(root + os.sep)):
      raise ToolFailure("denied", f"outside_workspace: {given!r} is outside {WORKSPACE_MOUNT}")
    return os.path.relpath(host, root), host

  def _cap(self, text: str) -> str:
    n = self.config.max_observation_chars
    return text if len(text) <= n else text[: n // 2] + f"\n[... {len(text) - n} chars omitted ...]\n" + text[-n // 2 :]


_POOLS: dict[PoolConfig, WorkspacePool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(config: PoolConfig = PoolConfig()) -> WorkspacePool:
  """One workspace pool per process and config (closed at exit: its directory goes with it)."""
  import atexit

  with _POOLS_LOCK:
    if config not in _POOLS:
      _POOLS[config] = WorkspacePool(config)
      atexit.register(_POOLS[config].close)
    return _POOLS[config]


def resolve_task(task: Mapping[str, Any]) -> tuple[str, Instance]:
  """A task record's task-set dir and instance (what `SweEnv.reset` runs and `k2jax.eval.swe` checks
  up front); ValueError naming the field when either cannot be found."""
  for key in ("instance_id", "task_set"):
    if not isinstance(task.get(key), str) or not task[key]:
      raise ValueError(f"field '{key}' must be a non-empty string, got {task.get(key)!r:.80}")
  root = _task_set_dir(task["task_set"])
  path = os.path.join(root, "instances.jsonl")
  if not os.path.isfile(path):
    raise ValueError(f"field 'task_set': {root} has no instances.jsonl")
  instance = _instances(path).get(task["instance_id"])
  if instance is None:
    raise ValueError(f"field 'instance_id': no instance {task['instance_id']!r} in {path}")
  return root, instance


def _task_set_dir(given: str) -> str:
  """An absolute task set dir; a relative one from the working dir, else from the k2jax checkout (data/...)."""
  if os.path.isabs(given) or os.path.isdir(given):
    return os.path.abspath(given)
  checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  return os.path.join(checkout, given)


@functools.lru_cache(maxsize=64)
def _instances(path: str) -> dict[str, Instance]:
  return {i.instance_id: i for i in read_instances(path)}


def _read(path: str) -> str:
  if os.path.isdir(path):
    raise ToolFailure("tool_failed", "a directory cannot be edited")
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def _write(path: str, text: str | None) -> None:
  if text is None:
    os.unlink(path)
    return
  made, d = [], os.path.dirname(path)
  while not os.path.isdir(d):
    made.append(d)
    d = os.path.dirname(d)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  uid = sandbox_uid()
  if uid is not None:  # written as root here; bash runs as the sandbox uid and must be able to edit it
    for p in [path, *made]:
      os.chown(p, uid, uid)


def _view(path: str, rel: str, view_range) -> str:
  if not os.path.lexists(path):
    raise ToolFailure("tool_failed", f"{rel} does not exist")
  if os.path.isdir(path):
    entries = [x for x in snapshot.walk_files(path) if x.count(os.sep) < 2 and not x.startswith(".")]
    return f"files in {rel} (2 levels):\n" + "\n".join(entries[:500])
  lines = _read(path).splitlines()
  start, end = (view_range or [1, len(lines)])[:2]
  end = len(lines) if end == -1 else min(end, len(lines))
  return "\n".join(f"{i:6}\t{lines[i - 1]}" for i in range(max(start, 1), end + 1))
