"""Typed config trees: a frozen dataclass tree is the single declaration of every knob of a run.

Each field is declared once, with `knob(default, doc, choices=..., check=...)` (or `section(Cls, doc)` for a
nested dataclass, `sections(Cls, doc)` for an open mapping of named sections such as RL's `tasks.<name>`);
a dataclass may add cross-field checks in a `validate(self)` method that calls `need(ok, key, msg)` with keys
relative to itself. Two generic functions replace the hand-written mappings:

  config_dict(Cls)     -> the ml_collections ConfigDict of the defaults (what configs/*.py presets start from
                          and change; `None` defaults become typed FieldReferences so absl can parse
                          `--config.a.b=v` for them)
  build(Cls, d)        -> the frozen tree from a ConfigDict or a plain dict (JSON): unknown keys, wrong types,
                          bad choices and failed checks raise naming the dotted key; missing keys take the
                          declared default (so a dict saved by an older version still loads)

Why a builder over a ConfigDict and not `ml_collections.config_flags.DEFINE_config_dataclass`: the documented
interface is `--config=configs/k2.py:tiny` (a preset file with an argument); DEFINE_config_dataclass takes one
default instance and no file:variant, so every documented command would change. Presets read best as edits of
a ConfigDict (`c.optim.peak_lr = 1e-2`), which DEFINE_config_file already overrides from flags (typed, locked:
an unknown key fails naming it); the builder then adds what absl cannot: cross-field checks, checks that
name the dotted key, sections resolved into runtime objects (`section(..., resolve=)`), and the same path for
configs that do not come from flags (tests, sweeps, JSON).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ml_collections import config_dict as mlc

_MISSING = dataclasses.MISSING


class Invalid(ValueError):
  """A failed check; `key` is relative to the dataclass that raised it (`build` prefixes the path)."""

  def __init__(self, key: str, msg: str):
    super().__init__(f"{key}: {msg}" if key else msg)
    self.key, self.msg = key, msg


def need(ok: bool, key: str, msg: str) -> None:
  """Inside `validate`: raise Invalid(key, msg) unless `ok`."""
  if not ok:
    raise Invalid(key, msg)


def knob(
  default: Any,
  doc: str,
  *,
  choices: tuple | None = None,
  check: Callable[[Any], bool] | None = None,
  rule: str = "",
) -> Any:
  """A leaf field: its default, one-line doc, and optional `choices` or `check(value)` (`rule` says it)."""
  return dataclasses.field(default=default, metadata={"doc": doc, "choices": choices, "check": check, "rule": rule})


def section(cls: type, doc: str, *, resolve: Callable[[Any], Any] | None = None, factory=None) -> Any:
  """A nested section declared by dataclass `cls`. With `resolve`, the field holds `resolve(built cls)`
  (e.g. `model.*` keys -> a K2Config); `factory` is then the field's default."""
  meta = {"doc": doc, "spec": cls, "resolve": resolve}
  return dataclasses.field(default_factory=factory or cls, metadata=meta)


def sections(cls: type, doc: str) -> Any:
  """An open mapping name -> section of dataclass `cls` (empty by default; presets add named sections)."""
  return dataclasses.field(default_factory=dict, metadata={"doc": doc, "items": cls})


def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _optional(tp) -> Any | None:
  """`X | None` -> X, else None."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(tp)) == 2:
      return args[0]
  return None


def _spec(f: dataclasses.Field, tp) -> type | None:
  """The dataclass that declares field `f`'s section, if it is one."""
  if "spec" in f.metadata:
    return f.metadata["spec"]
  return tp if dataclasses.is_dataclass(tp) else None


def config_dict(cls: type) -> mlc.ConfigDict:
  """The ConfigDict of `cls`'s declared defaults (unlocked: presets change fields, then lock it)."""
  c = mlc.ConfigDict()
  hints = _hints(cls)
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
    if "items" in f.metadata:
      c[f.name] = mlc.ConfigDict()
    elif (spec := _spec(f, tp)) is not None:
      c[f.name] = config_dict(spec)
    elif f.default is None:
      c[f.name] = mlc.FieldReference(None, field_type=_optional(tp))
    else:
      c[f.name] = f.default
  return c


