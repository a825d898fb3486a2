"""INT4 rollouts in the RL loop (`rollout.quantization='int4'`): the embedded engine holds the routed experts
packed as INT4 whatever the trainer's QAT. Without QAT the trainer's float experts are another model than
the one served (the logged trainer/engine logprob gap is large); with `model.expert_qat='int4'` the trainer
trains on the served grid (the gap is the float32 engine's rounding). One iteration of a few rows per arm."""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from k2jax.data.tokenizer import load_tokenizer
from k2jax.model import int4, presets
from k2jax.model.config import ConfigError
from k2jax.rl import learner as learner_lib
from k2jax.rl.learner import Learner, from_config_dict
from k2jax.rl.tasks import ArithmeticTask, strip_stop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("rl_config_file", os.path.join(ROOT, "configs", "rl.py"))
rl_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rl_configs)

pytestmark = pytest.mark.slow  # two tiny learners compiled (one iteration each)


def _config(**overrides):
  c = rl_configs.get_config("tiny")
  c.unlock()
  c.iterations, c.eval.every, c.warm_start.steps, c.loss.ptx_coef = 1, 0, 0, 0.0
  c.rollout.group_size, c.rollout.target_groups, c.rollout.launch_groups = 4, 2, 2
  c.rollout.partial_rollout = False  # every trained token from the current weights: the gap covers them all
  c.checkpoint.async_save = False
  c.rollout.quantization = "int4"
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  c.lock()
  return c


def _run(workdir, **overrides):
  tok = load_tokenizer()
  lc = from_config_dict(_config(**overrides), str(workdir), (tok.eos_id,))
  learner = Learner(  # one trainer device, as the engine (INT4 rollouts serve on one)
    lc,
    str(workdir),
    ArithmeticTask(lc.task, tok.encode, tok.eos_id),
    strip_stop(tok.decode, (tok.eos_id,)),
    devices=jax.devices()[:1],
  )
  try:
    served = learner.engine._runner.params()["moe_layers"]["moe"]["experts"]
    learner.train()
  finally:
    learner.close()
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return served, [r for r in records if "reward_mean" in r]


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
  return {qat: _run(tmp_path_factory.mktemp(f"rl_int4_{qat}"), **{"model.expert_qat": qat}) for qat in ("none", "int4")}


def test_the_embedded_engine_holds_packed_int4_experts_in_both_arms(arms):
  for served, _ in arms.values():
    assert set(served) == {f"{w}{s}" for w in int4.EXPERT_WEIGHTS for s in (int4.PACKED, int4.SCALE)}
    assert served["w_up_int4"].dtype == np.uint8 and served["w_up_scale"].dtype == int4.SCALE_DTYPE


def test_qat_closes_the_trainer_engine_gap_of_int4_rollouts(arms):
  (_, plain), (_, qat) = arms["none"], arms["int4"]
  assert len(plain) == len(qat) == 1
  gap_plain, gap_qat = plain[0]["engine_logprob_max_abs_diff"], qat[0]["engine_logprob_max_abs_diff"]
  # Without QAT the float experts the trainer scores with are not the INT4 experts that sampled.
  assert gap_plain > 1e-3, gap_plain
  # With QAT they are the same numbers: what is left is the cached decode's float32 rounding.
  assert gap_qat < 1e-5, gap_qat


def test_int4_rollouts_refuse_what_cannot_serve_them(tmp_path, monkeypatch):
  tok = load_tokenizer()
  cases = (
    ({"rollout.engine": "sglang_jax_colocated"}, "rollout.quantization: 'int4' rollouts need the embedded engine"),
    ({"rollout.engine_url": "http://sglang:30000", "sync.dtype": "fp8"}, "sync.dtype: rollout.quantization='int4'"),
    ({"engine.sharding": "ep"}, "rollout.quantization: 'int4' rollouts run the embedded engine on one device"),
  )
  for overrides, match in cases:
    with pytest.raises(ConfigError, match=match):
      from_config_dict(_config(**overrides), str(tmp_path), (tok.eos_id,))
  dense = presets.get("tiny", first_k_dense_replace=2, num_hidden_layers=2)  # e.g. an init_from without experts
  monkeypatch.setattr(learner_lib, "model_config", lambda rc: dense)
  with pytest.raises(ConfigError, match="rollout.quantization: 'int4' quantizes the routed experts and model"):
    from_config_dict(_config(), str(tmp_path), (tok.eos_id,))
  monkeypatch.undo()
  lc = from_config_dict(_config(**{"rollout.engine_url": "http://sglang:30000"}), str(tmp_path), (tok.eos_id,))
  assert lc.sync.dtype == "int4"  # a remote engine gets the release's INT4 layout
