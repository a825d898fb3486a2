"""docs/config-reference.md is what scripts/config_reference.py writes from the config files today, and every
knob it lists has a one-line doc."""

import dataclasses
import importlib.util
import pathlib
import sys

from k2jax import configlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _generator():
  if "config_reference" in sys.modules:  # tests/test_docs.py's, when the same process ran it first
    return sys.modules["config_reference"]
  spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # dataclasses look their module up there
  spec.loader.exec_module(mod)
  return mod


GEN = _generator()


def test_checked_in_reference_is_what_the_configs_declare():
  want = GEN.render()
  have = (ROOT / "docs" / "config-reference.md").read_text()
  assert have == want, "docs/config-reference.md is out of date: run `python scripts/config_reference.py`"


def test_every_config_file_is_covered_and_every_knob_documented():
  files = {str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.py")}
  assert files == set(GEN.ROOTS), f"configs/**/*.py vs scripts/config_reference.py ROOTS: {files ^ set(GEN.ROOTS)}"
  assert GEN.undocumented() == [], "knobs without a one-line doc (give them one in their knob(...) declaration)"


@dataclasses.dataclass(frozen=True)
class _Item:
  size: int = configlib.knob(2, "items per thing")


@dataclasses.dataclass(frozen=True)
class _Inner:
  rate: float = configlib.knob(0.5, "how fast")
  name: str | None = configlib.knob(None, "who")


@dataclasses.dataclass(frozen=True)
class _Spec:
  steps: int = configlib.knob(10, "how many steps")
  inner: _Inner = configlib.section(_Inner, "nested")
  things: dict[str, _Item] = configlib.sections(_Item, "named things")


def test_rows_list_defaults_docs_and_what_each_preset_changes():
  base = configlib.config_dict(_Spec)
  fast = configlib.config_dict(_Spec)
  fast.inner.rate = 2.0
  fast.things["a"] = configlib.item_config_dict(_Item, size=3)
  rows = {r.key: r for r in GEN._rows(_Spec, "", {"base": base, "fast": fast})}
  assert list(rows) == ["steps", "inner.rate", "inner.name", "things", "things.<name>.size"]
  assert (rows["steps"].default, rows["steps"].doc, rows["steps"].presets) == (10, "how many steps", {})
  assert rows["inner.rate"].presets == {"fast": 2.0}
  assert rows["inner.name"].type == "str | None" and rows["inner.name"].default is None
  assert rows["things"].presets == {"fast": "a"}
  assert (rows["things.<name>.size"].default, rows["things.<name>.size"].doc) == (2, "items per thing")
