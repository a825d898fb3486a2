"""Rollout manager: K samples per prompt, over-sampling with early stop, partial rollout, budgets, temperature.

Each iteration `collect(weight_version)`:
1. resumes groups left over from earlier iterations (oldest first; samples whose oldest token is more than
   `max_staleness` versions behind are restarted from the prompt), then draws new prompts until
   `launch_groups` (N) groups are in flight;
2. runs every unfinished sample as one blocking engine call on a worker thread (one thread per in-flight
   request; the engine clients are blocking and thread-safe). A sample resumes from
   `prompt + output_ids` with `max_new_tokens` = what is left of its task's total token budget;
3. scores each group on a reward thread as soon as all its K samples finish;
4. once `target_groups` (M) groups are complete, aborts all other requests (re-sending the abort until every
   call has returned, so a request that started after the first abort is caught too). With
   `partial_rollout` the aborted samples keep their tokens, logprobs and per-token weight versions and resume
   next iteration (K1.5 partial rollouts, reference §1.5); without it they are dropped.
Groups completed beyond M wait in the buffer for the next batch. Samples stopped by the budget are truncated
and their reward lowered by `truncation_penalty` (K2 §3.2.3).

Prompts of agentic tasks (`data["episode"]`, `data["env"]`) run as multi-turn episodes instead of one
generation: `episodes` (an `agentic.rollout.EpisodeRunner`) runs the agentic tool loop against the
environment with the task's budget over the whole response (generated turns and environment answers).
The response keeps the episode's loss mask (tool results and user turns 0); trailing environment tokens
that no generated token follows are cut (nothing in them is trained). An aborted episode restarts from
the prompt next iteration: an environment's state cannot be carried over like a token prefix. A failed
episode (environment or engine error) keeps no tokens, so the batch check drops it (`span`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Sequence

from k2jax.engine.base import Engine, GenerateRequest, GenerateResult, SamplingParams
from k2jax.rl.rollout_batch import RolloutBatch
from k2jax.grading.base import GroupRewardFn, Prompt, RewardResult
from k2jax.grading.math import GradingBudget
from k2jax.rl.samples import Group, Sample, build_batch, completion_of


@dataclasses.dataclass(frozen=True)
class TemperatureSchedule:
  """T(i) = final + (initial - final) * 0.5 ** (i / half_life): explore early, exploit later (K2 §3.2.3)."""

  initial: float = 1.0
  final: float = 1.0
  half_life_iterations: float = 100.0

  def __call__(self, iteration: int) -> float:
    return self.final + (self.initial - self.final) * 0.5 ** (iteration / self.half_life_iterations)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  group_size: int = 4  # K responses per prompt
  target_groups: int = 8  # M complete groups per batch
  launch_groups: int = 16  # N >= M groups in flight (over-sampling)
  partial_rollout: bool = True  # keep aborted samples and resume them next iteration
  max_staleness: int = 2  # resumed tokens may be at most this many versions old
  task_budgets: tuple[tuple[str, int], ...] = (("default", 1024),)  # total response tokens per task
  truncation_penalty: float = 0.0
  temperature: TemperatureSchedule = TemperatureSchedule()
  top_p: float = 1.0
  stop_token_ids: tuple[int, ...] = ()
  pad_id: int = 0
  max_concurrency: int = 256  # worker threads = in-flight engine requests
  reward_workers: int = 4
  abort_poll_s: float = 0.02
  # Share of a batch's samples whose grader failed (NaN reward, `info["infra_error"]`) past which `collect`
  # raises with the causes: a grader failing on every sample would leave every update with nothing to learn.
  max_infra_error_frac: float = 0.5

  def __post_init__(self):
    if not 0 < self.target_groups <= self.launch_groups:
      raise ValueError(
        f"RolloutConfig needs 0 < target_groups <= launch_groups, got {self.target_groups} and {self.launch_groups}"
      )
    if not 0 <= self.max_infra_error_frac <= 1:
      raise ValueError(f"RolloutConfig.max_infra_error_frac must be in [0, 1], got {self.max_infra_error_frac}")
    if self.group_size < 1 or self.max_staleness < 0:
      raise ValueError(f"RolloutConfig: bad group_size={self.group_size} or max_staleness={self.max_staleness}")

  def budget(self, task: str) -> int:
    for name, budget in self.task_budgets:
      if name == task:
        return budget
    raise KeyError(
      f"RolloutConfig.task_budgets has no budget for task {task!r} (known: {[n for n, _ in self.task_budgets]})"
    )


class RolloutManager:
  """Produces one `RolloutBatch` of `target_groups` complete groups per `collect` call."""

  def __init__(
    self,
    config: RolloutConfig,
    engine: Engine,
    prompts: Iterator[Prompt],
    reward_fn: GroupRewardFn,
    decode: Callable[[Sequence[int]], str] | None = None,
    episodes: Callable[..., Any] | None = None,
    *,
    start_iteration: int = 0,
    start_uid: int = 0,
    grading_budget: GradingBudget | None = None,
  ):
    """`start_iteration` / `start_uid` continue a resumed run's temperature schedule and sampling seeds
    (a group's uid is the index of its prompt in the stream); `grading_budget`, the one `reward_fn` grades
    math under, is opened anew by each `collect`."""
    self.config = config
    self.engine = engine
    self._episodes = episodes
    self._tracked = _TrackedEngine(self)
    self._prompts = iter(prompts)
    self._reward_fn = reward_fn
    self._decode = decode
    self._buffer: list[Group] = []  # groups carried over, oldest first
    self._uids = itertools.count(start_uid)
    self._lock = threading.Lock()
    self._active: set[str] = set()  # rids currently inside engine.generate
    self._stopping = threading.Event()
    self._rewards = ThreadPoolExecutor(config.reward_workers, thread_name_prefix="reward")
    self._grading_budget = grading_budget
    self.iteration = start_iteration

  def close(self) -> None:
    self._rewards.shutdown(wait=True)

  @property
  def buffered_groups(self) -> list[Group]:
    return list(self._buffer)

  def collect(self, weight_version: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Runs one rollout phase with the engine holding `weight_version`; returns the batch and metrics."""
    t0 = time.monotonic()
    temperature = self.config.temperature(self.iteration)
    stats = {"stale_tokens_dropped": 0, "stale_samples_restarted": 0}
    if self._grading_budget is not None:
      self._grading_budget.start()
    groups = self._gather_groups(weight_version, stats)
    done = [g for g in groups if g.complete]
    for g in done:
      self._score(g)
    self._stopping.clear()
    pending_ids = {id(g) for g in groups if not g.complete}
    with ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="rollout") as pool:
      futures = {
        pool.submit(self._advance, s, g.uid, temperature, weight_version): g
        for g in groups
        if not g.complete
        for s in g.samples
        if not s.done
      }
      try:
        self._run_until_enough(futures, done, pending_ids)
      except BaseException:
        self._stopping.set()  # let the other workers return instead of generating on
        with self._lock:
          self.engine.abort(sorted(self._active))
        raise
    # The first M groups to complete make the batch, in launch order (uid): which groups finish first in a
    # step, and the order their threads report it, depend on scheduling, and the batch must not (a
    # multi-process run, a resumed run and a 1-process run train on the same rows in the same order).
    batch_groups, extra = done[: self.config.target_groups], done[self.config.target_groups :]
    batch_groups.sort(key=lambda g: g.uid)
    unfinished = [g for g in groups if not g.complete]
    stats.update(self._carry_over(extra, unfinished))
    rewards = [g.rewards.result() for g in batch_groups]
    batch = build_batch(
      batch_groups,
      rewards,
      pad_id=self.config.pad_id,
      iteration=self.iteration,
      truncation_penalty=self.config.truncation_penalty,
      temperature=temperature,
    )
    stats.update(_episode_scores(batch_groups))
    stats.update(_no_verdicts(batch_groups, rewards))
    _stop_past_infra_errors(batch_groups, rewards, self.config.max_infra_error_frac)
    stats.update(
      rollout_wall_s=time.monotonic() - t0,
      temperature=temperature,
      iteration=self.iteration,
      groups_launched=len(groups),
      groups_complete=len(done),
      batch_groups=len(batch_groups),
    )
    stats.update({f"engine_{k}": v for k, v in self.engine.metrics().items()})  # cumulative counters
    self.iteration += 1
    return batch, stats

  def _gather_groups(self, weight_version: int, stats: dict) -> list[Group]:
    groups, self._buffer = self._buffer, []
    oldest_ok = weight_version - self.config.max_staleness
    for g in groups:
      for s in g.samples:
        sampled = [v for v in s.versions if v >= 0]  # environment tokens carry no version
        if sampled and min(sampled) < oldest_ok:
          stats["stale_tokens_dropped"] += s.reset()
          stats["stale_samples_restarted"] += 1
          if g.rewards is not None:
            g.rewards.cancel()
            g.rewards = None
    while len(groups) < self.config.launch_groups:
      prompt = next(self._prompts, None)
      if prompt is None:
        break
      uid = next(self._uids)
      samples = [Sample(prompt, k, seed=uid * self.config.group_size + k) for k in range(self.config.group_size)]
      groups.append(Group(uid, prompt, samples, self.iteration))
    if not groups:
      raise StopIteration("RolloutManager: the prompt iterator is exhausted and nothing is buffered")
    return groups

  def _run_until_enough(self, futures: dict[Future, Group], done: list[Group], pending_ids: set[int]) -> None:
    order = {f: i for i, f in enumerate(futures)}  # calls that return together are taken in launch order
    remaining = set(futures)
    while remaining and len(done) < self.config.target_groups:
      finished, remaining = wait(remaining, return_when=FIRST_COMPLETED)
      for f in sorted(finished, key=order.__getitem__):
        f.result()  # re-raise engine errors
        g = futures[f]
        if id(g) in pending_ids and g.complete:
          pending_ids.discard(id(g))
          self._score(g)
          done.append(g)
    self._stopping.set()
    while remaining:  # abort until every call has returned; a call may start after an earlier abort
      with self._lock:
        rids = sorted(self._active)
      if rids:
        self.engine.abort(rids)
      finished, remaining = wait(remaining, timeout=self.config.abort_poll_s)
      for f in sorted(finished, key=order.__getitem__):
        f.result()
        g = futures[f]
        if id(g) in pending_ids and g.complete:  # finished naturally while we were aborting
          pending_ids.discard(id(g))
          self._score(g)
          done.append(g)

  def _advance(self, s: Sample, uid: int, temperature: float, version: int) -> None:
    """Generates `s` until it stops, exhausts its budget, or the manager is stopping."""
    budget = self.config.budget(s.prompt.task)
    if "episode" in s.prompt.data:
      return self._run_episode(s, uid, temperature, version, budget)
    while not s.done:
      left = budget - len(s.output_ids)
      if left <= 0:  # resumed with nothing left (slime: budget 0 -> truncated)
        s.finish, s.truncated = "length", True
        return
      if self._stopping.is_set():
        return
      rid = f"{s.prompt.prompt_id}/g{uid}/s{s.index}/v{version}/{s.segments}"
      request = GenerateRequest(
        rid,
        s.prompt.input_ids + tuple(s.output_ids),
        SamplingParams(
          max_new_tokens=left,
          temperature=temperature,
          top_p=self.config.top_p,
          stop_token_ids=self.config.stop_token_ids,
          seed=s.seed,
        ),
      )
      with self._lock:
        self._active.add(rid)
      try:
        res = self.engine.generate(request)
      finally:
        with self._lock:
          self._active.discard(rid)
      s.output_ids += res.output_ids
      s.logprobs += res.output_logprobs
      s.versions += res.weight_versions
      s.text_parts.append(res.text or "")
      s.segments += 1
      if res.finish_reason != "abort":
        s.finish = res.finish_reason
        s.truncated = res.finish_reason == "length"

  def _run_episode(self, s: Sample, uid: int, temperature: float, version: int, budget: int) -> None:
    if self._episodes is None:
      raise ValueError(f"prompt {s.prompt.prompt_id} is an agentic episode but the rollout has no episode runner")
    if self._stopping.is_set():
      return
    rid = f"{s.prompt.prompt_id}/g{uid}/s{s.index}/v{version}"
    traj = self._episodes(
      s.prompt.data["episode"],
      s.prompt.data["env"],
      rid,
      self._tracked,
      temperature=temperature,
      seed=s.seed,
      budget=budget,
    )
    if traj.end == "abort":
      s.reset()
      return
    P = traj.prompt_length
    out, mask = traj.tokens[P:], traj.loss_mask[P:]
    while mask and not mask[-1]:
      out, mask = out[:-1], mask[:-1]
    keep = 0 if traj.failed else len(out)
    s.episode_prompt = tuple(traj.tokens[:P])
    s.output_ids, s.mask = list(out[:keep]), list(mask[:keep])
    s.logprobs, s.versions = list(traj.logprobs[P : P + keep]), list(traj.versions[P : P + keep])
    s.segments = len(traj.turns)
    s.finish, s.truncated = ("length" if traj.truncated else "stop"), traj.truncated
    s.info = {"env_reward": float(traj.reward), "end": traj.end, "turns": len(traj.turns)}
    s.info.update({k: float(traj.info[k]) for k in EPISODE_SCORES if k in traj.info})
    if traj.failed:
      s.info["error"] = str(traj.info.get("error", ""))[:300]

  def _score(self, g: Group) -> None:
    if g.rewards is None:
      completions = [completion_of(s, self._decode) for s in g.samples]
      g.rewards = self._rewards.submit(_checked_rewards, self._reward_fn, g.prompt, completions)

  def _carry_over(self, extra: list[Group], unfinished: list[Group]) -> dict[str, int]:
    kept = sum(len(s.output_ids) for g in unfinished for s in g.samples)
    aborted = sum(1 for g in unfinished for s in g.samples if not s.done and s.output_ids)
    if self.config.partial_rollout:
      self._buffer = extra + unfinished
      return {"partial_tokens_kept": kept, "samples_aborted": aborted, "tokens_discarded": 0}
    self._buffer = extra
    return {"partial_tokens_kept": 0, "samples_aborted": aborted, "tokens_discarded": kept}


