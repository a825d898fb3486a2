"""Closed-loop critic refinement (K2 §3.2.2): the policy's judgment, as the rubric reward asks for it, is
trained on its own on-policy rollouts of prompts whose reward is verifiable.

Each RL batch's groups of verifiable tasks (reward kinds in VERIFIABLE_KINDS: exact answers, math, code)
give pairs: two responses to one prompt whose verifiable rewards differ (and whose texts differ; the judge
only sees text). A pair becomes critic examples in the rubric reward's own pairwise format
(`grading.rubric.pairwise_messages`: the same prompt, rubrics and answer layout the policy-as-judge sees, in
the chat template `grading.contract.EngineJudge` renders), shown in both orders, with the verdict the
verifier implies, `[[A]]` or `[[B]]` (never `[[TIE]]`: the rewards differ), as the assistant's reply.
With `critic.rubrics` the examples show those task-specific rubrics instead of the rubric reward's generic
ones (same layout; the prompt's own rubrics still follow): 139 tokens instead of 316 on the tiny task.
The layout is the rubric reward's (`RubricRewardConfig.layout`, `reward.judge_layout`): with `short` (the
prompt, the two answers, "[[A]] or [[B]]?"; no rubrics, so `critic.rubrics` is refused) the examples and the
held-out rows are ~30 tokens on the tiny task, the layout a tiny judge learns (bench/critic_loop.py).

How the policy is trained on them (the verifier's own verdicts as targets): an auxiliary SFT-style term in the RL update,
`critic.coef` times the token-mean NLL of the verifier-consistent verdict tokens (the verdict and its
`<|im_end|>`, the judge's stop token), computed in the same forward/backward pass as the K2 objective and
PTX (`rl_step.make_rl_grads`), on `critic.batch_size` rows of `critic.seq_len` tokens drawn from the
batch's training pairs. The verdict is taught without the "reason briefly" text the template invites: the
rubric reward reads only the last `[[...]]`, which is what is supervised here.

Which training pairs: each batch's pairs are made unique by content (a group with one wrong answer gives
K-1 copies of one pair), and the rows are drawn from them together with up to `critic.replay_pairs` unique
training pairs of earlier batches (newest kept). Without that replay, once the policy turns nearly
deterministic the judge sees a single pair for every update of the batch and forgets the rest: measured on
bench/critic_loop.py seed 0, held-out agreement over every held-out pair 1.0 at iteration 8, 0.548 after
three iterations of one pair each. The replay lives on process 0 and starts empty after a restart (as the
batch's scored groups do): a resumed run draws its first critic rows from fresh batches only.

Held out: a pair whose content hash (task, question, the two response texts, unordered) falls below
`critic.heldout_fraction` is never trained on, in any iteration. Each iteration up to `critic.eval_pairs`
of the batch's held-out pairs are scored with the policy's current weights (before the update):
`critic_agreement` = the share of (pair, order) presentations where the verifier-consistent verdict has a
higher sequence log-prob than the other one (a tie counts 1/2), `critic_margin` = the mean log-prob
difference. Both orders of every pair are scored, so a judge blind to content (or always naming one
position) gets exactly 0.5: chance. NaN when the batch has no held-out pair.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import Tokenizer, load_tokenizer
from k2jax.grading.base import Completion, GroupRewardFn, Prompt, RewardResult
from k2jax.grading.rubric import RubricRewardConfig, format_rubrics, judged_question, pairwise_messages
from k2jax.rl.rollout_batch import RolloutBatch

VERIFIABLE_KINDS = ("exact", "math", "code")  # reward kinds whose value a program decides
_EPS = 1e-6  # rewards closer than this are equal (no pair)
_KEEP_TAKES = 4  # scored groups not in a batch within this many iterations are forgotten (reset, superseded)


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  coef: float  # weight of the verdict NLL in the update
  batch_size: int = 16  # critic rows per update
  seq_len: int = 512  # tokens per critic row; longer examples are dropped (counted)
  heldout_fraction: float = 0.2  # content-hash share of pairs never trained on
  eval_pairs: int = 8  # held-out pairs scored per iteration (4 rows each)
  replay_pairs: int = 256  # earlier batches' unique training pairs drawn beside the batch's own
  seed: int = 0  # which training examples / held-out pairs are drawn each iteration
  rubrics: str = ""  # '|'-separated rubrics the critic's examples show instead of the rubric reward's own

  @property
  def rubric_list(self) -> tuple[str, ...]:
    return tuple(r.strip() for r in self.rubrics.split("|") if r.strip())

  def __post_init__(self):
    if self.coef <= 0 or self.batch_size < 1 or self.eval_pairs < 1 or self.seq_len < 2 or self.replay_pairs < 0:
      raise ValueError(
        f"CriticConfig: need coef > 0, batch_size, eval_pairs >= 1, seq_len >= 2 and replay_pairs >= 0, got {self}"
      )
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"CriticConfig.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
    if self.rubrics.strip() and not self.rubric_list:
      raise ValueError(f"CriticConfig.rubrics: no rubric in {self.rubrics!r} ('|'-separated; '' = the rubric reward's)")

  @property
  def eval_rows(self) -> int:
    return 4 * self.eval_pairs


@dataclasses.dataclass(frozen=True)
class Pair:
  """Two responses to one prompt with different verifiable rewards: `better` has the higher one."""

  task: str
  question: str
  rubrics: str  # `format_rubrics` of the prompt, as the rubric reward shows them
  better: str
  worse: str
  better_reward: float
  worse_reward: float
  layout: str = "rubric"  # the judge's prompt layout (grading.rubric.JUDGE_LAYOUTS), the rubric reward's

  @functools.cached_property  # hashed once: prepare() and is_heldout() ask for it on every pair
  def key(self) -> str:
    """Content hash, independent of which answer is better or shown first."""
    lo, hi = sorted((self.better, self.worse))
    h = hashlib.sha256()
    for part in (self.task, self.question, lo, hi):
      h.update(part.encode("utf-8", "surrogatepass") + b"\x00")
    return h.hexdigest()


def is_heldout(pair: Pair, fraction: float) -> bool:
  """Whether `pair` is in the held-out share: its content hash as a number in [0, 1) is below `fraction`."""
  return int(pair.key[:16], 16) / 2.0**64 < fraction


def group_pairs(
  prompt: Prompt, texts: Sequence[str], rewards: Sequence[float], rubrics: str, layout: str = "rubric"
) -> list[Pair]:
  """Every pair of the group's responses whose rewards differ and whose texts differ (shown in `layout`)."""
  question = judged_question(prompt)
  out = []
  for i in range(len(texts)):
    for j in range(i + 1, len(texts)):
      if abs(rewards[i] - rewards[j]) <= _EPS or texts[i] == texts[j]:
        continue
      hi, lo = (i, j) if rewards[i] > rewards[j] else (j, i)
      out.append(
        Pair(prompt.task, question, rubrics, texts[hi], texts[lo], float(rewards[hi]), float(rewards[lo]), layout)
      )
  return out


