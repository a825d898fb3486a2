"""EvalPlus HumanEval+ and MBPP+ (HumanEvalPlus.jsonl, MbppPlus.jsonl of evalplus/humanevalplus-release and
evalplus/mbppplus-release) as EvalPlus grades them: the expected outputs are the canonical solution's, computed
in the sandbox; a sample is run on the base inputs and on the plus inputs; pass@k is the plus score (base
and plus inputs all pass: EvalPlus's "base + extra"), and `base_pass@1` (the original tests' inputs only)
is reported beside it.

  humaneval_plus   task_id, prompt, canonical_solution, entry_point, base_input, plus_input, atol
                   (contract, test: read by EvalPlus's own tools, not here)
  mbpp_plus        the same fields (prompt: the problem's docstring with one assert); its inputs are
                   deserialized as evalplus.data.mbpp.mbpp_deserialize_inputs does (tuples, sets and complex
                   numbers the JSON file spells as lists and strings, by task number)

The prompt is EvalPlus's chat instruction ("Please provide a self-contained Python script that solves the
following problem in a markdown code block:" and the task's prompt fenced); the graded program is the
response's last fenced block (or the whole response when it has none) after the task's prompt, whose imports
and helper functions it may use (as `humaneval`'s grader builds it).

Comparison, EvalPlus's `unsafe_execute` rule, in the grader's process (the expected outputs never enter the
solution's): both sides' results cross as live values (`k2jax.sandbox.compare.live_value`: a Counter, an
OrderedDict, a namedtuple, a numpy scalar or array, a Decimal is rebuilt as that type, so `==` is the one
EvalPlus evaluates on them); equal (`==`), else with an `atol` the same type and length and
`numpy.allclose(out, exp, rtol=1e-7, atol=atol)`. The `atol` is the row's, raised to 1e-6 once an expected
output of a float or a list of floats is compared while it is 0; as in EvalPlus (one variable across its loop
over the inputs), the raised value holds for every later input of that list (base inputs and plus inputs are
two lists, two runs), and an input whose call failed, or whose comparison raised before that point, raises
nothing. The special oracles: HumanEval/32 `find_zero` (|poly(x)| <= atol), and MBPP's set-equal tasks,
not-None tasks (`check_str`, ...), Mbpp/164, /295, /558, /581.

Differences from EvalPlus's harness: a case's time limit is `CodeRewardConfig.case_time_s` (EvalPlus: the
larger of 4 s and 4x the canonical solution's time on that input), and a sample that failed with a case that
timed out is graded again by a rerun; every input runs (EvalPlus stops a sample at its first failing input;
the verdict is the same); the solution's inputs are its own copies, so a solution that mutates its arguments
does not change what the special oracles read (in EvalPlus they read the mutated ones).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from k2jax import pyparse
from k2jax.eval.records import Doc, TaskFormat, str_field
from k2jax.eval.verdict import UNGRADABLE, Verdict
from k2jax.sandbox.code import CodeRewardConfig, extract_code
from k2jax.sandbox.compare import LIVE_ENTRY, live_program, live_value
from k2jax.sandbox.verify import call_results

INSTRUCTION = (
  "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)
STOP = ("\nif __name__", "\ndef main(", "\nprint(")  # EvalPlus's end-of-sequence strings (provider/utility.py)
DEFAULT_FLOAT_ATOL = 1e-6  # EvalPlus: "enforce atol for float comparison" when a row's atol is 0

# evalplus/eval/_special_oracle.py
MBPP_OUTPUT_NOT_NONE_TASKS = ("check_str", "text_match_three", "text_starta_endb")
MBPP_OUTPUT_SET_EQ_TASKS = (
  "similar_elements",  # Mbpp/2
  "find_char_long",  # Mbpp/7
  "common_in_nested_lists",  # Mbpp/111
  "extract_singly",  # Mbpp/140
  "larg_nnum",  # Mbpp/232
  "intersection_array",  # Mbpp/249
  "find_dissimilar",  # Mbpp/579
  "Diff",  # Mbpp/769
)


# ---- reading rows --------------------------------------------------------------------------------------
def parser(dataset: str):
  def parse(r: Mapping[str, Any], i: int) -> Doc:
    task_id, prompt = str_field(r, "task_id"), str_field(r, "prompt")
    entry, canonical = str_field(r, "entry_point"), str_field(r, "canonical_solution")
    if not entry.isidentifier():
      raise ValueError(f"field 'entry_point' must be an identifier, got {entry!r}")
    atol = r["atol"]
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0:
      raise TypeError(f"field 'atol' must be a number >= 0, got {atol!r}")
    try:
      pyparse.parse(prompt + canonical)
    except SyntaxError as e:
      raise ValueError(f"field 'canonical_solution': the prompt and it are not valid Python ({e})") from None
    inputs = {}
    for key in ("base_input", "plus_input"):
      value = r[key]
      if not isinstance(value, list) or not all(isinstance(a, list) for a in value):
        raise TypeError(f"field '{key}' must be a list of argument lists")
      inputs[key] = mbpp_deserialize_inputs(task_id, value, key) if dataset == "mbpp" else value
    if not inputs["base_input"]:
      raise ValueError("field 'base_input' is empty")
    data = {
      "dataset": dataset,
      "task_id": task_id,
      "prompt": prompt,
      "entry_point": entry,
      "canonical_solution": canonical,
      "atol": float(atol),
      **inputs,
    }
    return Doc(task_id, chat_prompt(prompt), canonical, data)

  return parse


def chat_prompt(task_prompt: str) -> str:
  """EvalPlus's instruction for chat models (codegen.py, provider/utility.py's make_raw_chat_prompt)."""
  return f"{INSTRUCTION}\n```\n{task_prompt.strip()}\n```\n"


def mbpp_deserialize_inputs(task_id: str, inputs: list, field: str = "base_input") -> list:
  """MbppPlus.jsonl's inputs as the functions take them: evalplus.data.mbpp.mbpp_deserialize_inputs's table
  (by the number of `Mbpp/N`); a row whose inputs do not have the shape its task needs is a ValueError."""
  try:
    n = int(task_id.rsplit("/", 1)[-1])
  except ValueError:
    raise ValueError(f"field 'task_id': {task_id!r} is not Mbpp/<number>") from None
  try:
    return _deserialize(n, inputs)
  except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
    raise ValueError(f"field {field!r}: not the inputs of Mbpp/{n} ({type(e).__name__}: {e})") from None


_TUPLE_ARGS = {2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560, 579, 596, 616, 630, 726, 740}
_TUPLE_ARGS |= {744, 809}
_NESTED_TUPLES = {63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780}
_FIRST_TUPLES = {75, 413, 444, 753}
_FIRST_TUPLE = {250, 405, 446, 617, 720, 763, 808}
_NESTED_THEN_TUPLE = {259, 401, 445}
_ALL_TUPLES = {580, 615, 791}


def _deserialize(n: int, inputs: list) -> list:
  def all_tuples(x):
    return tuple(all_tuples(y) for y in x) if isinstance(x, list) else x

  if n in _TUPLE_ARGS:
    return [[tuple(a) for a in inp] for inp in inputs]
  if n in _NESTED_TUPLES:
    return [[[tuple(a) for a in lst] for lst in inp] for inp in inputs]
  if n in _FIRST_TUPLES:
    return [[[tuple(a) for a in inp[0]], inp[1]] for inp in inputs]
  if n in (106, 750):
    return [[inp[0], tuple(inp[1])] for inp in inputs]
  if n == 115:
    return [[[set(x) if isinstance(x, list) and x else {} for x in inp[0]]] for inp in inputs]
  if n == 124:
    return [[float(inp[0]), complex(inp[1])] for inp in inputs]
  if n in _FIRST_TUPLE:
    return [[tuple(inp[0]), inp[1]] for inp in inputs]
  if n in _NESTED_THEN_TUPLE:
    return [[tuple(tuple(a) for a in lst) for lst in inp] for inp in inputs]
  if n == 278:
    return [[tuple(tuple(x) if isinstance(x, list) else x for x in inp[0])] for inp in inputs]
  if n == 307:
    return [[tuple(inp[0]), inp[1], inp[2]] for inp in inputs]
  if n == 722:
    return [[{k: tuple(v) for k, v in inp[0].items()}, *inp[1:]] for inp in inputs]
  if n == 252:
    return [[complex(inp[0])] for inp in inputs]
  if n in _ALL_TUPLES:
    return [all_tuples(inp) for inp in inputs]
  return inputs


# ---- grading -------------------------------------------------------------------------------------------
def program(doc: Doc, text: str) -> str:
  """The program a response is run as: its code after the task's prompt (imports, helpers)."""
  prompt, entry = doc.data["prompt"], doc.data["entry_point"]
  body = extract_code(text) if "```" in text else text
  defines = any(line.startswith((f"def {entry}(", f"def {entry} (")) for line in body.splitlines())
  return f"{prompt}\n{body}" if defines else prompt + body


