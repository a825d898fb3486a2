"""Small statistics helpers."""


def mean(values):
  if not values:
    raise ValueError("mean of an empty sequence")
  return sum(values) / len(values)


def median(values):
  if not values:
    raise ValueError("median of an empty sequence")
  ordered = sorted(values)
  mid = len(ordered) // 2
  if len(ordered) % 2 == 1:
    return ordered[mid]
  return (ordered[mid - 1] + ordered[mid]) / 2


def clamp(value, low, high):
  if low > high:
    raise ValueError("low must not exceed high")
  if value < low:
    return low
  if value > high:
    return high
  return value


def running_total(values):
  out = []
  total = 0
  for v in values:
    total = total + v
    out.append(total)
  return out
