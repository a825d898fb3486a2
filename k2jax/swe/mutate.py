"""Procedural bugs: AST mutations of a source file, of the kinds SWE-smith's procedural generators make
(arXiv 2504.21798 §2; the operators are written here from that list, no code taken from it).

Every mutation is found on the file's `ast` and applied as a text edit of exactly the mutated node's
source span (the rest of the file, comments and formatting included, is untouched), so the gold patch
(the mutation reversed) is a one-hunk diff. Only code inside function bodies is mutated, and only in
functions with at least `min_statements` statements (SWE-smith's complexity gate: a one-line function
has no bug worth finding). Each mutation is checked to parse; the task builder then keeps only those
that break at least one test and leave others passing (k2jax.swe.build).

Kinds:
  flip_comparison     <  <-> >=, >  <-> <=, == <-> !=, is <-> is not, in <-> not in
  flip_boolop         and <-> or
  flip_bool_constant  True <-> False
  off_by_one          an integer constant n -> n + 1 and n - 1
  change_operator     + <-> -, * <-> //, / -> *, % -> //
  swap_arguments      the first two positional arguments of a call
  negate_condition    `if c:` -> `if not c:` (and `while`)
  remove_statement    an assignment, expression statement, if or loop deleted (`pass` if it was alone)
  remove_return       `return x` -> `return`
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
from typing import Iterator, Sequence

from k2jax import pyparse

KINDS = (
  "flip_comparison",
  "flip_boolop",
  "flip_bool_constant",
  "off_by_one",
  "change_operator",
  "swap_arguments",
  "negate_condition",
  "remove_statement",
  "remove_return",
)
_CMP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
_CMP.update({ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In})
_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult}
_BIN[ast.Mod] = ast.FloorDiv
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.If, ast.For, ast.While)


@dataclasses.dataclass(frozen=True)
class Mutation:
  kind: str
  path: str  # relative to the repository root
  function: str
  lineno: int
  before: str  # the whole file's text, before and after
  after: str
  summary: str  # e.g. "line 12: `a < b` -> `a >= b`"

  @property
  def key(self) -> str:
    """A short stable hash naming this mutation (instance ids use it)."""
    return hashlib.sha256(f"{self.path}\0{self.after}".encode()).hexdigest()[:8]


def mutations(path: str, source: str, kinds: Sequence[str] = KINDS, min_statements: int = 2) -> list[Mutation]:
  """Every mutation of `source` (the text of file `path`) of the given kinds, in source order."""
  bad = [k for k in kinds if k not in KINDS]
  if bad:
    raise ValueError(f"unknown mutation kinds {bad}; known: {KINDS}")
  tree = pyparse.parse(source)
  lines = source.splitlines(keepends=True)
  out, seen = [], set()
  for fn in _functions(tree):
    if _count_statements(fn) < min_statements:
      continue
    for kind, node, replacement in _candidates(fn, kinds):
      after = _replace(lines, node, replacement)
      if after is None or after == source or after in seen or not _parses(after):
        continue
      seen.add(after)
      old = ast.get_source_segment(source, node) or ""
      summary = f"line {node.lineno}: `{_short(old)}` -> `{_short(replacement) or '(removed)'}`"
      out.append(Mutation(kind, path, fn.name, node.lineno, source, after, summary))
  return out


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield node


def _count_statements(fn) -> int:
  return sum(isinstance(n, ast.stmt) for n in ast.walk(fn)) - 1


def _own_nodes(fn) -> Iterator[ast.AST]:
  """Nodes of `fn`'s body, not of functions or classes nested in it (those are mutated on their own)."""
  stack = list(reversed(fn.body))
  while stack:
    node = stack.pop()
    yield node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
      continue
    stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _candidates(fn, kinds) -> Iterator[tuple[str, ast.AST, str]]:
  """(kind, node whose span is replaced, replacement text)."""
  for node in _own_nodes(fn):
    if "flip_comparison" in kinds and isinstance(node, ast.Compare) and len(node.ops) == 1:
      if type(node.ops[0]) in _CMP:
        yield "flip_comparison", node, ast.unparse(_with(node, ops=[_CMP[type(node.ops[0])]()]))
    if "flip_boolop" in kinds and isinstance(node, ast.BoolOp):
      yield "flip_boolop", node, ast.unparse(_with(node, op=ast.Or() if isinstance(node.op, ast.And) else ast.And()))
    if isinstance(node, ast.Constant) and type(node.value) is bool and "flip_bool_constant" in kinds:
      yield "flip_bool_constant", node, repr(not node.value)
    if isinstance(node, ast.Constant) and type(node.value) is int and "off_by_one" in kinds:
      for delta in (1, -1):
        if node.value + delta >= 0:
          yield "off_by_one", node, repr(node.value + delta)
    if "change_operator" in kinds and isinstance(node, ast.BinOp) and type(node.op) in _BIN:
      yield "change_operator", node, ast.unparse(_with(node, op=_BIN[type(node.op)]()))
    if "swap_arguments" in kinds and isinstance(node, ast.Call) and len(node.args) >= 2:
      a, b = node.args[0], node.args[1]
      if not any(isinstance(x, ast.Starred) for x in (a, b)) and ast.dump(a) != ast.dump(b):
        yield "swap_arguments", node, ast.unparse(_with(node, args=[b, a, *node.args[2:]]))
    if "negate_condition" in kinds and isinstance(node, (ast.If, ast.While)):
      t = node.test
      neg = t.operand if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) else ast.UnaryOp(ast.Not(), t)
      yield "negate_condition", t, ast.unparse(neg)
    if "remove_return" in kinds and isinstance(node, ast.Return) and node.value is not None:
      yield "remove_return", node, "return"
    if "remove_statement" in kinds:
      for body in _bodies(node):
        for stmt in body:
          if isinstance(stmt, _REMOVABLE) and not _is_docstring(stmt, body):
            yield "remove_statement", stmt, "" if len(body) > 1 else "pass"


def _bodies(node) -> list[list[ast.stmt]]:
  return [getattr(node, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(node, f, None), list)]


def _is_docstring(stmt, body) -> bool:
  return stmt is body[0] and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


def _with(node, **fields):
  """A shallow copy of `node` with some fields replaced (the original tree is left as it was)."""
  new = type(node)(**{f: getattr(node, f) for f in node._fields})
  for k, v in fields.items():
    setattr(new, k, v)
  return ast.copy_location(new, node)


def _replace(lines: list[str], node, text: str) -> str | None:
  """The file with `node`'s span replaced by `text`; a removed statement takes its whole lines."""
  s_line, e_line = node.lineno - 1, node.end_lineno - 1
  first, last = lines[s_line].encode(), lines[e_line].encode()
  s_col, e_col = node.col_offset, node.end_col_offset  # byte offsets (ast counts UTF-8 bytes)
  if isinstance(node, ast.stmt) and text in ("", "pass"):
    if first[:s_col].strip() or last[e_col:].strip():
      return None  # shares its line with other code (`a = 1; b = 2`): no clean removal
    indent = first[:s_col].decode()
    return "".join(lines[:s_line] + ([indent + "pass\n"] if text else []) + lines[e_line + 1 :])
  if "\n" in text and s_line == e_line:
    return None
  new = first[:s_col].decode() + text + last[e_col:].decode()
  return "".join(lines[:s_line] + [new] + lines[e_line + 1 :])


def _parses(source: str) -> bool:
  try:
    pyparse.parse(source)
  except SyntaxError:
    return False
  return True


def _short(text: str, n: int = 60) -> str:
  text = " ".join(text.split())
  return text if len(text) <= n else text[: n - 3] + "..."