def grade(doc: Doc, text: str, code: CodeRewardConfig) -> Verdict:
  try:
    expected = expected_outputs(doc, code)
  except ValueError as e:  # the canonical solution fails an input: the row, not the sample
    return Verdict(0.0, None, f"{UNGRADABLE}{e}", {"base_pass": False, "plus_pass": False})
  d = doc.data
  n_base = len(d["base_input"])
  got = _run(program(doc, text), d, [*d["base_input"], *d["plus_input"]], code)
  fails = []
  for offset, key in ((0, "base_input"), (n_base, "plus_input")):  # two lists: EvalPlus runs each on its own
    n = len(d[key])
    part = slice(offset, offset + n)
    whys = check_outputs(d["dataset"], d["entry_point"], d[key], got[part], expected[part], d["atol"])
    fails += [(offset + k, why) for k, why in enumerate(whys) if why is not None]
  base_ok = not any(k < n_base for k, _ in fails)
  plus_ok = base_ok and not fails
  n_plus = len(got) - n_base
  base_failed = sum(k < n_base for k, _ in fails)
  reason = f"base {n_base - base_failed}/{n_base}, plus {n_plus - (len(fails) - base_failed)}/{n_plus} inputs passed"
  if fails:
    k, why = fails[0]
    where = f"base input {k}" if k < n_base else f"plus input {k - n_base}"
    reason += f"; {where}: {why}"
  timed_out = not plus_ok and any(why.startswith("timed out") for _, why in fails)  # the machine's load, maybe
  return Verdict(float(plus_ok), None, reason, {"base_pass": base_ok, "plus_pass": plus_ok}, timed_out)


