"""INT4 serving of the routed experts: the trainer/engine mismatch with and without QAT, engine memory and speed.

    python bench/int4.py [--preset=tiny] [--seeds=5] [--steps=20] [--gen=24] [--reps=5] [--part=all|mismatch|serving|rl]
    python bench/int4.py --part=rl [--seeds=5] [--iterations=30] [--window=10]
    python bench/int4.py --preset=small --layers=3 [--optimizer=adam|sgd]  # small's widths, fewer layers

Per seed: one model is initialised, then trained --steps Adam steps on next-token loss over random tokens
twice from that init, (a) plainly (float experts, compute in bf16) and (b) with `expert_qat='int4'`; each is
then pushed into an embedded engine serving INT4 experts (`expert_storage='int4'`, the pushed weights
quantized on arrival) which samples --gen tokens from 4 prompts at temperature 1. Over the sampled tokens:
  kl_{plain,qat}_*:      per-token KL(engine || trainer) over the whole vocabulary (the engine's
                         distribution from its INT4 model's forward pass on the same tokens), mean per seed
  max_gap_{plain,qat}_*: the largest |engine logprob - trainer logprob| of a sampled token per seed
each printed as the median over seeds with the min and max; kl_qat_below_plain says whether QAT's median
is below the plain one's. Then, same weights, one prompt, greedy:
  engine_bytes_{bf16,int4}, engine_bytes_ratio: the served state's bytes (bf16 params with float experts,
                         vs the same with INT4 experts); expert_bytes_*: the routed experts' alone
  decode_tokens_per_sec_{bf16,int4}, decode_speed_ratio: --gen decode steps of the two engines, interleaved,
                         median over --reps with min and max; INT4 dequantizes each layer's experts per step
--part=rl: a short RL run's reward curve with INT4 rollouts, with and without QAT (the comparison verl, SkyRL
and slime make). Per seed, two runs of the real learner on configs/rl.py:tiny (seed, task stream = the seed;
the format-only warm start, then --iterations RL iterations), both with `rollout.quantization=int4` (the
embedded engine serves packed INT4 experts, each push quantized on arrival): (a) the trainer on float experts
(`model.expert_qat=none`: trainer and engine disagree), (b) `model.expert_qat=int4` (they agree). Per arm:
  rl_reward_{arm}_it{i}-{j}: the learner's reward_mean averaged over iterations i..j (--window of them)
  rl_reward_gain_{arm}:      last window minus first window
  rl_gap_{arm}:              the learner's engine_logprob_max_abs_diff (max |engine - trainer| logprob over a
                             batch's trained tokens), median over the run's iterations
each the median over seeds with the min and max; the arms run interleaved, seed by seed.
All figures come from this process.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k2jax import compile_cache  # noqa: E402
from k2jax.data.tokenizer import load_tokenizer  # noqa: E402
from k2jax.engine import EngineConfig, GenerateRequest, InferenceEngine, SamplingParams  # noqa: E402
from k2jax.model import K2Model, int4, presets  # noqa: E402
from k2jax.rl.learner import Learner, from_config_dict  # noqa: E402
from k2jax.rl.tasks import ArithmeticTask, strip_stop  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRESET = flags.DEFINE_string("preset", "tiny", "model preset (tiny | small)")
_SEEDS = flags.DEFINE_integer("seeds", 5, "seeds (model init, training data, prompts)")
_STEPS = flags.DEFINE_integer("steps", 20, "training steps per arm")
_GEN = flags.DEFINE_integer("gen", 24, "tokens sampled per prompt / decoded per speed measurement")
_REPS = flags.DEFINE_integer("reps", 5, "interleaved repetitions of the speed measurement")
_PART = flags.DEFINE_enum(
  "part", "all", ["all", "mismatch", "serving", "rl"], "which measurements to run (all = mismatch and serving)"
)
_LAYERS = flags.DEFINE_integer(
  "layers", 0, "num_hidden_layers override (0 = the preset's): small's 12 layers train in ~20 GB with Adam"
)
_OPTIMIZER = flags.DEFINE_enum(
  "optimizer", "adam", ["adam", "sgd"], "training optimizer (sgd: no state, half Adam's memory with the gradients)"
)
_ITERATIONS = flags.DEFINE_integer("iterations", 30, "--part=rl: RL iterations per arm and seed")
_WINDOW = flags.DEFINE_integer("window", 10, "--part=rl: iterations per reward window")
MAX_LEN, PROMPTS, PROMPT_LEN, BATCH, SEQ = 128, 4, 8, 8, 32


def config(**kw):
  layers = {"num_hidden_layers": _LAYERS.value} if _LAYERS.value else {}
  return presets.get(_PRESET.value, max_position_embeddings=MAX_LEN, compute_dtype="bfloat16", **layers, **kw)


@functools.cache
def programs(cfg):
  """(init, train step, forward log-softmax) of `cfg`, each jitted once and reused across seeds."""
  graphdef = nnx.split(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]
  opt = optax.adam(1e-3) if _OPTIMIZER.value == "adam" else optax.sgd(1e-3)

  def init(seed):
    _, params, rest = nnx.split(K2Model(cfg, rngs=nnx.Rngs(seed)), nnx.Param, ...)
    return params, rest

  # params and optimizer state donated: without it the step holds the old and new copies of both at once
  # (the small preset's float32 params, gradients and Adam state are ~18 GB by themselves)
  @functools.partial(jax.jit, donate_argnums=(0, 2))
  def step(params, rest, opt_state, ids):
    def loss(params):
      logits = nnx.merge(graphdef, params, rest)(ids[:, :-1]).logits.astype(jnp.float32)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    updates, opt_state = opt.update(jax.grad(loss)(params), opt_state)
    return optax.apply_updates(params, updates), opt_state

  full = nnx.graphdef(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))

  @jax.jit
  def log_softmax(state, ids):
    model = nnx.merge(full, state)
    return jax.nn.log_softmax(model(ids[None]).logits[0].astype(jnp.float32), axis=-1)

  return init, step, opt, log_softmax


def train(cfg, seed: int, steps: int) -> nnx.State:
  """`steps` Adam steps from the seed's init on random next-token data; the model's state."""
  init, step, opt, _ = programs(cfg)
  params, rest = init(seed)
  opt_state = opt.init(params)
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (BATCH, SEQ + 1)), jnp.int32)
    params, opt_state = step(params, rest, opt_state, ids)
  return nnx.merge_state(params, rest)


def logprobs(cfg, state, ids: list[int]) -> np.ndarray:
  return np.asarray(programs(cfg)[3](state, jnp.asarray(ids, jnp.int32)))


def mismatch(trainer_cfg, state: dict, engine: InferenceEngine, seed: int) -> tuple[float, float]:
  """(mean per-token KL(engine || trainer), max |logprob gap| of sampled tokens) over the seed's rollouts."""
  engine.update_weights_from_params(nnx.to_pure_dict(state))
  served = engine._runner._state
  rng = np.random.default_rng(1000 + seed)
  kls, gaps = [], []
  for p in range(PROMPTS):
    prompt = [int(t) for t in rng.integers(0, trainer_cfg.vocab_size, PROMPT_LEN)]
    sampling = SamplingParams(max_new_tokens=_GEN.value, temperature=1.0, seed=seed * 100 + p, ignore_eos=True)
    out = engine.generate(GenerateRequest(f"s{seed}p{p}", tuple(prompt), sampling))
    ids = prompt + list(out.output_ids)
    at = slice(len(prompt) - 1, len(ids) - 1)  # the positions that predicted the sampled tokens
    lp_t = logprobs(trainer_cfg, state, ids)[at]
    lp_e = logprobs(engine.cfg, served, ids)[at]
    kls += list(np.sum(np.exp(lp_e) * (lp_e - lp_t), axis=-1))
    gaps += [abs(lp_t[i, t] - lp) for i, (t, lp) in enumerate(zip(out.output_ids, out.output_logprobs))]
  return float(np.mean(kls)), float(np.max(gaps))