def item_config_dict(cls: type, **values) -> mlc.ConfigDict:
  """One section of a `sections` mapping: `cls`'s defaults with `values` set (for presets)."""
  c = config_dict(cls)
  for k, v in values.items():
    c[k] = v
  return c


def _keys(d) -> list[str]:
  return list(d.keys())


def _value(tp, v, key: str):
  """`v` checked and converted to type `tp` (int -> float, list -> tuple); raises Invalid(key)."""
  inner = _optional(tp)
  if inner is not None:
    return None if v is None else _value(inner, v, key)
  if tp is Any:
    return v
  origin = typing.get_origin(tp)
  if origin is tuple:
    args = typing.get_args(tp)
    if not isinstance(v, (tuple, list)):
      raise Invalid(key, f"expected {_name(tp)}, got {v!r}")
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_value(args[0], x, f"{key}[{i}]") for i, x in enumerate(v))
    if len(args) != len(v):
      raise Invalid(key, f"expected {_name(tp)}, got {v!r}")
    return tuple(_value(a, x, f"{key}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
  if tp is float and isinstance(v, int) and not isinstance(v, bool):
    return float(v)
  if tp in (int, float, str, bool):
    if not isinstance(v, tp) or (tp is not bool and isinstance(v, bool)):
      raise Invalid(key, f"expected {tp.__name__}, got {v!r}")
    return v
  raise TypeError(f"{key}: configlib does not handle fields of type {tp!r}")


def _name(tp) -> str:
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def build(cls: type, d: Mapping | mlc.ConfigDict, *, key: str = "", error: type[Exception] = ValueError):
  """`d` (a ConfigDict or plain dict) -> a frozen `cls`, checked; errors are `error("<dotted key>: why")`."""
  try:
    return _build(cls, d, key)
  except Invalid as e:
    raise error(str(e)) from None


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix and name else prefix or name


def _build(cls: type, d, prefix: str):
  if not hasattr(d, "keys"):
    raise Invalid(prefix, f"expected a section (keys of {cls.__name__}), got {d!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(_keys(d)) - set(fields))
  if unknown:
    raise Invalid(prefix, f"unknown key(s) {unknown}; known: {sorted(fields)}")
  hints = _hints(cls)
  kw = {}
  for name, f in fields.items():
    if name not in _keys(d):
      continue  # the declared default
    key, v, tp = _join(prefix, name), d[name], hints[name]
    if "items" in f.metadata:
      if not hasattr(v, "keys"):
        raise Invalid(key, f"expected named sections, got {v!r}")
      kw[name] = {str(k): _build(f.metadata["items"], v[k], _join(key, str(k))) for k in sorted(_keys(v))}
    elif (spec := _spec(f, tp)) is not None:
      built = _build(spec, v, key)
      if f.metadata.get("resolve") is not None:
        try:
          built = f.metadata["resolve"](built)
        except Invalid as e:
          raise Invalid(_join(key, e.key), e.msg) from None
      kw[name] = built
    else:
      v = _value(tp, v, key)
      choices, check = f.metadata.get("choices"), f.metadata.get("check")
      if choices is not None and v not in choices:
        raise Invalid(key, f"one of {choices}, got {v!r}")
      if check is not None and not check(v):
        raise Invalid(key, f"{f.metadata.get('rule') or 'invalid value'}, got {v!r}")
      kw[name] = v
  obj = cls(**kw)
  validate = getattr(obj, "validate", None)
  if validate is not None:
    try:
      validate()
    except Invalid as e:
      raise Invalid(_join(prefix, e.key), e.msg) from None
  return obj


def docs(cls: type, prefix: str = "") -> dict[str, str]:
  """Dotted key -> its one-line doc, for every knob of the tree (sections included)."""
  out = {}
  hints = _hints(cls)
  for f in dataclasses.fields(cls):
    key = _join(prefix, f.name)
    out[key] = f.metadata.get("doc", "")
    if "items" in f.metadata:
      out.update(docs(f.metadata["items"], f"{key}.<name>"))
    elif (spec := _spec(f, hints[f.name])) is not None:
      out.update(docs(spec, key))
  return out
