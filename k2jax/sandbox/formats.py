"""Reading dataset rows in their published test formats: `parse_row(row)` -> `Problem`, by the row's own fields.

  input_output                  APPS / TACO / DeepCoder: a JSON string or dict {"inputs": [...], "outputs":
                                [...], "fn_name"?}. Without fn_name each case is stdin -> stdout; with it,
                                each input is the argument list (or newline-separated JSON arguments) of
                                `fn_name` (a function, or a method of LeetCode's `class Solution`), and the
                                output its result (APPS's rule: equal, or equal to the output's only element)
  public_test_cases,            LiveCodeBench: JSON lists (private ones also base64 + zlib + pickle, read
  private_test_cases, metadata  with an unpickler that builds no object) of {input, output, testtype:
                                "stdin" | "functional"}; functional cases call metadata.func_name with the
                                input's newline-separated JSON arguments, output JSON
  public_tests, private_tests,  CodeContests: {"input": [...], "output": [...]} each, stdin -> stdout
  generated_tests
  test, entry_point, prompt?    HumanEval: `test` defines check(candidate), run as `check(candidate)`
  test_list, test_setup_code?   MBPP: each assert of test_list is a case, after test_setup_code
  test (a pytest file)          KodCode: `from solution import f, g` then test functions; pytest runs it in the
                                test's sandbox, each collected item a case (functions only: an object of the
                                solution's, such as a class instance, is not plain data and fails its test)
  checker (with a stdin format) trusted Python defining check(input, output, expected) -> bool, for
                                problems with several right answers (replaces the comparison)

A Problem is what `k2jax.sandbox.verify` runs: stdin/stdout cases, call cases (arguments and results as plain
data), or a trusted test module (HumanEval, MBPP, KodCode) with the names it calls into the solution. Parsing
runs no code of the row's (only `ast`), so a malformed row is refused before any sandbox starts: ValueError
naming the field.
"""

from __future__ import annotations

import ast
import base64
import builtins
import dataclasses
import io
import json
import pickle
import zlib
from collections.abc import Mapping
from typing import Any

from k2jax import pyparse


@dataclasses.dataclass(frozen=True)
class Problem:
  """A row read into what the verifier runs. kind: "stdin" | "call" | "module" | "pytest"."""

  kind: str
  source: str  # the format the row was read as ("apps", "livecodebench", "codecontests", "humaneval", "mbpp")
  inputs: tuple[Any, ...] = ()  # stdin: str; call: list of arguments
  expected: tuple[Any, ...] = ()  # stdin: str; call: the value
  fn_name: str | None = None
  wrapped_outputs: bool = False  # APPS's rule: the result may equal the expected output's only element
  checker: str | None = None
  prompt: str = ""  # module: trusted code run first in the test's process (HumanEval's helpers)
  setup: str = ""  # module: trusted setup (MBPP's test_setup_code), run in both processes
  test: str = ""  # module: the trusted test module (HumanEval's `def check`)
  cases: tuple[str, ...] = ()  # module: one source per case
  remote: tuple[str, ...] = ()  # module: names the test calls into the solution
  bind: tuple[tuple[str, str], ...] = ()  # module: alias -> solution name ("candidate" -> entry_point)
  setup_classes: tuple[str, ...] = ()  # classes the setup defines: their instances cross as attributes

  @property
  def n_cases(self) -> int:
    return len(self.cases) if self.kind == "module" else len(self.inputs)


# ---- reading rows ---------------------------------------------------------------------------------------
def parse_row(row: Mapping[str, Any]) -> Problem:
  """The Problem of a dataset row, by its own field names; ValueError naming the field when it is malformed."""
  if not isinstance(row, Mapping):
    raise ValueError(f"verify: a row must be a mapping of fields, got {type(row).__name__}")
  checker = row.get("checker")
  if checker is not None and not (isinstance(checker, str) and checker.strip()):
    raise ValueError("field 'checker': must be Python source defining check(input, output, expected)")
  if "input_output" in row:
    p = _apps(row["input_output"])
  elif "public_test_cases" in row or "private_test_cases" in row:
    p = _livecodebench(row)
  elif any(k in row for k in ("public_tests", "private_tests", "generated_tests")):
    p = _codecontests(row)
  elif "entry_point" in row and "test" in row:
    return _humaneval(row)
  elif "test_list" in row:
    return _mbpp(row)
  elif "test" in row:
    return _kodcode(row)
  else:
    raise ValueError(
      f"verify: no test field in the row (fields {sorted(row)[:12]}); expected one of input_output, "
      "public_test_cases / private_test_cases, public_tests / private_tests / generated_tests, "
      "test + entry_point, test_list"
    )
  if checker is not None:
    if p.kind != "stdin":
      raise ValueError("field 'checker': only stdin/stdout cases take a checker program")
    p = dataclasses.replace(p, checker=checker)
  return p


