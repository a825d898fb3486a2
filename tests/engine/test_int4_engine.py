"""An engine serving INT4 routed experts (`expert_storage='int4'`): pushed float weights are quantized on
arrival to the grid an `expert_qat='int4'` trainer trains on, held packed, and its rollout logprobs equal
the QAT trainer's forward pass on the same tokens."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k2jax.engine import EngineConfig, GenerateRequest, InferenceEngine, SamplingParams
from k2jax.model import K2Model, int4, presets
from k2jax.model.config import ConfigError

MAX_LEN = 64


@pytest.fixture(scope="module")
def served():
  trainer = K2Model(presets.get("tiny", max_position_embeddings=MAX_LEN, expert_qat="int4"), rngs=nnx.Rngs(3))
  cfg = presets.get("tiny", max_position_embeddings=MAX_LEN, expert_storage="int4")
  engine = InferenceEngine(K2Model(cfg, rngs=nnx.Rngs(0)), EngineConfig(max_slots=2, max_seq_len=MAX_LEN))
  engine.update_weights_from_params(nnx.to_pure_dict(nnx.state(trainer)))
  yield trainer, engine
  engine.close()


def _logprobs(model, ids):
  return np.asarray(jax.nn.log_softmax(model(jnp.asarray([ids], jnp.int32)).logits[0], axis=-1))


def test_served_experts_are_the_packed_codes_of_the_qat_grid(served):
  trainer, engine = served
  params = engine._runner.params()["moe_layers"]["moe"]["experts"]
  assert set(params) == {f"{w}{s}" for w in int4.EXPERT_WEIGHTS for s in (int4.PACKED, int4.SCALE)}
  w = trainer.moe_layers.moe.experts.w_down.get_value()
  assert params["w_down_int4"].dtype == jnp.uint8 and params["w_down_int4"].shape[-2] == w.shape[-2] // 2
  served_w = int4.served_weight(params["w_down_int4"], params["w_down_scale"], w.shape[-2], w.dtype)
  np.testing.assert_array_equal(np.asarray(served_w), np.asarray(int4.fake_quant(w)))


def test_rollout_logprobs_equal_the_qat_trainer_forward(served):
  trainer, engine = served
  prompt = [int(t) for t in np.random.RandomState(0).randint(0, 3800, 9)]
  sampling = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
  out = engine.generate(GenerateRequest("int4", tuple(prompt), sampling))
  lp = _logprobs(trainer, prompt + list(out.output_ids))
  want = [lp[len(prompt) - 1 + i, t] for i, t in enumerate(out.output_ids)]
  np.testing.assert_allclose(out.output_logprobs, want, atol=1e-4)
  # The same weights without QAT are another model than the one served: the check above bites.
  no_qat = nnx.merge(
    nnx.graphdef(K2Model(trainer.cfg.replace(expert_qat="none"), rngs=nnx.Rngs(0))), nnx.state(trainer)
  )
  lp0 = _logprobs(no_qat, prompt + list(out.output_ids))
  gap0 = max(abs(lp0[len(prompt) - 1 + i, t] - out.output_logprobs[i]) for i, t in enumerate(out.output_ids))
  assert gap0 > 1e-3


def test_int4_storage_needs_routed_experts():
  with pytest.raises(ConfigError, match="expert_storage: 'int4' stores routed experts and this model has none"):
    presets.get("tiny", expert_storage="int4", first_k_dense_replace=2, num_hidden_layers=2)


def test_an_int4_release_loads_into_the_int4_engine_as_the_pushed_weights(served, tmp_path):
  """The QAT trainer exported in the release's INT4 layout and read back by the engine (dequantized exactly,
  quantized on arrival) serves the same packed codes and scales as a push of the trainer's weights; a
  weight-sync delta is refused."""
  from k2jax.convert import writer

  trainer, engine = served
  pushed = jax.tree.map(np.asarray, engine._runner.params())
  writer.save_hf(trainer.cfg, nnx.to_pure_dict(nnx.state(trainer)), str(tmp_path / "int4"), dtype="int4")
  engine.update_weights(str(tmp_path / "int4"))
  read = jax.tree.map(np.asarray, engine._runner.params())
  experts = lambda p: p["moe_layers"]["moe"]["experts"]  # noqa: E731
  for a, b in zip(jax.tree.leaves(experts(pushed)), jax.tree.leaves(experts(read))):
    np.testing.assert_array_equal(a, b)
  # the rest of the export is bf16 (the router bias float32): the pushed float32 weights rounded once
  np.testing.assert_array_equal(read["lm_head"]["w"], pushed["lm_head"]["w"].astype(jnp.bfloat16).astype(np.float32))
  delta = tmp_path / "delta"  # a weight-sync delta: an index and shards, no config.json
  shutil.copytree(tmp_path / "int4", delta)
  os.remove(delta / "config.json")
  with pytest.raises(ValueError, match="a weight-sync delta; an engine serving INT4 experts"):
    engine.update_weights(str(delta))
