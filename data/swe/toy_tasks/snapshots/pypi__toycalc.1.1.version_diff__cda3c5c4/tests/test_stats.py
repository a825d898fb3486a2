import pytest

from toycalc import stats


def test_mean():
  assert stats.mean([1, 2, 3, 4]) == 2.5


def test_mean_empty():
  with pytest.raises(ValueError):
    stats.mean([])


def test_median_odd():
  assert stats.median([3, 1, 2]) == 2


def test_median_even():
  assert stats.median([4, 1, 3, 2]) == 2.5


def test_clamp_inside():
  assert stats.clamp(5, 0, 10) == 5


def test_clamp_edges():
  assert stats.clamp(-3, 0, 10) == 0
  assert stats.clamp(12, 0, 10) == 10
  assert stats.clamp(10, 0, 10) == 10


def test_clamp_bad_range():
  with pytest.raises(ValueError):
    stats.clamp(1, 5, 0)


def test_running_total():
  assert stats.running_total([1, 2, 3]) == [1, 3, 6]