def _json_field(value: Any, field: str) -> Any:
  if isinstance(value, (str, bytes)):
    try:
      return json.loads(value)
    except ValueError as e:
      raise ValueError(f"field {field!r}: not valid JSON ({e})") from None
  return value


def _text(v: Any, field: str) -> str:
  if isinstance(v, str):
    return v
  if isinstance(v, list) and all(isinstance(x, str) for x in v):
    return "\n".join(v)
  raise ValueError(f"field {field!r}: a case must be a string (or a list of lines), got {type(v).__name__}")


def _json_args(text: str, field: str) -> list:
  try:
    return [json.loads(line) for line in text.split("\n") if line.strip()]
  except ValueError as e:
    raise ValueError(f"field {field!r}: a functional input must be newline-separated JSON arguments ({e})") from None


def _apps(value: Any) -> Problem:
  io_ = _json_field(value, "input_output")
  if not isinstance(io_, Mapping):
    raise ValueError(f"field 'input_output': must be an object with inputs and outputs, got {type(io_).__name__}")
  for k in ("inputs", "outputs"):
    if not isinstance(io_.get(k), list):
      raise ValueError(f"field 'input_output.{k}': must be a list")
  ins, outs = io_["inputs"], io_["outputs"]
  if not ins or len(ins) != len(outs):
    raise ValueError(f"field 'input_output': {len(ins)} inputs and {len(outs)} outputs (need as many, at least 1)")
  fn = io_.get("fn_name")
  if fn is None:
    return Problem(
      "stdin",
      "apps",
      tuple(_text(x, "input_output.inputs") for x in ins),
      tuple(_text(x, "input_output.outputs") for x in outs),
    )
  if not (isinstance(fn, str) and fn.isidentifier()):
    raise ValueError(f"field 'input_output.fn_name': must be an identifier, got {fn!r}")
  args = []
  for x in ins:
    if isinstance(x, str):
      args.append(_json_args(x, "input_output.inputs"))
    elif isinstance(x, list):
      args.append(x)
    else:
      raise ValueError(f"field 'input_output.inputs': a call's input must be a list of arguments, got {x!r:.60}")
  outs = [_json_field(o, "input_output.outputs") if isinstance(o, str) else o for o in outs]
  return Problem("call", "apps", tuple(args), tuple(outs), fn_name=fn, wrapped_outputs=True)


