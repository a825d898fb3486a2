"""Closed integer intervals as (start, end) pairs."""


def overlaps(a, b):
  return a[0] <= b[1] and b[0] <= a[1]


def merge(intervals):
  out = []
  for start, end in sorted(intervals):
    if out and start <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], end))
    else:
      out.append((start, end))
  return out


def length(interval):
  return interval[1] - interval[0] + 1