def verdict_messages(pair: Pair, better_first: bool, verdict_correct: bool = True) -> list[dict]:
  """The judge's chat for `pair` (better answer shown as A iff `better_first`) and the verdict as the
  assistant's reply: the verifier-consistent one, or the other one (`verdict_correct=False`)."""
  a, b = (pair.better, pair.worse) if better_first else (pair.worse, pair.better)
  names_better = "A" if better_first else "B"
  verdict = names_better if verdict_correct else {"A": "B", "B": "A"}[names_better]
  return pairwise_messages(pair.question, pair.rubrics, a, b, pair.layout) + [
    {"role": "assistant", "content": f"[[{verdict}]]"}
  ]


def render_rows(tok: Tokenizer, chats: Sequence[list[dict] | None], rows: int, seq_len: int) -> dict[str, np.ndarray]:
  """Right-padded [rows, seq_len] token / segment / loss-mask arrays (loss on the assistant's verdict);
  None entries and rows past the chats are padding (mask 0). Every chat must fit `seq_len`."""
  tokens = np.zeros((rows, seq_len), np.int32)
  segments = np.zeros((rows, seq_len), np.int32)
  mask = np.zeros((rows, seq_len), np.float32)
  for r, chat in enumerate(chats):
    if chat is None:
      continue
    ids, m = render_chat(chat, tokenizer=tok)
    if len(ids) > seq_len:
      raise ValueError(f"critic example of {len(ids)} tokens does not fit critic.seq_len={seq_len}")
    tokens[r, : len(ids)], segments[r, : len(ids)], mask[r, : len(ids)] = ids, 1, m
  return {"tokens_BT": tokens, "segment_ids_BT": segments, "loss_mask_BT": mask}


