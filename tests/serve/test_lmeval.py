"""EleutherAI's lm-evaluation-harness (pip `lm-eval` 0.4.x, the test extras) against `launch/serve.py`.

Its `local-completions` model runs offline YAML tasks of each output type (generate_until, multiple_choice,
loglikelihood_rolling) against the server on an exported tiny model, and every per-document
log-likelihood (and greedy flag, and greedy generation) equals what lm-eval's own `hf` model (transformers,
on CPU) computes on the same export. With both of lm-eval's tokenizer backends: `huggingface` (the export's
tokenizer files, batched prompts) and `remote` (the server's /tokenize, /detokenize, /tokenizer_info).
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import yaml
from flax import nnx

import k2jax
from k2jax.model import K2Model, presets
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # a server process, lm-eval's runs and torch's

# lm-eval's API models keep `max_length - 1` tokens for a request (prompt plus the one generated token) and
# roll windows of `max_length - 2` predicted tokens; its hf model rolls `max_length` and scores up to
# `max_length + 1` tokens. These two lengths give both the same windows and the same truncation.
API_MAX_LENGTH = 64
HF_MAX_LENGTH = API_MAX_LENGTH - 2

MC = [
  {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "label": 0},
  {"question": "Two plus two is", "choices": ["three", "four"], "label": 1},
  {"question": "Water freezes at", "choices": ["zero degrees", "fifty degrees", "a hundred degrees"], "label": 0},
  {"question": "The opposite of hot is", "choices": ["cold", "warm"], "label": 0},
]
GEN = [
  {"question": "What is 6 times 7?", "answer": "42"},
  {"question": "Name a primary color.", "answer": "red"},
  {"question": "Spell cat backwards.", "answer": "tac"},
]
LONG = (
  "Evaluation harnesses score a language model by the probability it gives to text. A rolling "
  "log-likelihood cuts a long document into windows that fit the model's context, and sums the "
  "log-probabilities of every token once, each window conditioned on the tokens before it. "
  "Perplexity, bits per byte and word perplexity all follow from that one sum. "
)
ROLL = [
  {"text": LONG * 2},
  {"text": "Hello world, this is a tiny document."},
  {"text": "12345 apples, café <|im_end|>"},
]


def _task(name, data, output_type, cache_dir, **fields):
  return {
    "task": name,
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": data}, "cache_dir": cache_dir},
    "test_split": "test",
    "output_type": output_type,
    **fields,
  }


def _write_tasks(tmp):
  """lm-eval's local-dataset tasks ("Using Local Datasets" in its new_task_guide), one per output type."""
  cache = str(tmp / "hf_datasets")
  tasks = {}
  for name, records, output_type, fields in (
    (
      "k2jax_mc",
      MC,
      "multiple_choice",
      {
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
      },
    ),
    (
      "k2jax_gen",
      GEN,
      "generate_until",
      {
        "doc_to_text": "Q: {{question}}\nA:",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
      },
    ),
    (
      "k2jax_roll",
      ROLL,
      "loglikelihood_rolling",
      {"doc_to_text": "", "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]},
    ),
  ):
    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(_task(name, str(data), output_type, cache, **fields)))
    tasks[name] = output_type
  return tasks


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  hf_dir = str(tmp_path_factory.mktemp("lmeval_tiny_hf"))
  k2jax.save_hf(K2Model(presets.get("tiny", max_position_embeddings=128), rngs=nnx.Rngs(0)), hf_dir)
  return hf_dir


@pytest.fixture(scope="module")
def server_url(export, tmp_path_factory):
  """`launch/serve.py` on the export, as a user starts it (its own process, the export's tokenizer)."""
  port = _free_port()
  log_path = tmp_path_factory.mktemp("serve_log") / "serve.log"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), PYTHONPATH=ROOT)
  cmd = [sys.executable, os.path.join(ROOT, "launch/serve.py"), f"--model={export}", f"--port={port}"]
  cmd += ["--max_running_requests=4", "--max_seq_len=128", "--noprecompile"]
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 600
    while True:
      try:
        urllib.request.urlopen(url + "/health", timeout=120).read()
        break
      except OSError:
        if proc.poll() is not None or time.monotonic() > deadline:
          pytest.fail(f"serve.py did not come up (rc {proc.poll()}):\n{log_path.read_text()[-3000:]}")
        time.sleep(1)
    yield url
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