def decode_speed(engines: dict, reps: int) -> dict:
  """Greedy decode tokens/s of each engine, interleaved: {name: [per rep]}."""
  prompt = tuple(range(1, PROMPT_LEN + 1))
  greedy = SamplingParams(max_new_tokens=_GEN.value, temperature=0.0, ignore_eos=True)
  for name, eng in engines.items():  # compile every program first
    eng.generate(GenerateRequest(f"warm-{name}", prompt, greedy))
  out = {name: [] for name in engines}
  for r in range(reps):
    for name, eng in engines.items():
      t0 = time.perf_counter()
      res = eng.generate(GenerateRequest(f"{name}{r}", prompt, greedy))
      out[name].append(len(res.output_ids) / (time.perf_counter() - t0))
  return out


def push_as_served(engine: InferenceEngine, state: dict) -> None:
  """`state` in the engine's served dtypes (bf16 engine: cast here; INT4 experts: quantized from float32 first)."""
  abstract = nnx.to_pure_dict(engine._runner._abstract)
  state = int4.served_params(state, abstract)
  engine.update_weights_from_params(jax.tree.map(lambda x, a: jnp.asarray(x).astype(a.dtype), state, abstract))


def served_bytes(engine: InferenceEngine) -> int:
  return sum(a.nbytes for a in jax.tree.leaves(engine._runner.params()))