def agreement(lp_correct: np.ndarray, lp_wrong: np.ndarray) -> float:
  """Share of presentations where the verifier-consistent verdict is the likelier one (ties 1/2)."""
  lp_correct, lp_wrong = np.asarray(lp_correct, np.float64), np.asarray(lp_wrong, np.float64)
  if lp_correct.size == 0:
    return float("nan")
  return float(np.mean((lp_correct > lp_wrong) + 0.5 * (lp_correct == lp_wrong)))


class CriticRefiner:
  """Builds each iteration's critic rows from the batch's verifiable groups and scores held-out pairs.

  Process 0 wraps the rollout reward (`recording`) to see each scored group's prompt, texts and verifiable
  rewards; `prepare(batch, iteration)` matches the batch's groups to them. Other processes only call
  `empty()` (arrays of the same shapes) and share process 0's."""

  def __init__(
    self,
    config: CriticConfig,
    tokenizer: Tokenizer,
    rubric: RubricRewardConfig,
    reward_kinds: dict[str, str],
  ):
    self.config, self.tok = config, tokenizer
    # The rubric list the examples show: the rubric reward's own, or `critic.rubrics` (task-specific, short:
    # shown as the only core rubrics, none mandatory); the prompt's own rubrics (data['rubrics']) follow either.
    own = config.rubric_list
    if own and rubric.layout == "short":
      raise ValueError(
        f"critic.rubrics={config.rubrics!r} has no effect with reward.judge_layout='short' (it shows no rubrics)"
      )
    self.rubric = (
      rubric if not own else RubricRewardConfig(core=own, prescriptive=(), mandatory=(), layout=rubric.layout)
    )
    self.tasks = {t for t, k in reward_kinds.items() if k in VERIFIABLE_KINDS}
    if not self.tasks:
      raise ValueError(
        f"critic.coef > 0: no task of {sorted(reward_kinds)} has a verifiable reward {VERIFIABLE_KINDS} "
        f"(their kinds: {reward_kinds})"
      )
    self._lock = threading.Lock()
    self._scored: dict[tuple, tuple[int, list[Pair]]] = {}
    self._takes = 0
    self._replay: dict[str, Pair] = {}  # earlier batches' training pairs by key, oldest first (process 0)

  # ---- process 0: scored groups -> pairs ----------------------------------------------------------
  def recording(self, reward_fn: GroupRewardFn) -> GroupRewardFn:
    """`reward_fn`, also keeping the pairs of every verifiable group it scores (called on reward threads)."""

    def reward(prompt: Prompt, completions: Sequence[Completion]) -> Sequence[RewardResult]:
      results = reward_fn(prompt, completions)
      if prompt.task in self.tasks:
        rubrics = format_rubrics(self.rubric, tuple(prompt.data.get("rubrics", ())))
        texts, rewards = [c.text for c in completions], [r.reward for r in results]
        pairs = group_pairs(prompt, texts, rewards, rubrics, self.rubric.layout)
        key = (tuple(prompt.input_ids), tuple(tuple(c.output_ids) for c in completions))
        with self._lock:
          self._scored[key] = (self._takes, pairs)
      return results

    return reward

  def take(self, batch: RolloutBatch) -> list[Pair]:
    """The pairs of the groups in `batch` (matched on prompt and response tokens)."""
    pairs = []
    with self._lock:
      for g in range(batch.num_groups):
        rows = np.flatnonzero(batch.group_ids_B == g)
        P = [int(batch.prompt_lengths_B[b]) for b in rows]
        R = [int(batch.response_lengths_B[b]) for b in rows]
        key = (
          tuple(batch.tokens_BT[rows[0], : P[0]].tolist()),
          tuple(tuple(batch.tokens_BT[b, p : p + r].tolist()) for b, p, r in zip(rows, P, R)),
        )
        found = self._scored.pop(key, None)
        if found is not None:
          pairs.extend(found[1])
      self._takes += 1
      self._scored = {k: v for k, v in self._scored.items() if v[0] > self._takes - _KEEP_TAKES}
    return pairs

  def _fits(self, pair: Pair, better_first: bool) -> bool:
    ids, _ = render_chat(verdict_messages(pair, better_first), tokenizer=self.tok)
    return len(ids) <= self.config.seq_len

  def prepare(self, batch: RolloutBatch, iteration: int) -> tuple[dict, dict, dict]:
    """(train rows, eval rows, info) for this batch: train rows drawn (`batch_size`, both orders) from its
    unique training pairs and the replay of earlier ones, eval rows [better-first correct, better-first wrong,
    worse-first correct, worse-first wrong] per drawn held-out pair. `info` carries counts and how many eval
    pairs are real."""
    c = self.config
    pairs = self.take(batch)
    unique = list({p.key: p for p in pairs}.values())  # one per content (same content, same pair)
    fresh, heldout, too_long = [], [], 0
    for p in unique:
      if is_heldout(p, c.heldout_fraction):
        if self._fits(p, True) and self._fits(p, False):
          heldout.append(p)
        else:
          too_long += 1
      elif self._fits(p, True) and self._fits(p, False):
        fresh.append(p)
      else:
        too_long += 1
    fresh_keys = {p.key for p in fresh}
    replayed = [p for k, p in self._replay.items() if k not in fresh_keys]
    train_ex = [(p, first) for p in fresh + replayed for first in (True, False)]
    rng = np.random.default_rng([c.seed, iteration, 0x51])
    picked = rng.permutation(len(train_ex))[: c.batch_size]
    train = render_rows(self.tok, [verdict_messages(*train_ex[i]) for i in picked], c.batch_size, c.seq_len)
    chosen = [heldout[i] for i in rng.permutation(len(heldout))[: c.eval_pairs]]
    chats = [
      verdict_messages(p, first, correct) for p in chosen for first in (True, False) for correct in (True, False)
    ]
    evals = render_rows(self.tok, chats, c.eval_rows, c.seq_len)
    if c.replay_pairs:
      for p in fresh:  # newest last; the oldest beyond the bound go
        self._replay.pop(p.key, None)
        self._replay[p.key] = p
      while len(self._replay) > c.replay_pairs:
        del self._replay[next(iter(self._replay))]
    info = {
      "critic_pairs": len(pairs),
      "critic_pairs_unique": len(unique),
      "critic_pairs_heldout": len(heldout),
      "critic_pairs_replayed": len(replayed),
      "critic_train_rows": len(picked),
      "critic_too_long": too_long,
      "eval_pairs": len(chosen),
    }
    return train, evals, info

  def empty(self) -> tuple[dict, dict]:
    c = self.config
    return render_rows(self.tok, [], c.batch_size, c.seq_len), render_rows(self.tok, [], c.eval_rows, c.seq_len)

  def metrics(self, evals: dict, info: dict, logprobs_BT: np.ndarray) -> dict:
    """critic_agreement / critic_margin on the held-out rows from the policy's token log-probs."""
    n = info["eval_pairs"]
    seq = np.sum(np.asarray(logprobs_BT, np.float64) * evals["loss_mask_BT"], axis=-1)[: 4 * n].reshape(n * 2, 2)
    out = {k: v for k, v in info.items() if k != "eval_pairs"}
    out["critic_pairs_scored"] = n
    out["critic_agreement"] = agreement(seq[:, 0], seq[:, 1])
    out["critic_margin"] = float(np.mean(seq[:, 0] - seq[:, 1])) if n else float("nan")
    return out


