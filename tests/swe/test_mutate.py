"""AST mutations: every kind edits exactly the mutated span, parses, and reverses to the original."""

import ast

import pytest

from k2jax.swe import mutate, snapshot

SRC = '''"""doc"""


def f(a, b, items):
  """Docstring kept."""
  total = 0  # a comment that must survive
  for x in items:
    if x < a and x != b:
      total += x * 2
  flag = True
  g(a, b)
  return total - 1


def one_liner(x):
  return x
'''


def test_every_kind_is_found_and_only_its_span_changes():
  found = mutate.mutations("pkg/m.py", SRC)
  assert {m.kind for m in found} == set(mutate.KINDS)
  for m in found:
    ast.parse(m.after)
    assert m.function == "f"  # one_liner is below the complexity gate
    assert "# a comment that must survive" in m.after or m.kind == "remove_statement"
    changed = [i for i, (a, b) in enumerate(zip(SRC.splitlines(), m.after.splitlines())) if a != b]
    assert changed and changed[0] + 1 == m.lineno, m.summary


def test_specific_mutations():
  after = {(m.kind, m.summary.split(": ", 1)[1]): m.after for m in mutate.mutations("m.py", SRC)}
  assert ("flip_comparison", "`x < a` -> `x >= a`") in after
  assert ("flip_boolop", "`x < a and x != b` -> `x < a or x != b`") in after
  assert ("swap_arguments", "`g(a, b)` -> `g(b, a)`") in after
  assert ("off_by_one", "`1` -> `2`") in after and ("off_by_one", "`1` -> `0`") in after
  assert ("change_operator", "`x * 2` -> `x // 2`") in after
  assert ("remove_return", "`return total - 1` -> `return`") in after
  assert ("flip_bool_constant", "`True` -> `False`") in after
  text = after[("negate_condition", "`x < a and x != b` -> `not (x < a and x != b)`")]
  assert "    if not (x < a and x != b):\n" in text


def test_gold_patch_reverses_the_mutation(tmp_path):
  for m in mutate.mutations("pkg/m.py", SRC):
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "m.py").write_text(m.after)
    snapshot.apply_patch(snapshot.diff_texts("pkg/m.py", m.after, m.before), str(tmp_path))
    assert (tmp_path / "pkg" / "m.py").read_text() == SRC


def test_unknown_kind_is_an_error():
  with pytest.raises(ValueError, match="unknown mutation kinds"):
    mutate.mutations("m.py", SRC, kinds=("nope",))
