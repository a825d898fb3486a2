"""The engine on a serving mesh of 8 fake CPU devices (presets tp, ep, tp_ep) gives the greedy tokens and
logprobs of the one-device engine (<= 1e-5), through continuous batching (more requests than slots),
prefix reuse and aborts; its weights and cache carry the preset's shardings; pause, release and resume
free the cache and bring it back."""

import functools

import numpy as np
import pytest
from flax import nnx

from k2jax.engine import EngineConfig, GenerateRequest, InferenceEngine, SamplingParams
from k2jax.model import K2Model, presets

MAX_LEN, SLOTS = 64, 8
MESHES = {"tp": "data:2,tensor:4", "ep": "expert:8", "tp_ep": "expert:4,tensor:2"}
pytestmark = [pytest.mark.timeout(900), pytest.mark.optimized]  # decode loops: LLVM level 1 (tests/xla_flags.py)


def _greedy(n):
  return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _prompt(n, seed):
  return tuple(int(t) for t in np.random.RandomState(seed).randint(0, 4000, n))


@functools.cache
def _model():
  return K2Model(presets.get("tiny", max_position_embeddings=MAX_LEN), rngs=nnx.Rngs(4))


def _engine(sharding="", mesh=""):
  cfg = EngineConfig(max_slots=SLOTS, max_seq_len=MAX_LEN, prefix_cache_entries=8, sharding=sharding, mesh=mesh)
  return InferenceEngine(_model(), cfg)


def _scenario(engine):
  """10 requests over 8 slots (some wait, join and leave mid-decode), then 2 that extend a finished
  request's prompt + answer (prefix reuse). Returns {rid: (tokens, logprobs, cached_tokens)}."""
  first = [GenerateRequest(f"cb{i}", _prompt(3 + i, i), _greedy(4 + (i * 3) % 9)) for i in range(10)]
  done = [engine.wait(h) for h in [engine.submit(r) for r in first]]
  ext = [
    GenerateRequest(f"px{i}", first[i].input_ids + done[i].output_ids + _prompt(2, 50 + i), _greedy(5)) for i in (1, 4)
  ]
  done += [engine.generate(r) for r in ext]
  return {c.rid: (c.output_ids, np.asarray(c.output_logprobs), c.cached_tokens) for c in done}


@functools.cache
def _reference():
  engine = _engine()
  try:
    return _scenario(engine)
  finally:
    engine.close()


@pytest.mark.slow  # a prefill + decode compile per preset (~20-40 s each on 2 cores)
@pytest.mark.parametrize("preset", sorted(MESHES))
def test_serving_presets_equal_one_device(preset):
  ref = _reference()
  engine = _engine(preset, MESHES[preset])
  try:
    # The layout is the preset's: attention heads over tensor, experts over expert, cache by slot.
    params = engine._runner.params()
    w_q_b = params["moe_layers"]["attn"]["w_q_b"].sharding.spec
    w_up = params["moe_layers"]["moe"]["experts"]["w_up"].sharding.spec
    assert (w_q_b[-1] == "tensor") == ("tp" in preset) and (w_up[1] == "expert") == ("ep" in preset)
    latent = engine._runner.cache["moe_layers"]["latent"]
    assert latent.sharding.spec[1] == (("data", "expert") if "ep" in preset else "data")
    assert len(latent.sharding.device_set) == 8

    got = _scenario(engine)
    for rid, (tokens, logprobs, cached) in ref.items():
      assert got[rid][0] == tokens, rid
      np.testing.assert_allclose(got[rid][1], logprobs, atol=1e-5, rtol=0, err_msg=rid)
      assert got[rid][2] == cached, rid
    assert got["px1"][2] > 0 and got["px4"][2] > 0  # the extensions reused cached rows

    # Abort: a long request returns its partial output, a prefix of the uninterrupted greedy answer (whose
    # first 12 tokens are decoded here: greedy answers to one prompt agree on their common length).
    long = GenerateRequest("long", _prompt(5, 99), _greedy(12))
    full = engine.generate(long)
    handle = engine.submit(GenerateRequest("long2", long.input_ids, _greedy(40)))
    while len(engine.progress(handle).output_ids) < 3:
      pass
    engine.abort(["long2"])
    part = engine.wait(handle, timeout=300)
    assert part.finish_reason == "abort" and 3 <= len(part.output_ids) < 40
    n = min(len(part.output_ids), len(full.output_ids))
    assert part.output_ids[:n] == full.output_ids[:n]

    # Between phases: the cache is freed (its buffers deleted) and comes back zeroed on resume.
    engine.pause()
    engine.release_memory(weights=False)
    assert latent.is_deleted() and engine._runner.cache is None
    engine.resume()
    again = engine.generate(GenerateRequest("again", long.input_ids, _greedy(12)))
    assert again.output_ids == full.output_ids and again.cached_tokens == 0
  finally:
    engine.close()


def test_bad_serving_layouts_name_the_field():
  with pytest.raises(ValueError, match="max_slots=6 is not a multiple of the 8 devices"):
    InferenceEngine(_model(), EngineConfig(max_slots=6, max_seq_len=MAX_LEN, sharding="ep"))
  with pytest.raises(ValueError, match="needs an explicit mesh"):
    InferenceEngine(_model(), EngineConfig(max_slots=8, max_seq_len=MAX_LEN, sharding="tp_ep"))
  with pytest.raises(ValueError, match="engine sharding 'fsdp'"):
    InferenceEngine(_model(), EngineConfig(max_slots=8, max_seq_len=MAX_LEN, sharding="fsdp"))
  with pytest.raises(ValueError, match="entry 'tensor=4'"):
    InferenceEngine(_model(), EngineConfig(max_slots=8, max_seq_len=MAX_LEN, sharding="tp", mesh="tensor=4"))


def test_load_model_reads_weights_onto_the_serving_layout(tmp_path):
  """`launch/serve.py --sharding=...` loads through this: each tensor lands on its serving sharding."""
  import k2jax
  from k2jax.engine.placement import load_model, make_placement

  k2jax.save_hf(_model(), str(tmp_path / "hf"))
  model = load_model(str(tmp_path / "hf"), make_placement("tp_ep", "expert:4,tensor:2"))
  experts = model.moe_layers.moe.experts.w_up[...]
  assert experts.sharding.spec[1:] == ("expert", None, "tensor") and len(experts.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(experts), np.asarray(_model().moe_layers.moe.experts.w_up[...]))
