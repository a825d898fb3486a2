"""Evaluation overheads: the benchmark runner over the engine it drives, and prompt scoring through the server
over the model's own forward pass.

    python bench/eval.py [--docs=32] [--max_tokens=16] [--score_seqs=32] [--score_len=64] [--reps=5] [--parts=eval,score]

Tiny preset (random weights), exported to an HF dir in a temp dir; every number comes from this process,
each pair of conditions interleaved (A B A B ...) over --reps repetitions. Prints key=value lines, medians
with [min, max] spread:
  eval_samples_per_sec=         `k2jax.eval.run` on a GSM8K-format file of --docs docs (greedy, --max_tokens),
                                through the embedded `InferenceEngine` (a fresh output dir each time)
  generate_samples_per_sec=     the very requests that run sent (recorded once), straight to `engine.generate`
                                from as many threads as the runner's concurrency
  eval_over_generate=           per repetition, eval samples/s over generate samples/s (target >= 0.9)
  score_tokens_per_sec=         --score_seqs prompts of --score_len tokens scored through `/v1/completions`
                                as lm-eval's local-completions sends them (echo, logprobs 1, max_tokens 1,
                                --score_batch prompts a request, --score_concurrent requests in flight)
  forward_tokens_per_sec=       the same tokens through the model's forward (the trainer's: [B, T] logits,
                                log_softmax, each next token's logprob), --score_batch rows a call, compiled
  score_over_forward=           per repetition, score tokens/s over forward tokens/s (target >= 0.5)
  score_max_abs_diff=           the served logprobs against the forward's (the same numbers, not just as fast)
The engine's cache is flushed before every run, so no run reuses another's prefixes.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import statistics
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import requests
from absl import app, flags
from flax import nnx

import k2jax
from k2jax.engine import EngineConfig, InferenceEngine
from k2jax.engine.base import Engine, GenerateRequest, GenerateResult
from k2jax.eval import EvalConfig, Model, TaskSpec, run
from k2jax.model import K2Model, presets
from k2jax.serve import Server
from k2jax.serve.server import eos_ids

_DOCS = flags.DEFINE_integer("docs", 32, "GSM8K-format docs the runner evaluates")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "tokens generated per sample")
_SLOTS = flags.DEFINE_integer("slots", 8, "engine slots (requests decoded together)")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 16, "runner requests in flight (and the baseline's threads)")
_SCORE_SEQS = flags.DEFINE_integer("score_seqs", 32, "prompts scored per measurement")
_SCORE_LEN = flags.DEFINE_integer("score_len", 64, "tokens per scored prompt")
_SCORE_BATCH = flags.DEFINE_integer("score_batch", 8, "prompts per /v1/completions request (lm-eval batch_size)")
_SCORE_CONCURRENT = flags.DEFINE_integer("score_concurrent", 2, "requests in flight (lm-eval num_concurrent)")
_REPS = flags.DEFINE_integer("reps", 5, "interleaved repetitions")
_PARTS = flags.DEFINE_list("parts", ["eval", "score"], "which halves to run (eval, score): e.g. one under a profiler")

QUESTIONS = [
  "Tom has {a} apples and buys {b} more. How many apples does he have?",
  "A box holds {a} pens and {b} are sold. How many pens remain?",
  "What is {a} times {b}?",
  "A train travels {a} miles an hour for {b} hours. How far does it go?",
]


def spread(values: list[float]) -> str:
  return f"{statistics.median(values):.4g} [{min(values):.4g}, {max(values):.4g}]"


class Recorder(Engine):
  """Passes requests to `engine` and keeps each one (the baseline replays exactly what the runner sent)."""

  def __init__(self, engine: Engine):
    self.engine, self.requests, self._lock = engine, [], threading.Lock()

  def generate(self, request: GenerateRequest) -> GenerateResult:
    with self._lock:
      self.requests.append(request)
    return self.engine.generate(request)

  def abort(self, rids):
    return self.engine.abort(rids)

  def update_weights(self, model_path, weight_version):
    return self.engine.update_weights(model_path, weight_version)


def gsm8k_file(path: str, n: int) -> str:
  rng = np.random.RandomState(0)
  with open(path, "w") as f:
    for i in range(n):
      a, b = (int(x) for x in rng.randint(2, 99, 2))
      q = QUESTIONS[i % len(QUESTIONS)].format(a=a, b=b)
      f.write(json.dumps({"question": q, "answer": f"{a} and {b}\n#### {a + b}"}) + "\n")
  return path


def eval_vs_generate(hf_dir: str, tmp: str) -> dict[str, list[float]]:
  from k2jax.data.tokenizer import load_tokenizer

  lm = k2jax.load(hf_dir)
  tok = load_tokenizer(os.path.join(hf_dir, "tiktoken.model"))
  eos = eos_ids(lm.cfg, tok)
  engine = InferenceEngine(
    lm,
    # every prefill bucket compiled up front: no repetition of either condition waits behind a compile
    EngineConfig(max_slots=_SLOTS.value, max_seq_len=256, precompile=True),
    eos_token_ids=eos,
    detokenize=tok.decode,
  )
  task = TaskSpec("gsm", gsm8k_file(os.path.join(tmp, "gsm8k.jsonl"), _DOCS.value), "gsm8k")
  runs = iter(range(10**6))

  def config() -> EvalConfig:
    out = os.path.join(tmp, f"eval_out_{next(runs)}")
    return EvalConfig(
      model=hf_dir, tasks=(task,), out=out, max_tokens=_MAX_TOKENS.value, concurrency=_CONCURRENCY.value, progress=False
    )

  def model(engine: Engine) -> Model:
    return Model(engine, tok, eos, None, hf_dir, 256)

  recorder = Recorder(engine)
  run(config(), model(recorder))  # records the requests; compiles the prefill buckets they use and the decode
  recorded = recorder.requests
  for _ in range(2):  # admissions group differently run to run: these see (and compile) more of the buckets
    run(config(), model(engine))
  assert len(recorded) == _DOCS.value, len(recorded)

  def eval_once() -> float:
    engine.flush_cache()
    t0 = time.perf_counter()
    report = run(config(), model(engine))
    wall = time.perf_counter() - t0
    assert report["tasks"]["gsm"]["num_docs"] == _DOCS.value
    return _DOCS.value / wall

  def generate_once(rep: int) -> float:
    engine.flush_cache()
    reqs = [GenerateRequest(f"{r.rid}/raw{rep}", r.input_ids, r.sampling, r.logprob_start_len) for r in recorded]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(_CONCURRENCY.value) as pool:
      results = list(pool.map(engine.generate, reqs))
    wall = time.perf_counter() - t0
    assert all(r.finish_reason in ("stop", "length") for r in results)
    return len(reqs) / wall

  out = {"eval": [], "generate": [], "ratio": []}
  try:
    for rep in range(_REPS.value):
      e, g = eval_once(), generate_once(rep)
      out["eval"].append(e)
      out["generate"].append(g)
      out["ratio"].append(e / g)
  finally:
    engine.close()
  return out


def score_vs_forward(hf_dir: str) -> dict[str, list[float]]:
  n, T, B = _SCORE_SEQS.value, _SCORE_LEN.value, _SCORE_BATCH.value
  rng = np.random.RandomState(1)
  seqs = rng.randint(0, 3800, (n, T)).astype(np.int32)  # below the special tokens
  lm = k2jax.load(hf_dir)
  graphdef, state = nnx.split(lm)

  @jax.jit
  def token_logprobs(state, ids_BT):
    logits_BTS = nnx.merge(graphdef, state)(ids_BT).logits
    logp_BTS = jax.nn.log_softmax(logits_BTS[:, :-1], axis=-1)
    return jnp.take_along_axis(logp_BTS, ids_BT[:, 1:, None], axis=-1)[..., 0]

  def forward_once() -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    parts = [np.asarray(token_logprobs(state, jnp.asarray(seqs[i : i + B]))) for i in range(0, n, B)]
    return n * T / (time.perf_counter() - t0), np.concatenate(parts)

  server = Server(hf_dir, engine_config=EngineConfig(max_slots=_SLOTS.value, max_seq_len=2 * T), port=0).start()
  session = threading.local()

  def post(batch: np.ndarray) -> list[list[float]]:
    if not hasattr(session, "s"):
      session.s = requests.Session()
    body = {"model": "m", "prompt": batch.tolist(), "max_tokens": 1, "logprobs": 1, "echo": True}
    body |= {"temperature": 0, "seed": 1234}
    r = session.s.post(f"{server.url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["logprobs"]["token_logprobs"][1:T] for c in choices]  # lm-eval's slice: prompt tokens 1..T-1

  def score_once() -> tuple[float, np.ndarray]:
    server.engine.flush_cache()
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(_SCORE_CONCURRENT.value) as pool:
      parts = list(pool.map(post, [seqs[i : i + B] for i in range(0, n, B)]))
    return n * T / (time.perf_counter() - t0), np.asarray([row for part in parts for row in part])

  out = {"score": [], "forward": [], "ratio": [], "diff": []}
  try:
    forward_once()  # compiles
    # The scored prefill compiles one program per (rows, length) bucket: requests of 1..B prompts, one at a
    # time, admit each row count (a run groups its rows by arrival), so no measured run waits on a compile.
    for k in range(1, B + 1):
      post(seqs[:k])
    score_once()
    for _ in range(_REPS.value):
      (s, got), (f, want) = score_once(), forward_once()
      out["score"].append(s)
      out["forward"].append(f)
      out["ratio"].append(s / f)
      out["diff"].append(float(np.abs(got - want).max()))
  finally:
    server.close()
  return out


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    hf_dir = os.path.join(tmp, "tiny_hf")
    k2jax.save_hf(K2Model(presets.get("tiny", max_position_embeddings=256), rngs=nnx.Rngs(0)), hf_dir)
    if "eval" in _PARTS.value:
      ev = eval_vs_generate(hf_dir, tmp)
      print(f"eval_samples_per_sec={spread(ev['eval'])}")
      print(f"generate_samples_per_sec={spread(ev['generate'])}")
      print(f"eval_over_generate={spread(ev['ratio'])}")
    if "score" not in _PARTS.value:
      return
    sc = score_vs_forward(hf_dir)
    print(f"score_tokens_per_sec={spread(sc['score'])}")
    print(f"forward_tokens_per_sec={spread(sc['forward'])}")
    print(f"score_over_forward={spread(sc['ratio'])}")
    print(f"score_max_abs_diff={max(sc['diff']):.2e}")


if __name__ == "__main__":
  app.run(main)