def make_refiner(config: CriticConfig | None, tokenizer_path: str, rubric, reward_kinds) -> CriticRefiner | None:
  """The learner's refiner (None when the critic is off)."""
  return None if config is None else CriticRefiner(config, load_tokenizer(tokenizer_path), rubric, reward_kinds)


def critic_step(
  refiner: CriticRefiner,
  batch: RolloutBatch | None,
  iteration: int,
  to_mesh: Callable[[dict], dict],
  logprobs: Callable[[jax.Array, jax.Array], jax.Array],
) -> tuple[dict, dict]:
  """One iteration's critic work in the learner: rows on process 0 (`batch`; None elsewhere), shared and
  put on the mesh by `to_mesh`, the held-out rows scored by `logprobs(tokens_BT, segment_ids_BT)` with the
  current weights (every process runs it). Returns (the train rows on the mesh, for the update; metrics
  on process 0, {} elsewhere)."""
  if batch is not None:
    train, evals, info = refiner.prepare(batch, iteration)
  else:
    (train, evals), info = refiner.empty(), None
  dev = to_mesh({**train, **{f"eval_{k}": v for k, v in evals.items()}})
  lp = logprobs(dev["eval_tokens_BT"], dev["eval_segment_ids_BT"])
  if jax.process_count() > 1:  # rows are spread over the processes
    from jax.experimental import multihost_utils

    lp = multihost_utils.process_allgather(lp, tiled=True)
  rows = {k: dev[k] for k in train}
  return rows, ({} if info is None else refiner.metrics(evals, info, np.asarray(jax.device_get(lp))))