def check_outputs(
  dataset: str, entry: str, inputs: Sequence[list], got: Sequence[tuple[bool, Any]], expected: Sequence, atol: float
) -> list[str | None]:
  """Why each input of one list (base or plus) failed, None where it passed: EvalPlus's loop, its `atol`
  carried from input to input as its loop variable is (module docstring)."""
  out = []
  for inp, (ran, value), exp in zip(inputs, got, expected, strict=True):
    if not ran:
      out.append(value)
      continue
    ok, atol = _judge(dataset, entry, inp, value, exp, atol)
    out.append(None if ok else f"returned {_show(value)}, expected {_show(exp)}")
  return out


def aggregate(doc_samples: list[list[dict]]) -> dict[str, float]:
  """base_pass@1: the base inputs alone (EvalPlus's "base"), the mean over docs of each doc's share."""
  per_doc = [sum(bool(s.get("base_pass")) for s in samples) / len(samples) for samples in doc_samples]
  return {"base_pass@1": sum(per_doc) / len(per_doc)}


_EXPECTED: dict[str, list] = {}
_EXPECTED_LOCKS: dict[str, threading.Lock] = {}
_LOCK = threading.Lock()


def expected_outputs(doc: Doc, code: CodeRewardConfig) -> list:
  """The canonical solution's outputs on the base then the plus inputs, run once per row in the sandbox
  (EvalPlus's get_groundtruth: not-None tasks keep `output is not None`); ValueError when it fails one."""
  d = doc.data
  key = hashlib.sha256(
    repr((d["task_id"], d["prompt"], d["canonical_solution"], d["base_input"], d["plus_input"])).encode()
  ).hexdigest()
  with _LOCK:
    lock = _EXPECTED_LOCKS.setdefault(key, threading.Lock())
  with lock:  # one computation per row, however many samples grade at once
    if key not in _EXPECTED:
      inputs = [*d["base_input"], *d["plus_input"]]
      got = _run(d["prompt"] + d["canonical_solution"], d, inputs, code, canonical=True)
      for k, (ran, out) in enumerate(got):
        if not ran:
          raise ValueError(f"{d['task_id']}: the canonical solution fails input {k}: {out}")
      _EXPECTED[key] = [out for _, out in got]
    return _EXPECTED[key]


_NOT_NONE = "__k2jax_evalplus_not_none"


