"""Python source -> AST (and AST -> code) that any number of threads may call at once.

Every in-process parse in k2jax goes through `parse` (the SWE hack check and mutators, the code verifier's
test splitter and row formats, the corpus reader), because of CPython gh-106905: the C code that turns the
parser's tree into Python `ast` objects counts its recursion depth in state shared by every thread of the
interpreter. When a thread switch happens mid-conversion (a garbage
collection during it runs Python callbacks: jax installs one, `gc.callbacks`), a second thread converting at
the same time moves the same counter, and the first raises `SystemError: AST constructor recursion depth
mismatch`. Python 3.11.7 has it: 64 threads parsing a source of nested expressions with jax imported, 4 to 14
of 400 calls raise here, through `hackcheck.check_source`, `sandbox.code.split_test` or plain `ast.parse`
(CPython's fix keeps the depth per conversion; tests/test_pyparse.py checks whether this Python still has
the bug). One process-wide lock makes the conversions take turns. A conversion holds the GIL all the while
except at such switches, so the lock serialises little that was not serial already: the 400-call stress takes
about as long with it as without (1.1 s and 1.0 s through `check_source`). It is reentrant because a gc
callback run during a parse may itself parse on the same thread. `compile_tree` (an AST back to code) takes the
same lock as a precaution: it converts the same trees the other way, though it raised in none of 2,000
threaded calls here.

Only callers that go through here are covered: code that parses in its own single-threaded process (the
sandbox harnesses and drivers, the SWE test runner's child) needs none of this.
"""

from __future__ import annotations

import ast
import threading
import types

_LOCK = threading.RLock()


def parse(source: str | bytes, filename: str = "<unknown>", mode: str = "exec") -> ast.mod:
  """`ast.parse(source, filename, mode)`, never at the same time as another thread's parse or AST compile."""
  with _LOCK:
    return ast.parse(source, filename, mode)


def compile_tree(tree: ast.AST, filename: str, mode: str = "exec") -> types.CodeType:
  """`compile(tree, filename, mode, dont_inherit=True)` of an AST, under the same lock as `parse`."""
  if not isinstance(tree, ast.AST):
    raise TypeError(f"compile_tree: expected an ast.AST, got {type(tree).__name__} (compile source with compile())")
  with _LOCK:
    return compile(tree, filename, mode, dont_inherit=True)