class _TrackedEngine:
  """The manager's engine as episodes see it: each request id is registered for aborts, and no request
  starts once the manager is stopping (it returns an empty `abort` result instead)."""

  def __init__(self, manager: "RolloutManager"):
    self._m = manager

  def generate(self, request: GenerateRequest) -> GenerateResult:
    m = self._m
    with m._lock:
      if m._stopping.is_set():
        return GenerateResult(request.rid, (), (), (), "abort", prompt_tokens=len(request.input_ids))
      m._active.add(request.rid)
    try:
      return m.engine.generate(request)
    finally:
      with m._lock:
        m._active.discard(request.rid)

  def abort(self, rids: Sequence[str]) -> None:
    self._m.engine.abort(rids)


# Scores an environment reports beside its reward (SWE: binary resolved, and K2's test pass rate), averaged
# per task into the rollout stats (`rollout_pass_rate/<task>` in metrics.jsonl).
EPISODE_SCORES = ("resolved", "pass_rate")


def _episode_scores(groups: Sequence[Group]) -> dict[str, float]:
  seen: dict[str, list[float]] = {}
  for g in groups:
    for s in g.samples:
      for key in EPISODE_SCORES:
        if key in s.info:
          seen.setdefault(f"{key}/{g.prompt.task}", []).append(s.info[key])
  return {k: sum(v) / len(v) for k, v in seen.items()}