class _NoObjects(pickle.Unpickler):
  """Loads only plain data: every global (the one way a pickle reaches a callable) is refused."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"refusing to build {module}.{name}: test cases are plain data")


def _lcb_cases(value: Any, field: str) -> list:
  if isinstance(value, str) and not value.lstrip().startswith("["):
    try:  # code_generation_lite's private cases: base64(zlib(pickle(json string)))
      value = _NoObjects(io.BytesIO(zlib.decompress(base64.b64decode(value, validate=True)))).load()
    except Exception as e:
      raise ValueError(f"field {field!r}: neither a JSON list nor base64+zlib+pickle of one ({e})") from None
    if not isinstance(value, str):  # the published files pickle a JSON string, nothing else
      raise ValueError(f"field {field!r}: the pickle holds a {type(value).__name__}, not the JSON string of the cases")
  cases = _json_field(value, field)
  if not isinstance(cases, list) or not all(isinstance(c, Mapping) for c in cases):
    raise ValueError(f"field {field!r}: must be a list of {{input, output, testtype}} objects")
  for c in cases:
    for k in ("input", "output"):
      if not isinstance(c.get(k), str):
        raise ValueError(f"field {field!r}: case {k!r} must be a string")
    if c.get("testtype", "stdin") not in ("stdin", "functional"):
      raise ValueError(f"field {field!r}: testtype {c.get('testtype')!r} is not 'stdin' or 'functional'")
  return cases


def _livecodebench(row: Mapping[str, Any]) -> Problem:
  cases = []
  for field in ("public_test_cases", "private_test_cases"):
    if row.get(field) not in (None, "", []):
      cases += _lcb_cases(row[field], field)
  if not cases:
    raise ValueError("field 'public_test_cases' / 'private_test_cases': no cases")
  kinds = {c.get("testtype", "stdin") for c in cases}
  if len(kinds) > 1:
    raise ValueError("field 'public_test_cases' / 'private_test_cases': stdin and functional cases mixed")
  if kinds == {"stdin"}:
    return Problem("stdin", "livecodebench", tuple(c["input"] for c in cases), tuple(c["output"] for c in cases))
  meta = _json_field(row.get("metadata"), "metadata")
  fn = meta.get("func_name") if isinstance(meta, Mapping) else None
  if not (isinstance(fn, str) and fn.isidentifier()):
    raise ValueError("field 'metadata.func_name': functional cases need the function's name")
  args = tuple(_json_args(c["input"], "public_test_cases") for c in cases)
  outs = tuple(_json_field(c["output"], "public_test_cases.output") for c in cases)
  return Problem("call", "livecodebench", args, outs, fn_name=fn)


def _codecontests(row: Mapping[str, Any]) -> Problem:
  ins, outs = [], []
  for field in ("public_tests", "private_tests", "generated_tests"):
    t = row.get(field)
    if t is None:
      continue
    t = _json_field(t, field)
    if not (isinstance(t, Mapping) and isinstance(t.get("input"), list) and isinstance(t.get("output"), list)):
      raise ValueError(f"field {field!r}: must be {{'input': [...], 'output': [...]}}")
    if len(t["input"]) != len(t["output"]):
      raise ValueError(f"field {field!r}: {len(t['input'])} inputs and {len(t['output'])} outputs")
    ins += [_text(x, f"{field}.input") for x in t["input"]]
    outs += [_text(x, f"{field}.output") for x in t["output"]]
  if not ins:
    raise ValueError("field 'public_tests' / 'private_tests' / 'generated_tests': no cases")
  return Problem("stdin", "codecontests", tuple(ins), tuple(outs))


def _str_field(row: Mapping[str, Any], key: str, required: bool = True) -> str:
  v = row.get(key)
  if v is None and not required:
    return ""
  if not isinstance(v, str):
    raise ValueError(f"field {key!r}: must be a string, got {type(v).__name__}")
  return v


def _compiles(source: str, field: str) -> ast.Module:
  try:
    return pyparse.parse(source)
  except SyntaxError as e:
    raise ValueError(f"field {field!r}: not valid Python ({e})") from None


def _humaneval(row: Mapping[str, Any]) -> Problem:
  test, entry = _str_field(row, "test"), _str_field(row, "entry_point")
  prompt = _str_field(row, "prompt", required=False)
  if not entry.isidentifier():
    raise ValueError(f"field 'entry_point': must be an identifier, got {entry!r}")
  module = _compiles(test, "test")
  if not any(isinstance(s, ast.FunctionDef) and s.name == "check" for s in module.body):
    raise ValueError("field 'test': defines no check(candidate)")
  if prompt:
    _compiles(prompt, "prompt")
  return Problem(
    "module",
    "humaneval",
    prompt=prompt,
    test=test,
    cases=("check(candidate)",),
    remote=(entry,),
    bind=(("candidate", entry),),
  )


def _mbpp(row: Mapping[str, Any]) -> Problem:
  tests = row["test_list"]
  if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
    raise ValueError("field 'test_list': must be a non-empty list of assert strings")
  setup = _str_field(row, "test_setup_code", required=False)
  setup_ast = _compiles(setup, "test_setup_code")
  defined = _top_level_names(setup_ast)
  called: list[str] = []
  for i, t in enumerate(tests):
    for node in ast.walk(_compiles(t, f"test_list[{i}]")):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        if name not in defined and not hasattr(builtins, name) and name not in called:
          called.append(name)
  if not called:
    raise ValueError("field 'test_list': the asserts call no function of the solution")
  classes = tuple(s.name for s in setup_ast.body if isinstance(s, ast.ClassDef))
  return Problem("module", "mbpp", setup=setup, cases=tuple(tests), remote=tuple(called), setup_classes=classes)


def _kodcode(row: Mapping[str, Any]) -> Problem:
  test = _str_field(row, "test")
  module = _compiles(test, "test")
  imported = [
    a.name
    for n in ast.walk(module)
    if isinstance(n, ast.ImportFrom) and n.module == "solution" and not n.level
    for a in n.names
  ]
  if not imported:
    raise ValueError(
      "field 'test': a pytest file must import what it tests with `from solution import ...` (KodCode's form); "
      "a HumanEval row needs 'entry_point'"
    )
  if "*" in imported:
    raise ValueError("field 'test': `from solution import *` names nothing the verifier can proxy")
  names = [f.name for f in module.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
  for c in module.body:
    if isinstance(c, ast.ClassDef) and c.name.startswith("Test"):
      names += [f"{c.name}.{f.name}" for f in c.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
  if not names:
    raise ValueError("field 'test': no test function (def test_...) in the pytest file")
  return Problem("pytest", "kodcode", test=test, cases=tuple(names), remote=tuple(imported))


def _top_level_names(module: ast.Module) -> set[str]:
  names: set[str] = set()
  for s in module.body:
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(s.name)
    elif isinstance(s, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in s.names)
    else:
      names.update(n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
  return names


__all__ = ["Problem", "parse_row"]