def expert_bytes(engine: InferenceEngine) -> int:
  return sum(a.nbytes for a in jax.tree.leaves(engine._runner.params()["moe_layers"]["moe"]["experts"]))


def spread(xs) -> str:
  return f"{np.median(xs):.6g} (min {np.min(xs):.6g}, max {np.max(xs):.6g}, n={len(xs)})"


def main(argv):
  del argv
  ec = EngineConfig(max_slots=2, max_seq_len=MAX_LEN, prefix_cache_entries=0)
  if _PART.value in ("all", "mismatch"):
    mismatches(ec)
  if _PART.value in ("all", "serving"):
    serving(ec)
  if _PART.value == "rl":  # minutes of CPU per seed: asked for on its own
    rl_curves()


def mismatches(ec: EngineConfig) -> None:
  plain_cfg, qat_cfg = config(), config(expert_qat="int4")
  int4_engine = InferenceEngine(K2Model(config(expert_storage="int4"), rngs=nnx.Rngs(0)), ec)
  results = {"plain": ([], []), "qat": ([], [])}
  n = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: K2Model(plain_cfg, rngs=nnx.Rngs(0))))))
  print(
    f"preset={_PRESET.value} layers={plain_cfg.num_hidden_layers} params={n} optimizer={_OPTIMIZER.value}", flush=True
  )  # before any long work
  for seed in range(_SEEDS.value):
    for arm, cfg in (("plain", plain_cfg), ("qat", qat_cfg)):
      t0 = time.perf_counter()
      kl, gap = mismatch(cfg, train(cfg, seed, _STEPS.value), int4_engine, seed)
      results[arm][0].append(kl)
      results[arm][1].append(gap)
      print(f"seed={seed} arm={arm} kl={kl:.6g} max_gap={gap:.6g} seconds={time.perf_counter() - t0:.0f}", flush=True)
  int4_engine.close()
  print(f"preset={_PRESET.value} seeds={_SEEDS.value} steps={_STEPS.value} gen={_GEN.value} prompts={PROMPTS}")
  for arm in ("plain", "qat"):
    print(f"kl_{arm}_median={spread(results[arm][0])}")
    print(f"max_gap_{arm}_median={spread(results[arm][1])}")
  print(f"kl_qat_below_plain={np.median(results['qat'][0]) < np.median(results['plain'][0])}")


