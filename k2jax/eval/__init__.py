"""Benchmarks on any checkpoint through any engine: task formats read from local files, graders over the RL
rewards, pass@k / mean@k / maj@k and acc / acc_norm, a resumable runner with a JSON and markdown report.

`launch/eval.py` is the command line; `run(EvalConfig(...))` the library entry point.
"""

from k2jax.eval.metrics import choice_metrics, maj_at_k, mean_at_k, pass_at_k
from k2jax.eval.runner import EngineFailed, EvalConfig, Model, TaskSpec, open_model, run
from k2jax.eval.samples import PromptTooLong
from k2jax.eval.scoring import EngineScorer, ForwardScorer, HttpScorer, Scorer
from k2jax.eval.swe import InfraFailure
from k2jax.eval.tasks import FORMATS, Doc, TaskFormatError, load_docs

__all__ = [
  "FORMATS",
  "Doc",
  "InfraFailure",
  "EngineFailed",
  "EngineScorer",
  "EvalConfig",
  "ForwardScorer",
  "HttpScorer",
  "Model",
  "PromptTooLong",
  "Scorer",
  "TaskFormatError",
  "TaskSpec",
  "choice_metrics",
  "load_docs",
  "maj_at_k",
  "mean_at_k",
  "open_model",
  "pass_at_k",
  "run",
]
