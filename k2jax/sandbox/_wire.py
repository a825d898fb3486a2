"""Plain data across a process boundary as one JSON line (standard library only: also copied into sandboxes).

Values are None, bool, int, float, str, list, and tagged one-key objects for the rest: {"tuple": [...]},
{"set": [...]}, {"frozenset": [...]}, {"dict": [[k, v], ...]} (any plain key), {"bytes": hex},
{"complex": [re, im]}, and {"obj": [class name, {attr: value}]} for an instance of a class that trusted
setup code defines in both processes (MBPP's `test_setup_code`), rebuilt on the other side as the receiver's
own class without running its `__init__`. Anything else is a TypeError where it is encoded, and a line that
is not such an encoding a ValueError where it is decoded: an object whose `__eq__` is always true cannot
cross. Decoding is bounded: nesting depth, the digits of an int (decimal -> int is quadratic), line length
is the reader's to cap.
"""

import json
import os

MAX_DEPTH = 64
MAX_DIGITS = 4300
_TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}


def encode(v, classes=None, depth=0):
  """`v` as JSON-ready plain data; `classes`: name -> class whose instances may cross as {"obj": ...}."""
  if depth > MAX_DEPTH:
    raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
  t = type(v)
  if v is None or t in (bool, int, float, str):
    return v
  if t is list:
    return [encode(x, classes, depth + 1) for x in v]
  if t in (tuple, set, frozenset):
    return {t.__name__: [encode(x, classes, depth + 1) for x in v]}
  if t is dict:
    return {"dict": [[encode(k, classes, depth + 1), encode(x, classes, depth + 1)] for k, x in v.items()]}
  if t is bytes:
    return {"bytes": v.hex()}
  if t is complex:
    return {"complex": [v.real, v.imag]}
  if classes and t.__name__ in classes and type(getattr(v, "__dict__", None)) is dict:
    return {"obj": [t.__name__, encode(dict(v.__dict__), classes, depth + 1)]}
  raise TypeError(
    f"a {t.__module__}.{t.__qualname__} is not plain data (None, bool, int, float, str, bytes, complex, list, "
    "tuple, dict, set)"
  )


def decode(v, classes=None, depth=0):
  """The inverse of `encode`; ValueError on anything it would not have written."""
  if depth > MAX_DEPTH + 2:
    raise ValueError("value nested too deep")
  t = type(v)
  if v is None or t in (bool, int, float, str):
    return v
  if t is list:
    return [decode(x, classes, depth + 1) for x in v]
  if t is dict and len(v) == 1:
    ((tag, body),) = v.items()
    if tag in _TAGS and type(body) is list:
      return _TAGS[tag](decode(x, classes, depth + 1) for x in body)
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
      return {decode(k, classes, depth + 1): decode(x, classes, depth + 1) for k, x in body}
    if tag == "bytes" and type(body) is str:
      return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
      return complex(body[0], body[1])
    if tag == "obj" and classes and type(body) is list and len(body) == 2 and body[0] in classes:
      attrs = decode(body[1], classes, depth + 1)
      if type(attrs) is dict and all(type(k) is str for k in attrs):
        obj = classes[body[0]].__new__(classes[body[0]])
        obj.__dict__.update(attrs)
        return obj
  raise ValueError(f"not a plain-data encoding: {str(v)[:80]}")


def dumps(v, classes=None):
  return json.dumps(encode(v, classes), separators=(",", ":"))


def loads(text, classes=None):
  return decode(json.loads(text, parse_int=_parse_int), classes)


def _parse_int(text):
  if len(text) > MAX_DIGITS:
    raise ValueError(f"an int of {len(text)} digits (cap {MAX_DIGITS})")
  return int(text)


class Lines:
  """Complete lines from a raw fd (select-friendly: no hidden buffer); `eof` also once a line passes `cap`."""

  def __init__(self, fd, cap):
    self.fd, self.cap, self.buf, self.eof = fd, cap, bytearray(), False

  def read(self):
    chunk = os.read(self.fd, 1 << 16)
    if not chunk:
      self.eof = True
    self.buf += chunk
    out = []
    while (n := self.buf.find(b"\n")) >= 0:
      out.append(bytes(self.buf[: n + 1]))
      del self.buf[: n + 1]
    if len(self.buf) > self.cap:
      self.eof = True
    return out


def write_all(fd, data):
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view) :]