def serving(ec: EngineConfig) -> None:
  """Both engines hold bf16 weights but for the experts (bf16 vs INT4)."""
  bf16_engine = InferenceEngine(K2Model(config(param_dtype="bfloat16"), rngs=nnx.Rngs(0)), ec)
  int4_engine = InferenceEngine(K2Model(config(param_dtype="bfloat16", expert_storage="int4"), rngs=nnx.Rngs(0)), ec)
  state = nnx.to_pure_dict(train(config(), 0, 0))
  push_as_served(bf16_engine, state)
  push_as_served(int4_engine, state)
  b16, b4 = served_bytes(bf16_engine), served_bytes(int4_engine)
  e16, e4 = (expert_bytes(e) for e in (bf16_engine, int4_engine))
  print(f"engine_bytes_bf16={b16} engine_bytes_int4={b4} engine_bytes_ratio={b4 / b16:.3f}")
  print(f"expert_bytes_bf16={e16} expert_bytes_int4={e4} expert_bytes_ratio={e4 / e16:.4f}")
  speed = decode_speed({"bf16": bf16_engine, "int4": int4_engine}, _REPS.value)
  ratio = [a / b for a, b in zip(speed["int4"], speed["bf16"])]
  print(f"decode_tokens_per_sec_bf16={spread(speed['bf16'])}")
  print(f"decode_tokens_per_sec_int4={spread(speed['int4'])}")
  print(f"decode_speed_ratio_int4_over_bf16={spread(ratio)}")
  for eng in (int4_engine, bf16_engine):
    eng.close()


def rl_run(seed: int, qat: str, iterations: int) -> tuple[list[float], list[float]]:
  """One learner run of configs/rl.py:tiny with INT4 rollouts: (reward_mean, engine_logprob_max_abs_diff) per
  RL iteration (a gap is missing where no trained token came from the current weights)."""
  spec = importlib.util.spec_from_file_location("rl_config_int4", os.path.join(ROOT, "configs", "rl.py"))
  rl_configs = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rl_configs)
  c = rl_configs.get_config("tiny")
  c.unlock()
  c.seed, c.task.seed, c.iterations = seed, seed, iterations
  c.model.expert_qat, c.rollout.quantization = qat, "int4"
  c.eval.every = 0  # the curve is the rollouts' reward; evaluation would only add time
  c.checkpoint.every, c.checkpoint.async_save = iterations, False
  c.lock()
  tok = load_tokenizer()
  with tempfile.TemporaryDirectory() as workdir:
    lc = from_config_dict(c, workdir, (tok.eos_id,))
    task = ArithmeticTask(lc.task, tok.encode, tok.eos_id)
    learner = Learner(lc, workdir, task, strip_stop(tok.decode, lc.rollout.stop_token_ids))
    try:
      learner.train()
    finally:
      learner.close()
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [r for r in map(json.loads, f) if "reward_mean" in r]
  gaps = [r["engine_logprob_max_abs_diff"] for r in records if "engine_logprob_max_abs_diff" in r]
  return [r["reward_mean"] for r in records], gaps


def rl_curves() -> None:
  its, window = _ITERATIONS.value, _WINDOW.value
  if its < window or window < 1:
    raise app.UsageError(f"--iterations ({its}) must be >= --window ({window}) >= 1")
  compile_cache.enable(compile_cache.DEFAULT_DIR)  # later seeds load the arms' programs instead of compiling
  arms = {"plain": "none", "qat": "int4"}
  out = {arm: {"rewards": [], "gaps": []} for arm in arms}
  for seed in range(_SEEDS.value):
    for arm, qat in arms.items():
      t0 = time.perf_counter()
      rewards, gaps = rl_run(seed, qat, its)
      out[arm]["rewards"].append(rewards)
      out[arm]["gaps"].append(float(np.median(gaps)))
      print(
        f"seed={seed} arm={arm} reward={np.round(rewards, 3).tolist()} gap_median={np.median(gaps):.3g} "
        f"seconds={time.perf_counter() - t0:.0f}",
        flush=True,
      )
  print(f"preset=tiny (configs/rl.py:tiny) seeds={_SEEDS.value} iterations={its} window={window} rollouts=int4")
  starts = range(0, its - window + 1, window)
  for arm in arms:
    curves = np.asarray(out[arm]["rewards"])  # [seeds, iterations]
    for i in starts:
      print(f"rl_reward_{arm}_it{i + 1}-{i + window}={spread(curves[:, i : i + window].mean(axis=1))}")
    gain = curves[:, starts[-1] : starts[-1] + window].mean(axis=1) - curves[:, :window].mean(axis=1)
    print(f"rl_reward_gain_{arm}={spread(gain)}")
    print(f"rl_gap_{arm}={spread(out[arm]['gaps'])}")


if __name__ == "__main__":
  app.run(main)
