from toycalc import intervals


def test_overlaps():
  assert intervals.overlaps((1, 3), (3, 5))
  assert not intervals.overlaps((1, 2), (3, 5))


def test_merge():
  assert intervals.merge([(5, 6), (1, 3), (2, 4)]) == [(1, 4), (5, 6)]


def test_merge_touching():
  assert intervals.merge([(1, 2), (2, 3)]) == [(1, 3)]


def test_length():
  assert intervals.length((3, 5)) == 3
