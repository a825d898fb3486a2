"""Every preset builds the typed config it built before (tests/golden/config_dumps), and every `--config.` override
the docs, launch scripts and tests use still parses through absl and builds."""

import json
import os
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from tests.golden.config_dumps import dump

ROOT = dump.REPO
GOLDEN = os.path.join(ROOT, "tests", "golden", "config_dumps")


def _leaves(x, path=""):
  if isinstance(x, dict):
    out = {}
    for k, v in x.items():
      out.update(_leaves(v, f"{path}.{k}" if path else k))
    return out or {path: {}}
  return {path: x}


@pytest.mark.parametrize("file, preset", dump.presets())
def test_preset_matches_golden(file, preset):
  """Every value the golden holds is built again, unchanged. A field added since (with its default) is not
  in the golden and passes; rerun tests/golden/config_dumps/dump.py to record it."""
  with open(os.path.join(GOLDEN, f"{file}_{preset}.json")) as f:
    want = _leaves(json.load(f))
  got = _leaves(dump.typed(file, preset))
  changed = {k: (got.get(k, "<missing>"), v) for k, v in want.items() if got.get(k, "<missing>") != v}
  assert not changed, f"{file}:{preset} (got, golden): {changed}"


# Each entry: the argv of one command in the docs (README.md, docs/, configs/*.py docstrings, launch/*,
# scripts/, deploy/) or tests, config flags only. Paths that need not exist are built with check_files=False (rl).
OVERRIDES = [
  # README.md, docs/, configs/k2.py, launch/train.py, launch/sweep.py, scripts/demo.sh, launch/tpu_pod.sh
  ("configs/k2.py:tiny", ["--config.steps=300"]),
  ("configs/k2.py:tiny", ["--config.steps=50", "--config.optim.peak_lr=3e-3"]),
  ("configs/k2.py:tiny", ["--config.mesh.rules=fsdp_ep", "--config.mesh.expert=4"]),
  ("configs/k2.py:tiny", ["--config.model.hidden_size=256"]),
  ("configs/k2.py:1t", ["--config.steps=20000", "--config.topology=v5p-256", "--config.mesh.expert=8"]),
  ("configs/k2.py:sft_tiny", ["--config.checkpoint.init_from=/tmp/k2tiny", "--config.data.path=chats.jsonl"]),
  ("configs/k2.py:tiny", ["--config.checkpoint.on_unreadable=fresh"]),
  ("configs/k2.py:tiny", ["--config.data.kind=sft", "--config.data.path=OUT/sft.jsonl"]),  # configs/synth.py
  # tests/train
  ("configs/k2.py:tiny", ["--config.log.progress=False", "--config.log.tensorboard=False"]),
  ("configs/k2.py:tiny", ["--config.steps=5", "--config.optim.peak_lr=0.01", "--config.optim.final_lr=0.001"]),
  ("configs/k2.py:tiny", ["--config.data.num_microbatches=2", "--config.optim.warmup_steps=2"]),
  ("configs/k2.py:1t", ["--config.data.seq_len=1024", "--config.data.global_batch_size=4096"]),
  ("configs/k2.py:tiny", ["--config.model.param_dtype=bfloat16", "--config.model.attention=flash"]),
  # configs/rl.py, launch/rl.py, docs/, deploy/k8s/env-swe.yaml, launch/sglang_server.sh, tests/rl
  ("configs/rl.py:tiny", ["--config.rollout.engine_url=http://127.0.0.1:30000"]),
  ("configs/rl.py:tiny", ["--config.rollout.engine=sglang_jax_colocated", "--config.model.preset=tiny128"]),
  ("configs/rl.py:1t", ["--config.rollout.engine_url=http://sglang-router:30000"]),
  ("configs/rl.py:agentic_tiny", ["--config.agentic.env_urls=sim_tools=http://127.0.0.1:8080"]),
  ("configs/rl.py:agentic_tiny", ["--config.reward.judge_url=http://judge:30000"]),
  (
    "configs/rl.py:tiny",
    [
      "--config.model.preset=tiny128",
      "--config.rollout.engine_url=http://127.0.0.1:30000",
      "--config.iterations=3",
      "--config.sync.root=/tmp/fleet/weights",
      "--config.warm_start.steps=2",
      "--config.rollout.group_size=4",
      "--config.rollout.launch_groups=5",
      "--config.rollout.target_groups=4",
      "--config.eval.every=0",
      "--config.ptx.batch_size=4",
    ],
  ),
  (
    "configs/rl.py:tiny",
    [
      "--config.rollout.engine=sglang_jax_colocated",
      "--config.model.preset=tiny128",
      "--config.sglang_jax.device=tpu",
      "--config.sglang_jax.tp_size=4",
      "--config.sglang_jax.attention_backend=fa",
    ],
  ),
  (
    "configs/rl.py:tiny",
    [
      "--config.tokenizer_path=/shared/k2/tiktoken.model",
      "--config.task.kind=math_jsonl",
      "--config.task.path=/shared/math.jsonl",
      "--config.warm_start.steps=0",
      "--config.task.budget=8192",
      "--config.train.seq_len=9216",
      "--config.model.preset=1t",  # docs/rl.md: init_from=/shared/k2, the K2 architecture
      "--config.rollout.engine_url=http://router:30000",
      "--config.sync.root=/shared/rl/weights",
      "--config.rollout.worker_urls=http://r0:30000,http://r1:30000",
      "--config.mesh.rules=fsdp_ep",
      "--config.mesh.expert=8",
    ],
  ),
  ("configs/rl.py:1t", ["--config.sync.dtype=fp8"]),
  # scripts/recipe.sh (docs/pretraining.md's learning recipe)
  ("configs/k2.py:recipe_sft", ["--config.checkpoint.init_from=/tmp/recipe/pretrain"]),
  ("configs/rl.py:swe_tiny", ["--config.tasks.swe.path=/data/swe_tasks/rl_tasks.jsonl"]),
  ("configs/rl.py:swe_tiny", ["--config.agentic.env_urls=swe=http://env-swe.k2jax-envs.svc:8080"]),
  (
    "configs/rl.py:1t",
    ["--config.sync.root=/mnt/shared/k2-weights", "--config.rollout.engine_url=http://sglang-router:30000"],
  ),
  (
    "configs/rl.py:tiny",
    ["--config.engine.sharding=tp_ep", "--config.engine.max_slots=16", "--config.engine.mesh=expert:4,tensor:2"],
  ),
  (
    "configs/rl.py:tiny",
    ["--config.rollout.engine_url=http://h:30000", "--config.rollout.worker_urls=http://h:30001,http://h:30002"],
  ),
  ("configs/rl.py:tiny", ["--config.sglang_jax.precompile_bs_paddings=1,8", "--config.loss.ptx_coef=0.0"]),
  # configs/synth.py, launch/synth.py, docs/agentic.md
  ("configs/synth.py:tiny", ["--config.llm_url=http://127.0.0.1:30000"]),
  (
    "configs/synth.py:default",
    ["--config.llm_url=http://sglang:30000", "--config.num_agents=2000", "--config.concurrency=256"],
  ),
]


