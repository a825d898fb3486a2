"""Dumps the typed config every preset of configs/k2.py, configs/rl.py and configs/synth.py builds, as sorted
JSON (`dataclasses.asdict`, repository paths as `<repo>`). tests/test_config.py compares against these files;
rerun only when a preset's values change on purpose: `python tests/golden/config_dumps/dump.py`."""

import dataclasses
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HERE = os.path.dirname(os.path.abspath(__file__))
WORKDIR = "/golden-workdir"  # rl: sync.root defaults under the workdir
STOP_IDS = (1,)  # rl: the tokenizer's stop ids


def _plain(x):
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  if isinstance(x, str):
    return x.replace(REPO, "<repo>")
  return x


def typed(file: str, preset: str):
  """The typed config `configs/<file>.py:<preset>` builds, as plain JSON values."""
  sys.path.insert(0, REPO)
  if file == "k2":
    from configs import k2
    from k2jax.train.config import from_config_dict

    return _plain(from_config_dict(k2.get_config(preset)))
  if file == "rl":
    from configs import rl
    from k2jax.rl.learner import from_config_dict

    lc = from_config_dict(rl.get_config(preset), WORKDIR, STOP_IDS, check_files=False)
    out = _plain(lc)
    out.pop("spec", None)  # LearnerConfig.spec: the RLConfig tree every other field is derived from
    return out
  if file == "synth":
    from configs import synth
    from k2jax.synth import from_config_dict

    return _plain(from_config_dict(synth.get_config(preset), "http://golden-llm:30000"))
  raise ValueError(file)


def presets():
  sys.path.insert(0, REPO)
  from configs import k2, rl, synth

  return [(name, p) for name, mod in (("k2", k2), ("rl", rl), ("synth", synth)) for p in mod.VARIANTS]


def dumps(obj) -> str:
  return json.dumps(obj, sort_keys=True, indent=1) + "\n"


if __name__ == "__main__":
  for file, preset in presets():
    with open(os.path.join(HERE, f"{file}_{preset}.json"), "w") as f:
      f.write(dumps(typed(file, preset)))
    print(f"{file}_{preset}.json")