def _run(source: str, d: Mapping[str, Any], inputs: Sequence[list], code: CodeRewardConfig, canonical=False):
  """(ran, output) per input, the output rebuilt as the live value it was (`compare.live_value`). MBPP's
  not-None tasks return regex matches, which are no value to compare: a wrapper in the program's own process
  returns what EvalPlus compares (the canonical's `out is not None`; a sample's bool as it is, anything else
  `is not None`)."""
  entry = d["entry_point"]
  if d["dataset"] == "mbpp" and entry in MBPP_OUTPUT_NOT_NONE_TASKS:
    keep = "False" if canonical else "type(_r) is bool"
    source += f"\n\n\ndef {_NOT_NONE}(*_a):\n  _r = {entry}(*_a)\n  return _r if {keep} else _r is not None\n"
    entry = _NOT_NONE
  try:
    results = call_results(live_program(source, entry), LIVE_ENTRY, inputs, code)
  except RuntimeError as e:
    raise RuntimeError(f"eval: the code sandbox could not run: {e}") from None
  out = []
  for ran, value in results:
    if ran:
      try:
        value = live_value(value)
      except ValueError as e:
        ran, value = False, f"the result is not a value the grader compares: {e}"[:200]
    out.append((ran, value))
  return out


def outputs_match(dataset: str, entry: str, inp: Sequence[Any], out: Any, exp: Any, atol: float) -> bool:
  """EvalPlus's verdict on one output (`unsafe_execute`, special oracles included), `atol` as it stands."""
  return _judge(dataset, entry, inp, out, exp, atol)[0]


def _judge(dataset: str, entry: str, inp: Sequence[Any], out: Any, exp: Any, atol: float) -> tuple[bool, float]:
  """(passed, the atol the next input of the list is compared with), step by step as `unsafe_execute`: an
  exception anywhere fails the input, and one before the float rule leaves atol as it was."""
  try:
    exact = out == exp
    if dataset == "mbpp":
      if entry == "are_equivalent":  # Mbpp/164
        exact = exact or True
      elif entry == "sum_div":  # Mbpp/295
        exact = exact or out == 0
      elif entry == "surface_Area":  # Mbpp/581
        exact = exact or abs(out - _surface_area(*inp)) <= atol
      elif entry == "digit_distance_nums":  # Mbpp/558
        exact = exact or out == _digit_distance_nums(*inp)
      elif entry in MBPP_OUTPUT_SET_EQ_TASKS:
        exact = set(out) == set(exp)
      elif entry in MBPP_OUTPUT_NOT_NONE_TASKS:
        exact = out == exp if isinstance(out, bool) else exp == (out is not None)
    if dataset == "humaneval" and entry == "find_zero":  # HumanEval/32: any root will do
      return bool(abs(_poly(*inp, out)) <= atol), atol
  except Exception:  # noqa: BLE001  EvalPlus: any exception while checking fails the input
    return False, atol
  if atol == 0 and _is_floats(exp):
    atol = DEFAULT_FLOAT_ATOL  # EvalPlus rebinds its loop's atol: later inputs of this list keep it
  try:
    if not exact and atol != 0:
      if type(out) is not type(exp) or (isinstance(exp, (list, tuple)) and len(out) != len(exp)):
        return False, atol
      return bool(np.allclose(out, exp, rtol=1e-07, atol=atol)), atol
    return bool(exact), atol
  except Exception:  # noqa: BLE001  (an array's truth value, allclose on strings)
    return False, atol


def _show(value: Any) -> str:
  return repr(value)[:80]


def _is_floats(x: Any) -> bool:
  """EvalPlus's is_floats: a float, a non-empty list or tuple of floats, a float64 / float32 array."""
  if isinstance(x, float):
    return True
  if isinstance(x, (list, tuple)) and x:
    return all(isinstance(i, float) for i in x)
  if isinstance(x, np.ndarray):
    return x.dtype in (np.float64, np.float32)
  return False


def _poly(xs: list, x: float) -> float:
  return sum(coeff * math.pow(x, i) for i, coeff in enumerate(xs))


def _surface_area(base_edge, height):
  slant_height = math.sqrt((base_edge / 2) ** 2 + height**2)
  return round(base_edge**2 + 4 * (base_edge * slant_height) / 2)


def _digit_distance_nums(num1, num2):
  a, b = str(num1), str(num2)
  width = max(len(a), len(b))
  return sum(abs(int(x) - int(y)) for x, y in zip(a.zfill(width), b.zfill(width)))


FORMATS = (
  # "2": results compared as live values (a Counter, a namedtuple, a numpy scalar: ungradable in "1"), the
  # float atol carried across a list's inputs as EvalPlus carries it
  TaskFormat(
    "humaneval_plus", "generate", parser("humaneval"), stop=STOP, grade=grade, aggregate=aggregate, version="2"
  ),
  TaskFormat("mbpp_plus", "generate", parser("mbpp"), stop=STOP, grade=grade, aggregate=aggregate, version="2"),
)
