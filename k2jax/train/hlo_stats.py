"""Per-device totals read from a compiled HLO module's text: bytes moved by each collective kind and
matmul FLOPs, each instruction counted as many times as it runs (while-loop trip counts multiplied in).

Why parse the text: XLA's `cost_analysis()` counts a while-loop body once, so a scanned 61-layer model
inside a 32-microbatch scan reports the FLOPs of one layer of one microbatch. A loop runs
ceil((N - start) / step) times: N from its condition (`compare(counter, constant N), direction=LT`,
the form `lax.scan` and `fori_loop` lower to), start from the loop's initial tuple, step from the
body's counter update (XLA:TPU peels and unrolls loops, so start 1 and step 2 occur); a loop whose
count cannot be read counts once and is reported in `unknown_trip_counts`.

FLOPs: `matmul_flops` counts XLA's `dot`/`convolution` instructions; kernels XLA:TPU runs as Mosaic custom
calls (jax's `ragged_dot`, the Pallas flash attention) are no dots, so their own cost estimates are summed
apart as `custom_call_flops`. ragged_dot's estimate is a dense product over its whole row buffer: for EP's
receive buffer, the dropless worst case (at K2's EP 8, 8x the routed rows), so read it as an upper bound.

Bytes per collective instruction (per device, per execution):
  all-gather          the gathered result          reduce-scatter, all-reduce   the operand
  all-to-all          the operand                  collective-permute            the operand
  ragged-all-to-all   min(operand, output buffer): the rows actually exchanged are at most the
                      smaller side (k2jax sends exactly the routed rows from an [n*k, D] operand)
"""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "s32": 4,
  "u32": 4,
  "s64": 8,
  "u64": 8,
  "f16": 2,
  "bf16": 2,
  "f32": 4,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "f8e4m3b11fnuz": 1,
  "f8e4m3fnuz": 1,
  "f8e5m2fnuz": 1,
}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COST_FLOPS = re.compile(r'"cost_estimate":\{[^}]*"flops":"?(\d+)')


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple shape sums its arrays)."""
  return int(sum(_DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in _arrays(shape)))


def _split_type_and_op(rhs: str) -> tuple[str, str, str]:
  """'f32[2]{0} add(%a, %b), attrs' -> ('f32[2]{0}', 'add', '%a, %b), attrs')."""
  if rhs.startswith("("):  # tuple shape: balanced parentheses
    depth = 0
    for i, ch in enumerate(rhs):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    shape, rest = rhs[: i + 1], rhs[i + 1 :].lstrip()
  else:
    shape, _, rest = rhs.partition(" ")
  op, _, args = rest.partition("(")
  return shape, op.strip(), args


def _operand_names(args: str) -> list[str]:
  """Operand names of an instruction (up to the closing parenthesis of its operand list)."""
  depth, end = 1, len(args)
  for i, ch in enumerate(args):
    depth += ch in "({["
    depth -= ch in ")}]"
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", args[:end])


class _Instr:
  __slots__ = ("name", "shape", "op", "args", "callees", "root")

  def __init__(self, name, shape, op, args, callees, root=False):
    self.name, self.shape, self.op, self.args, self.callees = name, shape, op, args, callees
    self.root = root


def parse(hlo_text: str) -> tuple[dict[str, list[_Instr]], str, dict[str, str]]:
  """(computations: name -> instructions, entry computation name, value name -> shape string)."""
  comps: dict[str, list[_Instr]] = {}
  shapes: dict[str, str] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
      for pname, pshape in re.findall(r"([\w.\-]+):\s*((?:\([^()]*\))|[^,()]+)", header.group(2)):
        shapes[pname] = pshape
      continue
    if current is None:
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, rhs = m.groups()
    shape, op, args = _split_type_and_op(rhs)
    shapes[name] = shape
    callees = _CALLS.findall(args)
    for branches in _BRANCHES.findall(args):
      callees += re.findall(r"%?([\w.\-]+)", branches)
    comps[current].append(_Instr(name, shape, op, args, callees, line.lstrip().startswith("ROOT")))
  if entry is None:
    raise ValueError("HLO text has no ENTRY computation")
  return comps, entry, shapes


def _constant(name: str, by_name: dict[str, _Instr]) -> int | None:
  """Integer value of `name`, following copies/bitcasts/converts to a scalar constant."""
  ins = by_name.get(name)
  while ins is not None and ins.op in ("copy", "bitcast", "convert"):
    ins = by_name.get(_operand_names(ins.args)[0])
  if ins is None or ins.op != "constant":
    return None
  m = re.match(r"\s*(-?\d+)\s*\)", ins.args)
  return int(m.group(1)) if m else None


def _tuple_index(name: str, by_name: dict[str, _Instr]) -> int | None:
  ins = by_name.get(name)
  while ins is not None and ins.op in ("copy", "bitcast"):
    ins = by_name.get(_operand_names(ins.args)[0])
  if ins is None or ins.op != "get-tuple-element":
    return None
  m = re.search(r"index=(\d+)", ins.args)
  return int(m.group(1)) if m else None


def _trip_count(loop: _Instr, comps: dict[str, list[_Instr]], by_name: dict[str, _Instr]) -> int | None:
  cond = comps.get(re.search(r"\bcondition=%?([\w.\-]+)", loop.args).group(1), [])
  body = comps.get(re.search(r"\bbody=%?([\w.\-]+)", loop.args).group(1), [])
  compare = next((i for i in reversed(cond) if i.op == "compare" and "direction=LT" in i.args), None)
  if compare is None:
    return None
  lhs, rhs = (_operand_names(compare.args) + [None, None])[:2]
  limit, index = _constant(rhs, by_name), _tuple_index(lhs, by_name)
  if limit is None or index is None:
    return None
  init = by_name.get(_operand_names(loop.args)[0])
  root = next((i for i in body if i.root), None)
  if init is None or init.op != "tuple" or root is None or root.op != "tuple":
    return None
  start = _constant(_operand_names(init.args)[index], by_name)
  update = by_name.get(_operand_names(root.args)[index])
  step = None
  if update is not None and update.op == "add":
    a, b = _operand_names(update.args)[:2]
    step = _constant(b, by_name) if _tuple_index(a, by_name) == index else _constant(a, by_name)
  if start is None or not step or step < 0:
    return None
  return max(0, -(-(limit - start) // step))


def multiplicities(comps: dict[str, list[_Instr]], entry: str) -> tuple[dict[str, int], int]:
  """How many times each computation runs per execution of `entry`; and the number of while loops
  whose trip count could not be read (counted once)."""
  mult: dict[str, int] = {}
  unknown = 0
  by_name = {ins.name: ins for instrs in comps.values() for ins in instrs}

  def visit(name: str, times: int):
    nonlocal unknown
    mult[name] = mult.get(name, 0) + times
    for ins in comps.get(name, ()):
      if ins.op == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", ins.args).group(1)
        cond = re.search(r"\bcondition=%?([\w.\-]+)", ins.args).group(1)
        n = _trip_count(ins, comps, by_name)
        if n is None:
          unknown += 1
          n = 1
        visit(body, times * n)
        visit(cond, times * (n + 1))
      elif not ins.op.endswith(("-done", "-update")):  # async-done/-update name their start's computation
        for callee in ins.callees:
          visit(callee, times)

  visit(entry, 1)
  return mult, unknown


def _dot_flops(ins: _Instr, shapes: dict[str, str]) -> float:
  """2 * output elements * contracted size, for `dot` and dot-like `convolution` instructions."""
  out = _arrays(ins.shape)
  ops = _operand_names(ins.args)
  if not out or len(ops) < 2 or ops[1] not in shapes:
    return 0.0
  out_elems = math.prod(out[0][1])
  rhs = _arrays(shapes[ops[1]])
  if not rhs:
    return 0.0
  rhs_dims = rhs[0][1]
  if ins.op == "dot":
    m = re.search(r"rhs_contracting_dims=\{([\d,]*)\}", ins.args)
    contracted = [int(d) for d in m.group(1).split(",") if d] if m else []
    return 2.0 * out_elems * math.prod(rhs_dims[d] for d in contracted)
  # convolution: dim_labels=<lhs>_<rhs>-><out>; the contraction is rhs 'i' times the window taps that land
  # on the input, not on its padding or between dilated elements (XLA:TPU writes batched dots of MLA as
  # a window over the batch: `size=64 pad=63_63` or `size=64 stride=63 lhs_dilate=64`, one real tap per
  # output position; counting all 64 overstated those dots 64x).
  m = re.search(r"dim_labels=([\w]+)_([\w]+)->([\w]+)", ins.args)
  if not m or len(m.group(2)) != len(rhs_dims):
    return 0.0
  i = math.prod(size for label, size in zip(m.group(2), rhs_dims) if label == "i")
  out_spatial = {label: size for label, size in zip(m.group(3), out[0][1]) if label.isdigit()}
  lhs = _arrays(shapes.get(ops[0], ""))
  lhs_spatial = {label: size for label, size in zip(m.group(1), lhs[0][1]) if label.isdigit()} if lhs else {}
  window = re.search(r"window=\{([^}]*)\}", ins.args)
  fields = dict(kv.split("=", 1) for kv in window.group(1).split()) if window else {}
  per_dim = lambda key, default: [int(v) for v in fields[key].split("x")] if key in fields else None  # noqa: E731
  stride, dilate = per_dim("stride", 1), per_dim("lhs_dilate", 1)
  pads = [[int(v) for v in p.split("_")] for p in fields["pad"].split("x")] if "pad" in fields else None
  exact = "rhs_dilate" not in fields and set(fields) <= {"size", "pad", "stride", "lhs_dilate", "rhs_reversal"}
  pairs = 1.0  # (output position, tap on a real input element) pairs, over the spatial dims
  for label, outs in out_spatial.items():
    k = rhs_dims[m.group(2).index(label)]
    if not exact or label not in lhs_spatial:
      pairs *= outs * k
      continue
    d = int(label)
    pairs *= _taps_on_input(
      lhs_spatial[label], outs, k, stride[d] if stride else 1, pads[d][0] if pads else 0, dilate[d] if dilate else 1
    )
  return 2.0 * out_elems / max(math.prod(out_spatial.values()), 1) * i * pairs


def _taps_on_input(size: int, outs: int, k: int, stride: int, lo: int, dilate: int) -> int:
  """(output, tap) pairs of a 1-D window whose tap lands on an input element: output o, tap t reads
  position o * stride + t - lo of the input dilated by `dilate` (elements at multiples of it)."""
  last = (size - 1) * dilate
  return sum(1 for o in range(outs) for t in range(k) if 0 <= (p := o * stride + t - lo) <= last and p % dilate == 0)


_MEGASCALE_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


def device_groups(args: str, num_devices: int) -> list[list[int]]:
  """The device groups of one collective's attributes: `source_target_pairs={{0,1},...}` (collective-permute),
  `replica_groups={{0,1},{2,3}}`, the iota form `replica_groups=[G,S]<=[dims]T(perm)` (arange(prod(dims))
  reshaped to dims, transposed by perm, read as G groups of S), or `{}` / none: every device in one group."""
  m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,\s]*\},?\s*)*)\}", args)
  if m:
    groups = [[int(v) for v in g.split(",") if v.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    return [g for g in groups if g] or [list(range(num_devices))]
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", args)
  if m:
    import numpy as np  # noqa: PLC0415

    shape = [int(v) for v in m.group(1).split(",")]
    ids = np.arange(math.prod(int(v) for v in m.group(2).split(","))).reshape([int(v) for v in m.group(2).split(",")])
    if m.group(3):
      ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return ids.reshape(shape[0], -1).tolist()
  return [list(range(num_devices))]


def hlo_stats(hlo_text: str, slice_of: list[int] | None = None) -> dict:
  """{'<kind>_bytes': per-device bytes per step for each COLLECTIVES kind, 'matmul_flops',
  'custom_call_flops', 'unknown_trip_counts'} of a compiled module's `as_text()`.

  `slice_of[d]`: the slice of the program's device `d` (its index in the compile's device assignment, the mesh's
  devices in order). With it, `dcn_bytes` totals what crosses the data-center network per device per step: the
  collectives whose device groups span more than one slice (`dcn_<kind>_bytes`; one program over all slices, as
  on GPU hosts), plus the buffers XLA:TPU's per-slice programs hand to the megascale runtime
  (`dcn_megascale_<transfer type>_bytes`, e.g. all_reduce: the buffer each device reduces across slices)."""
  comps, entry, shapes = parse(hlo_text)
  mult, unknown = multiplicities(comps, entry)
  out = {f"{kind}_bytes": 0 for kind in COLLECTIVES}
  if slice_of is not None:
    out.update({f"dcn_{kind}_bytes": 0 for kind in COLLECTIVES}, dcn_bytes=0)
  flops = custom_flops = 0.0
  for name, instrs in comps.items():
    times = mult.get(name, 0)
    if not times:
      continue
    for ins in instrs:
      op = ins.op[: -len("-start")] if ins.op.endswith("-start") else ins.op
      if op in ("dot", "convolution"):
        flops += times * _dot_flops(ins, shapes)
      elif op == "custom-call":
        m = _COST_FLOPS.search(ins.args)
        custom_flops += times * float(m.group(1)) if m else 0.0
      if op == "send" and slice_of is not None and "xla_megascale_runtime" in ins.args:
        # XLA:TPU compiles one program per slice; what crosses slices is a host-transfer `send` to the megascale
        # runtime (`_xla_megascale_transfer_type`: ALL_REDUCE, ...) of this device's buffer.
        kind = _MEGASCALE_TYPE.search(ins.args)
        key = f"dcn_megascale_{(kind.group(1) if kind else 'unknown').lower()}_bytes"
        nbytes = sum(shape_bytes(shapes.get(o, "")) for o in _operand_names(ins.args)[:1])
        out[key] = out.get(key, 0) + times * nbytes
        out["dcn_bytes"] += times * nbytes
        continue
      if op not in COLLECTIVES:
        continue
      operands = [shape_bytes(shapes.get(o, "")) for o in _operand_names(ins.args)]
      if op == "all-gather":
        result = shape_bytes(ins.shape)
        # An async start's result is (operand, gathered): count the gathered part only.
        nbytes = result - sum(operands) if ins.op.endswith("-start") else result
      elif op == "ragged-all-to-all":
        nbytes = min(operands[0], operands[1])
      else:
        nbytes = sum(operands)
      out[f"{op}_bytes"] += times * nbytes
      if slice_of is not None:
        groups = device_groups(ins.args, len(slice_of))
        if any(len({slice_of[d] for d in g}) > 1 for g in groups):
          out[f"dcn_{op}_bytes"] += times * nbytes
          out["dcn_bytes"] += times * nbytes
  out["matmul_flops"] = flops
  out["custom_call_flops"] = custom_flops
  out["unknown_trip_counts"] = unknown
  return out