def _no_verdicts(groups: Sequence[Group], rewards: Sequence[Sequence[RewardResult]]) -> dict[str, int]:
  """Samples of the batch without a verdict, masked by the batch check: the grader failed (NaN reward with
  `info["infra_error"]`) or the episode's environment did (`env_error`: it keeps no tokens); and grades that
  ran out of time (`info["timed_out"]`: scored 0, a verdict), in all and per task."""
  out = {
    "reward_infra_errors": sum(bool(r.info.get("infra_error")) for rs in rewards for r in rs),
    "episode_env_errors": sum(s.info.get("end") == "env_error" for g in groups for s in g.samples),
    "reward_timeouts": sum(bool(r.info.get("timed_out")) for rs in rewards for r in rs),
  }
  for g, rs in zip(groups, rewards):
    key = f"reward_timeouts/{g.prompt.task}"
    out[key] = out.get(key, 0) + sum(bool(r.info.get("timed_out")) for r in rs)
  return out


def _stop_past_infra_errors(groups: Sequence[Group], rewards: Sequence[Sequence[RewardResult]], frac: float) -> None:
  """RuntimeError naming the causes when more than `frac` of the batch's samples have no verdict."""
  failed = [
    (g.prompt.task, r.info["infra_error"]) for g, rs in zip(groups, rewards) for r in rs if r.info.get("infra_error")
  ]
  total = sum(len(rs) for rs in rewards)
  if not total or len(failed) <= frac * total:
    return
  causes = collections.Counter(failed).most_common(3)
  named = "; ".join(f"{n} x task {task!r}: {why}" for (task, why), n in causes)
  raise RuntimeError(
    f"rollout: {len(failed)} of {total} samples have no verdict, past reward.max_infra_error_frac={frac} "
    f"(a grader fails: nothing to train on). Causes: {named}"
  )


def _checked_rewards(fn: GroupRewardFn, prompt: Prompt, completions) -> list:
  results = list(fn(prompt, completions))
  if len(results) != len(completions):
    raise ValueError(
      f"reward for prompt {prompt.prompt_id} ({prompt.task}) returned {len(results)} "
      f"results for {len(completions)} completions"
    )
  return results
