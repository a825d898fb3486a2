"""Embedded engine: KV-cached decode vs recomputing the prefix, and multi-turn prefix reuse.

    python bench/engine.py [--gen=32] [--turn1=512]

Prints key=value lines:
  decode_ctx{256,1024}_cached_tokens_per_sec / _recompute_tokens_per_sec / _speedup:
    one sequence, greedy; "cached" = the engine's decode step over MLA's latent cache; "recompute" =
    the model's full forward over the whole (fixed-size padded) sequence for every new token.
  multiturn_turn2_{turn,first_token}_{reuse,noreuse}_sec / _prefix_reuse_speedup: latency of a
    conversation's second turn (history resent; whole turn of --gen tokens, and time to first token)
    with the first turn's cache reused vs after a cache flush (median of 3).
All numbers come from this process (tiny preset, max_position_embeddings raised to fit).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from k2jax.model import K2Model, presets
from k2jax.engine import EngineConfig, GenerateRequest, InferenceEngine, SamplingParams
from k2jax.engine.runner import ModelRunner, sampling_arrays

_GEN = flags.DEFINE_integer("gen", 32, "tokens generated per measurement")
_TURN1 = flags.DEFINE_integer("turn1", 512, "first-turn prompt length for the multi-turn measurement")


def decode_cached(model, prompt: list[int], gen: int) -> tuple[float, list[int]]:
  runner = ModelRunner(model, num_slots=1, max_len=len(prompt) + gen, num_top=1)
  greedy = lambda step: sampling_arrays([0.0], [1.0], [0], [0], [step])  # noqa: E731
  runner.decode(np.array([0]), np.array([len(prompt) + gen]), greedy(0))  # compile (out of range: no write)
  out = [int(runner.prefill(0, prompt, 0, greedy(0)).tokens[0])]  # compile + prefill, not timed
  t0 = time.perf_counter()
  for i in range(gen - 1):
    tok = runner.decode(np.array([out[-1]]), np.array([len(prompt) + i]), greedy(i + 1))
    out.append(int(tok.tokens[0]))
  return (gen - 1) / (time.perf_counter() - t0), out


def decode_recompute(model, prompt: list[int], gen: int) -> tuple[float, list[int]]:
  graphdef, state = nnx.split(model)
  T = len(prompt) + gen  # one padded shape: a single compile, as a fair baseline

  @jax.jit
  def next_token(state, ids_1T, n):
    seg_1T = (jnp.arange(T) < n).astype(jnp.int32)[None]
    logits = nnx.merge(graphdef, state)(ids_1T, seg_1T).logits
    return jnp.argmax(logits[0, n - 1])

  ids = np.zeros((1, T), np.int32)
  ids[0, : len(prompt)] = prompt
  n = len(prompt)
  ids[0, n] = int(next_token(state, ids, n))  # compile + first token (not timed, like prefill)
  n += 1
  t0 = time.perf_counter()
  for _ in range(gen - 1):
    ids[0, n] = int(next_token(state, ids, n))
    n += 1
  return (gen - 1) / (time.perf_counter() - t0), ids[0, len(prompt) :].tolist()


def multiturn(model, turn1: int, gen: int) -> dict[str, float]:
  """Second-turn latency (whole turn and first token) with and without the first turn's cache."""
  rng = np.random.RandomState(1)
  eng = InferenceEngine(model, EngineConfig(max_slots=2, max_seq_len=turn1 + 2 * gen + 64, prefix_cache_entries=4))

  def turn2(tag: str, flush: bool, new_tokens: int):
    sampling = SamplingParams(max_new_tokens=gen, temperature=0.0, ignore_eos=True)
    hist = tuple(rng.randint(0, 4000, turn1).tolist())
    first = eng.generate(GenerateRequest(f"{tag}-1", hist, sampling))
    if flush:
      eng.flush_cache()
    prompt = hist + tuple(first.output_ids) + tuple(rng.randint(0, 4000, 32).tolist())
    t0 = time.perf_counter()
    done = eng.generate(
      GenerateRequest(f"{tag}-2", prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    )
    return time.perf_counter() - t0, done.cached_tokens

  turn2("warm-a", False, gen), turn2("warm-b", True, gen)  # compile both prefill buckets and decode
  out = {}
  for name, n in (("turn", gen), ("first_token", 1)):
    reuse = [turn2(f"r{name}{i}", False, n) for i in range(3)]
    noreuse = [turn2(f"n{name}{i}", True, n) for i in range(3)]
    out[f"{name}_reuse_sec"] = float(np.median([r[0] for r in reuse]))
    out[f"{name}_noreuse_sec"] = float(np.median([r[0] for r in noreuse]))
    out["cached_tokens"] = reuse[0][1]
  eng.close()
  return out


def main(argv):
  del argv
  cfg = presets.get("tiny", max_position_embeddings=2048)
  model = K2Model(cfg, rngs=nnx.Rngs(0))
  gen = _GEN.value
  for ctx in (256, 1024):
    prompt = np.random.RandomState(ctx).randint(0, 4000, ctx).tolist()
    cached, out_c = decode_cached(model, prompt, gen)
    recompute, out_r = decode_recompute(model, prompt, gen)
    print(f"decode_ctx{ctx}_cached_tokens_per_sec={cached:.1f}")
    print(f"decode_ctx{ctx}_recompute_tokens_per_sec={recompute:.1f}")
    print(f"decode_ctx{ctx}_speedup={cached / recompute:.2f}")
    print(f"decode_ctx{ctx}_same_tokens={out_c == out_r}")
  m = multiturn(model, _TURN1.value, gen)
  print(f"multiturn_turn2_cached_tokens={m['cached_tokens']}")
  for name in ("turn", "first_token"):
    print(f"multiturn_turn2_{name}_reuse_sec={m[name + '_reuse_sec']:.4f}")
    print(f"multiturn_turn2_{name}_noreuse_sec={m[name + '_noreuse_sec']:.4f}")
    print(f"multiturn_turn2_{name}_prefix_reuse_speedup={m[name + '_noreuse_sec'] / m[name + '_reuse_sec']:.2f}")


if __name__ == "__main__":
  app.run(main)
