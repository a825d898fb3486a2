"""Writes docs/config-reference.md from the config files themselves: every knob of configs/*.py with its type,
default, the presets that change it and its one-line doc.

  python scripts/config_reference.py            # rewrites docs/config-reference.md
  python scripts/config_reference.py --check    # exit 1 if the checked-in file differs (tests/test_config_reference.py)

Each configs/*.py starts from the ConfigDict of one typed declaration (`configlib.knob(default, doc)` per field)
and its presets only change fields, so the declaration gives every key, default and doc, and each preset's
`get_config(variant)` gives what it changes. ROOTS names the declaration behind each config file; a config
file missing from it is an error naming the file, so a new one cannot be left out of the reference. A config
file that builds its ConfigDict by hand (ROOTS value None) documents each knob by the comment on the line that
sets it (`c.key = value  # meaning`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import io
import pathlib
import re
import sys
import tokenize
import typing

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "config-reference.md"

# config file -> (module, dataclass) that declares its every knob
ROOTS = {
  "configs/k2.py": ("k2jax.train.config", "TrainConfig"),
  "configs/rl.py": ("k2jax.rl.config", "RLConfig"),
  "configs/synth.py": ("k2jax.synth.pipeline", "SynthSpec"),
  "configs/data/rephrase.py": None,  # a hand-built ConfigDict: each line's comment is the knob's doc
}


@dataclasses.dataclass
class Row:
  key: str
  type: str
  default: object
  doc: str
  presets: dict[str, object]


def _load(rel: str):
  spec = importlib.util.spec_from_file_location(f"_configref_{pathlib.Path(rel).stem}", ROOT / rel)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _type(tp) -> str:
  s = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
  return s or str(tp).replace("typing.", "")


def _value(v) -> object:
  """A ConfigDict leaf as a plain value (FieldReference resolved, lists as tuples)."""
  v = v.get() if hasattr(v, "get") and not hasattr(v, "keys") else v
  return tuple(v) if isinstance(v, list) else v


def _lookup(c, dotted: str):
  for part in dotted.split("."):
    c = c[part]
  return _value(c)


def _rows(cls: type, prefix: str, variants: dict) -> list[Row]:
  """Every leaf knob under `cls` (dotted keys from `prefix`), with the presets whose value differs."""
  hints = typing.get_type_hints(cls)
  rows = []
  for f in dataclasses.fields(cls):
    key, meta = f"{prefix}{f.name}", f.metadata
    if "items" in meta:  # an open mapping of named sections (RL's tasks.<name>)
      named = {v: ", ".join(sorted(_lookup(c, key).keys())) for v, c in variants.items() if _lookup(c, key).keys()}
      rows.append(Row(key, "named sections", {}, meta.get("doc", ""), named))
      rows += _rows(meta["items"], f"{key}.<name>.", {})
      continue
    spec = meta.get("spec") or (hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None)
    if spec is not None:
      rows += _rows(spec, f"{key}.", variants)
      continue
    default = _value(f.default)
    changed = {v: _lookup(c, key) for v, c in variants.items()}
    changed = {v: x for v, x in changed.items() if x != default}
    rows.append(Row(key, _type(hints[f.name]), default, meta.get("doc", ""), changed))
  return rows


def _fmt(v) -> str:
  s = repr(v).replace(str(ROOT) + "/", "")  # repository paths relative to the checkout
  return f"`{s}`".replace("|", "\\|")


def _cell(text: str) -> str:
  return " ".join(text.split()).replace("|", "\\|")


def _line_comments(rel: str) -> dict[str, str]:
  """key -> the comment on the line `c.key = ...` of a hand-built config file."""
  docs = {}
  source = (ROOT / rel).read_text()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      m = re.match(r"\s*c\.([\w.]+)\s*=", tok.line)
      if m:
        docs[m.group(1)] = tok.string.lstrip("#").strip()
  return docs


def _leaves(c, prefix: str = ""):
  for k in c.keys():
    if hasattr(c[k], "keys"):
      yield from _leaves(c[k], f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", _value(c[k])


@functools.cache
def reference_for(rel: str) -> tuple[list[str], list[Row]]:
  """(variants, rows) of one config file (cached: the configs do not change within a process)."""
  if rel not in ROOTS:
    raise ValueError(f"{rel}: not in scripts/config_reference.py ROOTS: name the dataclass declaring its knobs")
  mod = _load(rel)
  names = list(getattr(mod, "VARIANTS", ("",)))
  variants = {v: mod.get_config(v) for v in names}
  if ROOTS[rel] is not None:
    cls = getattr(importlib.import_module(ROOTS[rel][0]), ROOTS[rel][1])
    return names, _rows(cls, "", variants)
  docs, base = _line_comments(rel), variants[names[0]]
  rows = []
  for key, default in _leaves(base):
    changed = {v: _lookup(c, key) for v, c in variants.items() if _lookup(c, key) != default}
    rows.append(Row(key, type(default).__name__, default, docs.get(key, ""), changed))
  return names, rows


def undocumented() -> list[str]:
  """`file: key` of every knob whose doc is empty."""
  return [f"{rel}: {r.key}" for rel in sorted(ROOTS) for r in reference_for(rel)[1] if not r.doc.strip()]


def render() -> str:
  files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.py"))
  out = [
    "# Config reference",
    "",
    "Generated by `python scripts/config_reference.py` from the config files and the typed declarations they",
    "start from; `tests/test_config_reference.py` fails when this file differs from what the code declares.",
    "Every key is overridden on the command line as `--config.<key>=VALUE`",
    "(e.g. `python launch/train.py --config=configs/k2.py:tiny --config.optim.peak_lr=3e-3`).",
    "",
  ]
  for rel in files:
    variants = reference_for(rel)[0]
    presets = f": presets {', '.join(variants)}" if variants != [""] else ""
    out += [f"- [`{rel}`](#{rel.replace('/', '').replace('.', '')}){presets}"]
  out.append("")
  for rel in files:
    variants, rows = reference_for(rel)
    if ROOTS[rel] is None:
      intro = f"One config (`--config={rel}`), built by hand; each knob's meaning is the comment on its line."
    else:
      intro = (
        f"Presets (`--config={rel}:NAME`): {', '.join(f'`{v}`' for v in variants)}. Knobs declared by "
        f"`{'.'.join(ROOTS[rel])}`; a preset column entry is the value that preset sets where it differs from the "
        "default."
      )
    out += [
      f"## {rel}",
      "",
      intro,
      "",
      "| key | type | default | presets | meaning |",
      "|---|---|---|---|---|",
    ]
    for r in rows:
      presets = "; ".join(f"{v}: {x if r.type == 'named sections' else _fmt(x)}" for v, x in r.presets.items())
      out.append(f"| `{r.key}` | {_cell(r.type)} | {_fmt(r.default)} | {_cell(presets)} | {_cell(r.doc)} |")
    out.append("")
  return "\n".join(out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--check", action="store_true", help="exit 1 if docs/config-reference.md is not up to date")
  args = ap.parse_args(argv)
  text = render()
  if args.check:
    if not OUT.exists() or OUT.read_text() != text:
      print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/config_reference.py", file=sys.stderr)
      return 1
    return 0
  OUT.parent.mkdir(exist_ok=True)
  OUT.write_text(text)
  print(f"wrote {OUT.relative_to(ROOT)}")
  return 0


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))
  sys.exit(main())