@pytest.fixture(scope="module")
def lm_eval_offline():
  """lm-eval with the HF hub and datasets offline: nothing may be downloaded (constants read at import are
  patched too, for a session that imported them already)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import huggingface_hub
    import lm_eval
    from lm_eval.tasks import TaskManager

    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    yield lm_eval, TaskManager


@pytest.fixture(scope="module")
def runs(export, server_url, lm_eval_offline, tmp_path_factory):
  """Per-document responses of lm-eval's hf model and of local-completions with each tokenizer backend."""
  lm_eval, TaskManager = lm_eval_offline
  task_dir = tmp_path_factory.mktemp("lmeval_tasks")
  tasks = _write_tasks(task_dir)
  manager = TaskManager(include_path=str(task_dir))

  def evaluate(model, model_args, names):
    out = lm_eval.simple_evaluate(
      model=model, model_args=model_args, tasks=list(names), task_manager=manager, log_samples=True
    )
    samples = {name: sorted(out["samples"][name], key=lambda s: s["doc_id"]) for name in names}
    return {"results": out["results"], "samples": samples}

  base = {"model": "tiny", "base_url": f"{server_url}/v1/completions", "max_length": API_MAX_LENGTH}
  base |= {"max_retries": 1, "timeout": 600}
  # The hf tokenizer backend reads the export's own tokenizer files; batched prompts, two requests at once.
  hf_tok = {**base, "tokenizer_backend": "huggingface", "tokenizer": export, "batch_size": 4, "num_concurrent": 2}
  # The remote backend tokenizes through the server; one prompt per request.
  remote = {**base, "tokenizer_backend": "remote", "batch_size": 1}
  return {
    "tasks": tasks,
    "hf": evaluate(
      "hf", {"pretrained": export, "dtype": "float32", "device": "cpu", "max_length": HF_MAX_LENGTH}, tasks
    ),
    "local_hf_tokenizer": evaluate("local-completions", hf_tok, tasks),
    "local_remote_tokenizer": evaluate("local-completions", remote, ["k2jax_mc", "k2jax_roll"]),
  }


def _loglikelihoods(sample, output_type):
  if output_type == "multiple_choice":
    return [ll for ll, _ in sample["filtered_resps"]]
  (ll,) = sample["filtered_resps"]
  return [ll]


@pytest.mark.parametrize("backend", ["local_hf_tokenizer", "local_remote_tokenizer"])
def test_per_document_loglikelihoods_equal_lm_evals_hf_model(runs, backend):
  got_run, want_run = runs[backend], runs["hf"]
  for name, samples in got_run["samples"].items():
    output_type = runs["tasks"][name]
    if output_type == "generate_until":
      continue
    want = want_run["samples"][name]
    assert [s["doc_id"] for s in samples] == [s["doc_id"] for s in want] == list(range(len(samples)))
    for got_doc, want_doc in zip(samples, want):
      np.testing.assert_allclose(
        _loglikelihoods(got_doc, output_type), _loglikelihoods(want_doc, output_type), atol=1e-4, rtol=0
      )
      if output_type == "multiple_choice":  # the greedy flags too (lm-eval's max over top_logprobs)
        assert [g for _, g in got_doc["filtered_resps"]] == [g for _, g in want_doc["filtered_resps"]]
    # The same documents score the same: acc / acc_norm, or the perplexity built from the summed windows.
    for metric, value in want_run["results"][name].items():
      if isinstance(value, float) and "stderr" not in metric:
        np.testing.assert_allclose(got_run["results"][name][metric], value, rtol=1e-4)


def test_the_runs_cover_every_output_type_and_real_windows(runs, export):
  assert sorted(runs["tasks"].values()) == ["generate_until", "loglikelihood_rolling", "multiple_choice"]
  import transformers

  tok = transformers.AutoTokenizer.from_pretrained(export)
  long_tokens = len(tok(ROLL[0]["text"], add_special_tokens=False).input_ids)
  assert long_tokens > 2 * (API_MAX_LENGTH - 2)  # the long document rolls over three windows or more
  roll = runs["local_hf_tokenizer"]["samples"]["k2jax_roll"]
  assert all(np.isfinite(s["filtered_resps"][0]) and s["filtered_resps"][0] < 0 for s in roll)
  mc = runs["local_hf_tokenizer"]["samples"]["k2jax_mc"]
  assert [len(s["filtered_resps"]) for s in mc] == [len(r["choices"]) for r in MC]


def test_generate_until_through_the_server_equals_hf_greedy(runs):
  got = runs["local_hf_tokenizer"]["samples"]["k2jax_gen"]
  want = runs["hf"]["samples"]["k2jax_gen"]
  assert len(got) == len(GEN)
  # Greedy on both sides: the same text (the tiny random model's top-2 gaps dwarf float noise), and the
  # task's `until` cut it as lm-eval cuts the hf model's.
  assert [s["filtered_resps"] for s in got] == [s["filtered_resps"] for s in want]
  assert all(isinstance(s["filtered_resps"][0], str) and "\n\n" not in s["filtered_resps"][0] for s in got)
  assert (
    runs["local_hf_tokenizer"]["results"]["k2jax_gen"]["exact_match,none"]
    == (runs["hf"]["results"]["k2jax_gen"]["exact_match,none"])
  )
