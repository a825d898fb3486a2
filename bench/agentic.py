"""Multi-turn agentic rollout throughput: episodes/s with 1, 16 and 128 concurrent episodes against the
simulated-tools environment and the embedded engine serving the tiny model, and the share of prefill
tokens saved by prefix reuse across turns.

  python bench/agentic.py [--concurrency=1,16,128] [--turns=3] [--max_new_tokens=16]

Baseline = 1 concurrent episode, measured in the same run: `scaling_N = eps_per_s_N / eps_per_s_1`.
Each episode: a user task with two scripted follow-ups (the random tiny model makes no tool calls, so
the dialogue continues with the follow-ups), `--turns` assistant turns of up to `--max_new_tokens` each.
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from k2jax.agentic.rollout import MultiTurnConfig, MultiTurnRunner  # noqa: E402
from k2jax.data.tokenizer import load_tokenizer  # noqa: E402
from k2jax.model import K2Model, presets  # noqa: E402
from k2jax.engine import EngineConfig, InferenceEngine  # noqa: E402
from k2jax.rl.envs.simulated import SimToolsEnv  # noqa: E402

_CONC = flags.DEFINE_list("concurrency", ["1", "16", "128"], "Concurrent episodes to measure.")
_TURNS = flags.DEFINE_integer("turns", 3, "Assistant turns per episode.")
_NEW = flags.DEFINE_integer("max_new_tokens", 16, "Max new tokens per turn.")
_SLOTS = flags.DEFINE_integer("max_slots", 32, "Engine decode batch (slots).")


class PrefillCounter:
  """Wraps InferenceEngine.generate to sum prompt tokens and the ones served from the prefix cache."""

  def __init__(self, engine):
    self.prompt = self.cached = 0
    self._lock, inner = threading.Lock(), engine.generate

    def counted(request):
      done = inner(request)
      with self._lock:
        self.prompt += done.prompt_tokens
        self.cached += done.cached_tokens
      return done

    engine.generate = counted

  def take(self) -> float:
    with self._lock:
      share = self.cached / max(self.prompt, 1)
      self.prompt = self.cached = 0
    return share


def tasks(n: int, tag: str) -> list[dict]:
  follow = ["Thanks. Anything else I should check?", "Please summarise in one line."][: max(0, _TURNS.value - 1)]
  return [
    {
      "id": f"{tag}{i}",
      "instruction": f"Read notes{i % 7}.txt and tell me what it says.",
      "state": {"files": {f"notes{i % 7}.txt": "Quarterly numbers are up."}},
      "checks": [{"kind": "answer_contains", "text": "quarterly"}],
      "followups": follow,
      "tools": ["read_file", "list_files"],
    }
    for i in range(n)
  ]


def main(argv):
  del argv
  tok = load_tokenizer()
  model = K2Model(presets.get("tiny"), rngs=nnx.Rngs(0))
  engine = InferenceEngine(
    model,
    EngineConfig(
      max_slots=_SLOTS.value, max_seq_len=1024, min_prefill_bucket=32, prefix_cache_entries=4 * _SLOTS.value + 32
    ),
    eos_token_ids=(tok.eos_id, tok.special_ids["<|im_end|>"]),
  )
  counter = PrefillCounter(engine)
  try:
    for conc in [int(c) for c in _CONC.value]:
      cfg = MultiTurnConfig(max_turns=_TURNS.value, max_new_tokens_per_turn=_NEW.value, concurrency=conc, seed=1)
      runner = MultiTurnRunner(engine, tok, SimToolsEnv, cfg)
      runner.run(tasks(min(conc, 8), f"warm{conc}-"), rid_prefix=f"warm{conc}")  # compile buckets first
      engine.flush_cache()
      counter.take()
      n = max(4, conc) if conc > 1 else 4
      t0 = time.perf_counter()
      trajs = runner.run(tasks(n, f"c{conc}-"), rid_prefix=f"run{conc}")
      dt = time.perf_counter() - t0
      turns = sum(len(t.turns) for t in trajs)
      gen = sum(sum(t.loss_mask) for t in trajs)
      eps = n / dt
      if conc == int(_CONC.value[0]):
        base = eps
      print(
        f"concurrency={conc} episodes={n} turns={turns} generated_tokens={gen} seconds={dt:.2f} "
        f"episodes_per_s={eps:.3f} generated_tokens_per_s={gen / dt:.1f} scaling_vs_1={eps / base:.2f} "
        f"prefill_tokens_saved_by_prefix_reuse={counter.take():.3f} "
        f"failed={sum(t.failed for t in trajs)}",
        flush=True,
      )
  finally:
    engine.close()


if __name__ == "__main__":
  app.run(main)