def _parse(spec: str, overrides: list[str]):
  """The ConfigDict `--config=<spec> <overrides>` gives a launcher (as launch/*.py define the flag)."""
  argv = ["prog", f"--config={spec}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
  cwd = os.getcwd()
  os.chdir(ROOT)  # the docs' paths are relative to the repository
  try:
    fv(argv)
    return fv.config
  finally:
    os.chdir(cwd)


def _build(spec: str, c):
  sys.path.insert(0, ROOT)
  file = os.path.basename(spec.split(":")[0])
  if file == "k2.py":
    from k2jax.train.config import from_config_dict

    return from_config_dict(c)
  if file == "rl.py":
    from k2jax.rl.learner import from_config_dict

    return from_config_dict(c, "/override-workdir", (1,), check_files=False)
  from k2jax.synth import from_config_dict

  return from_config_dict(c, c.llm_url or "http://local:1")


def _get(obj, dotted: str):
  for part in dotted.split("."):
    obj = obj[part] if isinstance(obj, dict) or hasattr(obj, "keys") else getattr(obj, part)
  return obj


@pytest.mark.parametrize("spec, overrides", OVERRIDES, ids=[f"{s}:{' '.join(o)[:60]}" for s, o in OVERRIDES])
def test_documented_overrides_parse_and_build(spec, overrides):
  c = _parse(spec, overrides)
  for o in overrides:
    key, value = o[len("--config.") :].split("=", 1)
    got = _get(c, key)
    assert str(got) == value or got == type(got)(value) or (isinstance(got, bool) and str(got) == value), (key, got)
  _build(spec, c)  # raises (naming the key) on anything it cannot build


def test_recipe_rl_override_reads_the_sft_workdirs_architecture(tmp_path):
  """scripts/recipe.sh's RL command: `--config.model.init_from=W/sft` builds with that workdir's architecture."""
  from k2jax.convert.workdir import write_model_config
  from k2jax.model import presets

  cfg = presets.get("tiny", hidden_size=96, num_hidden_layers=3)
  write_model_config(cfg, str(tmp_path / "sft"))
  c = _parse("configs/rl.py:recipe", [f"--config.model.init_from={tmp_path / 'sft'}"])
  model = _build("configs/rl.py:recipe", c).model
  assert (model.hidden_size, model.num_hidden_layers) == (96, 3)


@pytest.mark.parametrize(
  "spec, override, key",
  [
    ("configs/k2.py:tiny", "--config.optim.lrr=1", "lrr"),
    ("configs/k2.py:tiny", "--config.steps=abc", "steps"),
    ("configs/k2.py:tiny", "--config.model.hidden_size=1.5", "hidden_size"),
    ("configs/rl.py:tiny", "--config.rollout.grup_size=2", "grup_size"),
    ("configs/rl.py:tiny", "--config.rollout.partial_rollout=maybe", "partial_rollout"),
    ("configs/synth.py:tiny", "--config.num_agent=3", "num_agent"),
  ],
)
def test_bad_override_names_the_key(spec, override, key):
  # absl: a wrong type is an IllegalFlagValueError; a locked ConfigDict refuses an unknown key (AttributeError).
  with pytest.raises((flags.IllegalFlagValueError, AttributeError, KeyError), match=key):
    _parse(spec, [override])


def _trees():
  from k2jax.rl.config import RLConfig
  from k2jax.synth.pipeline import SynthSpec
  from k2jax.train.config import TrainConfig

  return [TrainConfig, RLConfig, SynthSpec]


@pytest.mark.parametrize("cls", _trees(), ids=lambda c: c.__name__)
def test_every_knob_is_declared_with_a_doc(cls):
  from k2jax import configlib

  docs = configlib.docs(cls)
  assert len(docs) >= 25
  assert not [k for k, d in docs.items() if not d.strip() or "\n" in d], "every knob needs a one-line doc"
  # The ConfigDict a preset starts from has exactly the declared keys (sections' own keys included).
  flat = set()

  def walk(c, prefix=""):
    for k in c.keys():
      key = f"{prefix}.{k}" if prefix else k
      flat.add(key)
      if hasattr(c[k], "keys"):
        walk(c[k], key)

  walk(configlib.config_dict(cls))
  assert flat == {k for k in docs if "<name>" not in k}


def test_builder_plain_dicts_defaults_and_errors():
  from k2jax import configlib
  from k2jax.model.config import ConfigError
  from k2jax.rl.config import RLConfig
  from k2jax.train.config import TrainConfig, from_config_dict

  # A plain dict (a JSON dump) builds; keys it lacks take the declared default.
  tc = from_config_dict({"steps": 7, "optim": {"peak_lr": 1, "final_lr": 0.5}, "model": {"hidden_size": 96}})
  assert tc.steps == 7 and tc.optim.peak_lr == 1.0 and isinstance(tc.optim.peak_lr, float)
  assert tc.model.hidden_size == 96 and tc.data.seq_len == 64 and tc.optim.momentum == 0.95
  assert from_config_dict(configlib.config_dict(TrainConfig)) == TrainConfig()
  assert configlib.build(RLConfig, configlib.config_dict(RLConfig)) == RLConfig()
  for bad, msg in (
    ({"optim": {"lrr": 1.0}}, r"optim: unknown key\(s\) \['lrr'\]"),
    ({"data": {"seq_len": "64"}}, r"data\.seq_len: expected int, got '64'"),
    ({"log": {"progress": 1}}, r"log\.progress: expected bool, got 1"),
    ({"steps": True}, r"steps: expected int, got True"),
    ({"checkpoint": {"on_unreadable": "skip"}}, r"checkpoint\.on_unreadable: one of \('error', 'fresh'\)"),
    ({"mesh": {"data": 0}}, r"mesh\.data: must be >= 1 or -1, got 0"),
    ({"mesh": {"data": -1, "fsdp": -1}}, r"mesh: at most one axis may be -1"),
    ({"data": {"global_batch_size": 15, "num_microbatches": 2}}, r"data\.global_batch_size: 15 is not divisible"),
    ({"model": {"num_experts_per_tok": 99}}, r"model\.num_experts_per_tok"),
    ({"model": {"preset": "huge"}}, r"model\.preset: unknown model preset"),
    ({"data": {"seq_len": 100000}}, r"data\.seq_len: 100000 > model max_position_embeddings"),
  ):
    with pytest.raises(ConfigError, match=msg):
      from_config_dict(bad)
  rl = configlib.config_dict(RLConfig)
  rl.tasks["x"] = {"kind": "chess", "budget": 2}
  with pytest.raises(ValueError, match=r"tasks\.x\.kind: one of"):
    configlib.build(RLConfig, rl)
