"""Shared pieces of the eval tests: task files in each published format, and a scripted engine whose answers
the tests choose (so every metric can be checked against a hand count)."""

import json
import threading

import pytest
from flax import nnx

import k2jax

from k2jax.data.tokenizer import load_tokenizer
from k2jax.engine.base import Engine, GenerateRequest, GenerateResult
from k2jax.eval import Model, Scorer
from k2jax.model import K2Model, presets

GSM8K = [
  {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
  {"question": "A box holds 1,200 pens; 200 are sold. How many remain?", "answer": "1200 - 200 = 1000\n#### 1,000"},
  {"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"},
]
MATH = [
  {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "solution": "It is $\\boxed{\\frac{3}{4}}$.", "level": "1"},
  {"problem": "What is $2^5$?", "answer": "32", "unique_id": "test/algebra/1.json"},
]
HUMANEVAL = [
  {
    "task_id": "HumanEval/0",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
  }
]
MBPP = [
  {
    "task_id": 11,
    "text": "Write a function to square a number.",
    "code": "def square(x):\n    return x * x",
    "test_list": ["assert square(3) == 9", "assert square(-2) == 4"],
    "test_setup_code": "",
    "challenge_test_list": [],
  }
]
MC = [
  {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
  {"question": "Two plus two is", "choices": ["three", "four"], "answer": "B"},
]


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
  """The tiny model exported to an HF dir (shared: the export and its first compiles are the cost)."""
  hf_dir = str(tmp_path_factory.mktemp("tiny_hf"))
  k2jax.save_hf(K2Model(presets.get("tiny", max_position_embeddings=128), rngs=nnx.Rngs(0)), hf_dir)
  return hf_dir


@pytest.fixture
def tok():
  return load_tokenizer()


class ScriptedEngine(Engine):
  """Answers `respond(prompt text, seed)`; counts calls; raises after `fail_after` calls (a dying engine)."""

  def __init__(self, tok, respond, fail_after=None):
    self.tok, self.respond, self.fail_after = tok, respond, fail_after
    self.calls, self._lock = [], threading.Lock()

  def generate(self, request: GenerateRequest) -> GenerateResult:
    with self._lock:
      if self.fail_after is not None and len(self.calls) >= self.fail_after:
        raise ConnectionError("engine died")
      self.calls.append(request)
    ids = tuple(self.tok.encode(self.respond(self.tok.decode(list(request.input_ids)), request.sampling.seed)))
    ids = ids[: request.sampling.max_new_tokens - 1] + (self.tok.eos_id,)
    return GenerateResult(request.rid, ids, (0.0,) * len(ids), (0,) * len(ids), "stop", len(request.input_ids))

  def abort(self, rids):
    pass

  def update_weights(self, model_path, weight_version):
    raise NotImplementedError


class TextScorer(Scorer):
  """Log-likelihood = a table lookup on the continuation's text (what the tests want each choice to score)."""

  def __init__(self, tok, table):
    self.tok, self.table, self.pairs = tok, table, []

  def score_many(self, pairs):
    self.pairs += pairs
    return [self.table[self.tok.decode(list(cont)).strip()] for _, cont in pairs]


def scripted_model(tok, respond, fail_after=None, scorer=None):
  engine = ScriptedEngine(tok, respond, fail_after)
  return Model(engine, tok, (tok.eos_id, tok.special_ids["<|im_end|>"]), scorer, "scripted"), engine
