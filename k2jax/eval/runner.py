"""`run(config)`: benchmarks on a checkpoint through any engine, resumable, with a JSON report and a markdown table.

Phases: read every task file (a bad record fails the run before any work), open the model (an embedded
`InferenceEngine` on a workdir or HF dir, or an SGLang-compatible server at a URL, whose /health must
answer), open the output dir's samples file (`store.py`), then per task: render each doc's prompt (few-shot
examples first; plain text, or the K2 chat template), send the samples the file lacks to the engine from
`concurrency` threads (the engine batches what is in flight), grade each as it returns and append it; score
multiple-choice docs by log-likelihood (`scoring.py`); run each sample of a swe task as one agentic episode
graded by the repository's tests (`swe.py`); last, the report from the samples file.

Sample i of a doc is sampled with seed hash(seed, task, doc, i), so a resumed run draws what the first
would have, on an engine with seeded sampling.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import hashlib
import json
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any

from k2jax.agentic.envs.swe import SweEnvConfig
from k2jax.data.chat import render_chat
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, Tokenizer, load_tokenizer
from k2jax.engine.base import Engine, GenerateRequest, SamplingParams
from k2jax.eval import report as report_lib
from k2jax.eval import swe as swe_lib
from k2jax.eval.grading import grade
from k2jax.eval.metrics import choice_metrics
from k2jax.eval.samples import PromptTooLong, check_lengths, redo, regrade, verdict_fields  # noqa: F401  (re-exported)
from k2jax.eval.scoring import ForwardScorer, HttpScorer, Scorer
from k2jax.eval.store import ContentHasher, SampleStore, write_atomic
from k2jax.eval.tasks import (
  Doc,
  TaskFormat,
  few_shot_messages,
  few_shot_prefix,
  get_format,
  load_docs,
  read_docs,
)
from k2jax.sandbox.code import CodeRewardConfig
from k2jax.transport import RetryPolicy, ServiceError, call_json

REPORT_JSON, REPORT_MD = "report.json", "report.md"


class EngineFailed(RuntimeError):
  """The engine could not be reached or failed mid-run; the message names it (the URL or the model dir)."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  name: str
  path: str
  format: str
  fewshot_file: str | None = None  # few-shot examples: the first num_fewshot records of this file
  num_fewshot: int | None = None  # None: EvalConfig.num_fewshot
  # This task's own sampling (None: EvalConfig's), as lm-evaluation-harness's per-task generation_kwargs and an
  # RL `eval.tasks.<name>` section: one run can score a task greedily and another (or the same file) sampled.
  n: int | None = None
  ks: tuple[int, ...] | None = None
  temperature: float | None = None
  top_p: float | None = None
  max_tokens: int | None = None

  def run_config(self, config: EvalConfig) -> EvalConfig:
    """`config` with this task's sampling in place of the run's (validated the same way, naming the task)."""
    own = {k: getattr(self, k) for k in _TASK_SAMPLING if getattr(self, k) is not None}
    if "ks" in own:
      own["ks"] = tuple(own["ks"])
    try:
      tc = dataclasses.replace(config, **own) if own else config
    except (TypeError, ValueError) as e:
      raise ValueError(f"task {self.name!r}: {e}") from None
    too_big = [k for k in tc.ks if k > tc.n]
    if too_big and get_format(self.format).kind != "choice":  # multiple choice has no k (one score per doc)
      raise ValueError(
        f"task {self.name!r}: k={too_big[0]} (ks={list(tc.ks)}) is above its n={tc.n} samples per problem: "
        f"pass@{too_big[0]} and maj@{too_big[0]} need n >= k (raise n or drop the k)"
      )
    return tc


_TASK_SAMPLING = ("n", "ks", "temperature", "top_p", "max_tokens")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  model: str  # k2jax workdir | HF dir | http(s):// URL of an SGLang-compatible server
  tasks: tuple[TaskSpec, ...]
  out: str  # output dir: samples.jsonl (resumed), report.json, report.md
  n: int = 1  # samples per doc
  ks: tuple[int, ...] = (1,)  # pass@k and maj@k for each k <= n; mean@n always
  temperature: float = 0.0
  top_p: float = 1.0
  max_tokens: int = 512
  seed: int = 0
  num_fewshot: int = 0
  limit: int | None = None  # first docs of each task
  chat: bool = False  # K2 chat template (few-shot examples as turns) instead of plain text
  system: str | None = None  # chat: a system message first
  concurrency: int = 16  # requests in flight
  tokenizer: str = "auto"  # tiktoken file or model dir; auto: the model dir's (a URL: the server's tokenizer_path), or the bundled BPE if it fits
  max_slots: int = 8  # embedded engine: requests decoded together
  max_seq_len: int = 2048  # embedded engine: prompt + generated tokens
  api_key: str | None = None  # URL: Bearer token
  progress: bool = True
  code: CodeRewardConfig = CodeRewardConfig()  # sandbox limits of code graders
  max_turns: int = 30  # swe: assistant turns per episode (a task record's own max_turns wins, as in RL)
  max_episode_tokens: int = 32768  # swe: prompt + every turn (capped by an embedded engine's max_seq_len)
  swe: SweEnvConfig = SweEnvConfig()  # swe: the environment's tool, time and grading limits

  def __post_init__(self):
    if not self.tasks:
      raise ValueError("EvalConfig.tasks: no tasks given")
    if len({t.name for t in self.tasks}) != len(self.tasks):
      raise ValueError(f"EvalConfig.tasks: task names repeat: {[t.name for t in self.tasks]}")
    if self.n < 1 or not self.ks or any(k < 1 for k in self.ks):
      raise ValueError(f"EvalConfig: n={self.n} and ks={self.ks} must be >= 1")
    if self.temperature == 0 and self.n > 1:
      raise ValueError(f"EvalConfig: n={self.n} greedy samples would all be the same: set a temperature > 0")
    if self.concurrency < 1 or self.max_tokens < 1:
      raise ValueError(f"EvalConfig: concurrency={self.concurrency} and max_tokens={self.max_tokens} must be >= 1")
    if self.max_turns < 1 or self.max_episode_tokens < 2:
      raise ValueError(f"EvalConfig: max_turns={self.max_turns} must be >= 1, max_episode_tokens >= 2")


@dataclasses.dataclass
class Model:
  """What a run talks to: an engine, its tokenizer, stop tokens, a scorer for likelihoods, and its name."""

  engine: Engine
  tokenizer: Tokenizer
  stop_token_ids: tuple[int, ...]
  scorer: Scorer | None
  where: str  # the URL or model dir, for error messages
  max_seq_len: int | None = None  # clamp max_new_tokens to fit (embedded engines)
  identity: dict | None = None  # a server's own account of its model (/get_model_info), for the fingerprint


def run(config: EvalConfig, model: Model | None = None) -> dict[str, Any]:
  """Runs every task of `config` (resuming from `config.out`'s samples) and returns the report it wrote.

  `model`: an already open engine (tests, RL); default: opened from `config.model` and closed at the end."""
  for spec in config.tasks:  # a task's bad sampling (a k above its n) fails before the model is opened
    spec.run_config(config)
  tasks = [(spec, get_format(spec.format), *_task_docs(spec, config)) for spec in config.tasks]
  hasher = ContentHasher(config.out)
  local = _is_local(config.model)
  model_id = _model_fingerprint(config.model, None, hasher) if local else None  # what is about to be loaded
  own = model is None
  model = model or open_model(config)
  try:
    model_id = model_id or _model_fingerprint(config.model, model, hasher)
    data = {spec.name: _data_fingerprint(spec, hasher) for spec, *_ in tasks}
    hasher.save()
    sections = _run_tasks(config, model, tasks, model_id, data)
  finally:
    if own:
      model.engine.close()
  report = {"config": _config_json(config), "model": model_id, "finished_at": time.time(), "tasks": sections}
  write_atomic(os.path.join(config.out, REPORT_JSON), json.dumps(report, indent=1, ensure_ascii=False))
  write_atomic(os.path.join(config.out, REPORT_MD), report_lib.markdown(report))
  return report


def check_tasks(config: EvalConfig) -> None:
  """Reads every task's file and few-shot file, as `run` does first: a bad record raises now (RL checks its
  eval tasks at start, not at the first evaluation)."""
  for spec in config.tasks:
    get_format(spec.format)
    spec.run_config(config)
    _docs(spec, config)


def _run_tasks(config: EvalConfig, model: Model, tasks, model_id: dict, data: dict) -> dict[str, Any]:
  """Makes what the samples file lacks, task by task, and returns each task's report section."""
  store = SampleStore(config.out)
  try:
    sections = {}
    for spec, fmt, docs, shots, skipped in tasks:
      tc = spec.run_config(config)
      fingerprint = _fingerprint(tc, spec, fmt, model_id["fingerprint"], data[spec.name]["fingerprint"])
      if fmt.kind == "choice":
        _score_choices(tc, model, store, spec, fmt, docs, shots, fingerprint)
      else:
        _generate(tc, model, store, spec, fmt, docs, shots, fingerprint)
      n = 1 if fmt.kind == "choice" else tc.n
      records = [(d.doc_id, [store.get((spec.name, d.doc_id, i), fingerprint) for i in range(n)]) for d in docs]
      section = report_lib.task_report(spec.name, fmt, spec.path, records, tc.ks, skipped)
      sections[spec.name] = {**section, "fingerprint": fingerprint, "data": data[spec.name]}
    store.sync()
    return sections
  finally:
    store.close()


def open_model(config: EvalConfig) -> Model:
  """An HTTP engine for a URL (after /health answers), else the embedded engine on the model dir."""
  if config.model.startswith(("http://", "https://")):
    return _open_url(config)
  from k2jax.engine.inference import EngineConfig, InferenceEngine
  from k2jax.engine.placement import Placement, load_model
  from k2jax.serve.server import eos_ids, resolve_tokenizer

  lm = load_model(config.model, Placement())
  tok = resolve_tokenizer(config.model, config.tokenizer, lm.cfg.vocab_size)
  if tok is None:
    raise ValueError(f"{config.model}: no tokenizer fits vocab {lm.cfg.vocab_size}: pass --tokenizer")
  eos = eos_ids(lm.cfg, tok)
  engine_config = EngineConfig(max_slots=config.max_slots, max_seq_len=config.max_seq_len)
  engine = InferenceEngine(lm, engine_config, eos_token_ids=eos, detokenize=tok.decode)
  return Model(engine, tok, eos, ForwardScorer(lm), config.model, engine.config.max_seq_len)


def _open_url(config: EvalConfig) -> Model:
  from k2jax.engine.http import HttpEngine, HttpEngineConfig

  url = config.model.rstrip("/")
  headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
  try:
    call_json(f"{url}/health", None, timeout_s=10.0, retry=RetryPolicy(1, 0.2), headers=headers, parse_json=False)
  except ServiceError as e:
    raise EngineFailed(f"engine at {url} is unreachable: {e}") from None
  info, info_error = None, None
  try:
    info = call_json(f"{url}/get_model_info", None, timeout_s=10.0, retry=RetryPolicy(1, 0.2), headers=headers)
  except ServiceError as e:
    info_error = e  # a server without the route: its identity is its URL alone (the tokenizer must be given)
  path = {"auto": None, "bundled": BUNDLED_TOKENIZER}.get(config.tokenizer, config.tokenizer)
  path = path or _served_tokenizer(url, info, info_error)
  tok = load_tokenizer(os.path.join(path, "tiktoken.model") if os.path.isdir(path) else path)
  engine = HttpEngine(HttpEngineConfig(url=url, api_key=config.api_key))
  stops = (tok.eos_id, tok.special_ids["<|im_end|>"])
  identity = {k: info.get(k) for k in _SERVER_IDENTITY} if isinstance(info, dict) else None
  return Model(engine, tok, stops, HttpScorer(url, headers), url, _served_length(info), identity)


def _served_length(info: Any) -> int | None:
  """The tokens of prompt and answer the server takes (launch/serve.py's /get_model_info `max_seq_len`, or a
  `context_length`); None when it does not say (its refusal then names the doc, in EngineFailed)."""
  if not isinstance(info, dict):
    return None
  for key in ("max_seq_len", "context_length", "max_model_len"):
    value = info.get(key)
    if type(value) is int and value > 0:
      return value
  return None


# What /get_model_info says of the model a server holds (SGLang and launch/serve.py): the weights it loaded
# and their version (a weight update bumps it), its architecture. The server reports no content hash.
_SERVER_IDENTITY = ("model_path", "weight_version", "model_type", "architectures", "served_model_name")


def _served_tokenizer(url: str, info: Any, error: ServiceError | None) -> str:
  """`--tokenizer=auto` for a URL: the tokenizer the server says it loaded (`/get_model_info`'s
  `tokenizer_path`, as SGLang and launch/serve.py answer), when that path is readable here (the same
  machine, or a disk both see). `info`: the route's answer, or None with the `error` it gave."""
  hint = "pass --tokenizer (its tiktoken file or model dir, or 'bundled')"
  if error is not None:
    raise ValueError(f"{url}: --tokenizer=auto asks /get_model_info for the server's tokenizer: {error}; {hint}")
  path = info.get("tokenizer_path") if isinstance(info, dict) else None
  if not isinstance(path, str) or not path:
    raise ValueError(f"{url}: /get_model_info names no tokenizer_path (got {str(info)[:200]}); {hint}")
  if not os.path.exists(path):
    raise ValueError(f"{url}: the server's tokenizer_path {path!r} is not readable on this machine; {hint}")
  return path


# ---- generation tasks ------------------------------------------------------------------------------
def _generate(config, model: Model, store, spec, fmt: TaskFormat, docs, shots, fingerprint) -> None:
  stored = {(d.doc_id, i): store.get((spec.name, d.doc_id, i), fingerprint) for d in docs for i in range(config.n)}
  # A sample whose grading timed out is no final verdict: an episode runs again, a text is graded again.
  again = {k for k, rec in stored.items() if rec is not None and rec.get("timed_out") and fmt.kind != "agentic"}
  todo = [(d, i) for d in docs for i in range(config.n) if (d.doc_id, i) not in again and redo(stored[d.doc_id, i])]
  todo += [(d, i) for d in docs for i in range(config.n) if (d.doc_id, i) in again]
  if not todo:
    return
  if fmt.kind == "agentic":
    make = functools.partial(_episode, config, model, spec, fingerprint)
  else:
    fresh = {d.doc_id: d for d, i in todo if (d.doc_id, i) not in again}
    prompts = {doc_id: _prompt_ids(config, model.tokenizer, fmt, d, shots) for doc_id, d in fresh.items()}
    check_lengths(spec, prompts, fresh, model.max_seq_len, model.where)
    nonce = secrets.token_hex(4)  # rids unique across runs sharing a server

    def make(d, i):
      if (d.doc_id, i) in again:
        return regrade(spec.name, fmt, d, stored[d.doc_id, i], config.code)
      return _sample(config, model, spec, fmt, d, i, prompts[d.doc_id], fingerprint, nonce)

  infra = []  # swe samples whose grading could not happen: never stored as a score
  with _Progress(config, f"{spec.name} ({len(todo)} samples)", len(todo)) as advance:
    with cf.ThreadPoolExecutor(config.concurrency, thread_name_prefix="k2jax-eval") as pool:
      futures = [pool.submit(make, d, i) for d, i in todo]
      # A failed sample cancels the ones not yet started, but the ones already running still finish and are
      # stored before the error is raised: a dying engine's last answers are not lost (the first to fail
      # can come back before samples started earlier, which as_completed yields later).
      error = None
      try:
        for fut in cf.as_completed(futures):
          if fut.cancelled():
            continue
          try:
            rec = fut.result()
          except Exception as e:
            if error is None:
              error = e
              for f in futures:
                f.cancel()
            continue
          if rec.get("infra_failure"):
            infra.append(rec)
          else:
            store.add(rec)
          advance()
      except BaseException:
        for f in futures:
          f.cancel()
        raise
      if error is not None:
        raise error
  if infra:
    raise swe_lib.InfraFailure(spec.name, sorted(infra, key=lambda r: (r["doc_id"], r["sample"])))


def _episode(config, model: Model, spec, fingerprint, doc: Doc, i: int) -> dict:
  """Sample i of a swe doc: one episode through the tool loop (k2jax.eval.swe), graded by its tests."""
  total = config.max_episode_tokens if model.max_seq_len is None else min(config.max_episode_tokens, model.max_seq_len)
  settings = swe_lib.EpisodeSettings(
    config.max_turns, config.max_tokens, total, config.temperature, config.top_p, config.swe
  )
  seed = _seed(config.seed, spec.name, doc.doc_id, i)
  # TokenAgent seeds each turn from the rid: the same rid on a resume (the same output dir) draws the same
  # samples; another output dir gives other rids, so runs sharing a server do not collide.
  where = hashlib.sha256(os.path.abspath(config.out).encode()).hexdigest()[:8]
  rid = f"eval/{where}/{spec.name}/{doc.doc_id}/{i}"
  try:
    rec = swe_lib.sample(model.engine, model.tokenizer, doc, i, rid, seed, settings)
  except swe_lib.EngineStopped as e:
    raise EngineFailed(f"engine at {model.where} failed on {spec.name} doc {doc.doc_id} sample {i}: {e}") from None
  except ValueError as e:
    raise ValueError(f"{spec.name}: {e}") from None
  return {"task": spec.name, "doc_id": doc.doc_id, "sample": i, "fingerprint": fingerprint, **rec}


def _sample(config, model: Model, spec, fmt: TaskFormat, doc: Doc, i: int, ids, fingerprint, nonce) -> dict:
  max_new = config.max_tokens
  if model.max_seq_len is not None:
    max_new = min(max_new, model.max_seq_len - len(ids))
  stops = () if config.chat else fmt.stop
  seed = _seed(config.seed, spec.name, doc.doc_id, i)
  sampling = SamplingParams(
    max_new_tokens=max_new,
    temperature=config.temperature,
    top_p=config.top_p,
    stop=stops,
    stop_token_ids=model.stop_token_ids,
    seed=seed,
  )
  request = GenerateRequest(f"eval/{nonce}/{spec.name}/{doc.doc_id}/{i}", tuple(ids), sampling)
  try:
    res = model.engine.generate(request)
  except Exception as e:
    raise EngineFailed(f"engine at {model.where} failed on {spec.name} doc {doc.doc_id} sample {i}: {e}") from e
  if res.finish_reason == "abort":
    raise EngineFailed(f"engine at {model.where} aborted {spec.name} doc {doc.doc_id}: {res.abort_message}")
  text = _cut(model.tokenizer.decode([t for t in res.output_ids if t not in model.stop_token_ids]), stops)
  verdict = grade(fmt.name, spec.name, doc, text, res.finish_reason, config.code)
  return {
    "task": spec.name,
    "doc_id": doc.doc_id,
    "sample": i,
    "fingerprint": fingerprint,
    "seed": seed,
    "prompt_tokens": len(ids),
    "completion_tokens": len(res.output_ids),
    "finish_reason": res.finish_reason,
    "text": text,
    **verdict_fields(verdict),
  }


# ---- multiple choice --------------------------------------------------------------------------------
def _score_choices(config, model: Model, store, spec, fmt: TaskFormat, docs, shots, fingerprint) -> None:
  if model.scorer is None:
    raise ValueError(f"task {spec.name}: multiple choice needs a scorer (log-likelihoods), which {model.where} lacks")
  todo = [d for d in docs if store.get((spec.name, d.doc_id, 0), fingerprint) is None]
  chunk = 8  # docs per scorer call (all their choices batched)
  with _Progress(config, f"{spec.name} ({len(todo)} docs)", len(todo)) as advance:
    for start in range(0, len(todo), chunk):
      part = todo[start : start + chunk]
      pairs = [_choice_pair(config, model.tokenizer, fmt, d, c, shots) for d in part for c in d.choices]
      try:
        lls = model.scorer.score_many(pairs)
      except (ServiceError, OSError) as e:
        raise EngineFailed(f"engine at {model.where} failed scoring {spec.name}: {e}") from e
      for d in part:
        ll, lls = lls[: len(d.choices)], lls[len(d.choices) :]
        rec = {"task": spec.name, "doc_id": d.doc_id, "sample": 0, "fingerprint": fingerprint}
        rec.update(loglikelihoods=ll, gold=d.gold, **choice_metrics(ll, d.choices, d.gold))
        store.add(rec)
        advance()


def _choice_pair(config, tok: Tokenizer, fmt: TaskFormat, doc: Doc, choice: str, shots) -> tuple[list, list]:
  """(context ids, continuation ids). Plain text is encoded whole and split where the context's own tokens end
  (lm-eval: a merge across the boundary would otherwise change the continuation's tokens)."""
  if config.chat:
    return _prompt_ids(config, tok, fmt, doc, shots), tok.encode(choice.strip())
  context = few_shot_prefix(shots, fmt.separator) + doc.prompt
  whole, ctx = tok.encode(context + choice), tok.encode(context)
  if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
    return ctx, whole[len(ctx) :]
  return ctx, tok.encode(choice)


# ---- prompts, seeds, helpers ------------------------------------------------------------------------
def _docs(spec: TaskSpec, config: EvalConfig) -> tuple[list[Doc], list[Doc]]:
  """The task's docs and its few-shot examples (read now: a bad file fails the run before any work)."""
  docs, shots, _ = _task_docs(spec, config)
  return docs, shots


def _task_docs(spec: TaskSpec, config: EvalConfig) -> tuple[list[Doc], list[Doc], dict[str, int]]:
  """`_docs` and the records the task's format left out ({why: count})."""
  k = config.num_fewshot if spec.num_fewshot is None else spec.num_fewshot
  docs, skipped = read_docs(spec.path, spec.format, config.limit)
  if k == 0 or get_format(spec.format).kind == "agentic":  # an episode's prompt is the environment's
    return docs, [], skipped
  if not spec.fewshot_file:
    raise ValueError(f"task {spec.name}: {k}-shot needs a fewshot_file (examples never taken from the test set)")
  shots = load_docs(spec.fewshot_file, spec.format, k)
  if len(shots) < k:
    raise ValueError(f"task {spec.name}: {spec.fewshot_file} has {len(shots)} records, fewer than {k} shots")
  return docs, shots, skipped


def _prompt_ids(config: EvalConfig, tok: Tokenizer, fmt: TaskFormat, doc: Doc, shots: Sequence[Doc]) -> list[int]:
  if not config.chat:
    return tok.encode(few_shot_prefix(shots, fmt.separator) + doc.prompt)
  messages = ([{"role": "system", "content": config.system}] if config.system else []) + few_shot_messages(shots)
  ids, _ = render_chat(messages + [{"role": "user", "content": doc.prompt}], tokenizer=tok, add_generation_prompt=True)
  return ids


def _cut(text: str, stops: Sequence[str]) -> str:
  """The text before the first stop string (engines that ignore stop strings generate past them)."""
  cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
  return text[:cut]


def _seed(seed: int, task: str, doc_id: str, i: int) -> int:
  return int.from_bytes(hashlib.sha256(f"{seed}/{task}/{doc_id}/{i}".encode()).digest()[:4], "little") >> 1


def _fingerprint(config: EvalConfig, spec: TaskSpec, fmt: TaskFormat, model_fp: str, data_fp: str) -> dict:
  """What makes a stored sample valid for this run, in the parts `store.get` names when one changed: the
  model's content, the data files' content, the grader's and format's version, and the prompt and
  (generation) sampling settings. n and limit are left out, so raising either reuses the samples made."""
  keys = {
    "format": fmt.name,
    "num_fewshot": config.num_fewshot if spec.num_fewshot is None else spec.num_fewshot,
    "chat": config.chat,
    "system": config.system,
  }
  if fmt.kind in ("generate", "agentic"):
    keys.update(temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens, seed=config.seed)
  if fmt.kind == "agentic":  # what bounds an episode (a record's own max_turns is in the file)
    keys.update(max_turns=config.max_turns, max_episode_tokens=config.max_episode_tokens)
  return {
    "model": model_fp[:16],
    "data": data_fp[:16],
    "grader": f"{fmt.name}/{fmt.version}" + ("" if fmt.reader == "1" else f"/reader{fmt.reader}"),
    "settings": hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16],
  }


def _is_local(model: str) -> bool:
  return not model.startswith(("http://", "https://")) and os.path.isdir(model)


def _model_fingerprint(name: str, model: Model | None, hasher: ContentHasher) -> dict:
  """The model's identity for the fingerprint and the report: for a k2jax workdir the content of its
  model_config.json and its latest checkpoint's model item (not the optimizer state, the logs or older
  steps), for an HF dir (or any other dir) every file but hidden ones; for a URL the server's /get_model_info
  account with the URL; else (an engine handed to `run`) its label."""
  if _is_local(name):
    root = os.path.abspath(name)
    rels = _model_files(root)
    digest, total = hasher.tree(root, rels)
    return {"name": name, "fingerprint": digest, "source": f"content of {len(rels)} files, {total} bytes"}
  if name.startswith(("http://", "https://")):
    identity = {"url": name.rstrip("/"), "server": model.identity if model is not None else None}
    source = "the server's /get_model_info (model_path, weight_version, ...) and its URL"
  else:
    identity, source = {"label": name}, "the label of the engine handed to the run"
  digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
  return {"name": name, "fingerprint": digest, "source": source, **identity}


def _model_files(root: str) -> list[str]:
  """The files `open_model` reads of `root`, relative to it."""
  from k2jax.convert.workdir import CHECKPOINTS, MODEL_CONFIG

  if os.path.isfile(os.path.join(root, MODEL_CONFIG)):  # a workdir: orbax names a finished step by its number
    ckpts = os.path.join(root, CHECKPOINTS)
    steps = [int(d) for d in (os.listdir(ckpts) if os.path.isdir(ckpts) else ()) if d.isdigit()]
    if not steps:
      raise FileNotFoundError(f"{ckpts}: no checkpoint found")
    item = os.path.join(CHECKPOINTS, str(max(steps)), "model")
    return [MODEL_CONFIG, *_walk(root, item)]
  return _walk(root, "")


def _walk(root: str, sub: str) -> list[str]:
  out = []
  for d, dirs, files in os.walk(os.path.join(root, sub)):
    dirs[:] = sorted(x for x in dirs if not x.startswith("."))  # .cache/ of a hub download, export markers
    out += [os.path.relpath(os.path.join(d, f), root) for f in sorted(files) if not f.startswith(".")]
  return out


def _data_fingerprint(spec: TaskSpec, hasher: ContentHasher) -> dict:
  """sha256 of the task file's bytes (and of its few-shot file's): an edited file never reuses samples."""
  paths = [spec.path] + ([spec.fewshot_file] if spec.fewshot_file else [])
  digests = hasher.files(paths)
  out = {"path": os.path.abspath(spec.path), "sha256": digests[0]}
  if spec.fewshot_file:
    out.update(fewshot_file=os.path.abspath(spec.fewshot_file), fewshot_sha256=digests[1])
  return {**out, "fingerprint": hashlib.sha256("/".join(digests).encode()).hexdigest()}


def _config_json(config: EvalConfig) -> dict:
  out = dataclasses.asdict(config)
  out.pop("api_key")  # a secret
  return out


class _Progress:
  """A rich progress bar for one task (a no-op with progress off); yields the callback that advances it."""

  def __init__(self, config: EvalConfig, label: str, total: int):
    self.on, self.label, self.total = config.progress and total > 0, label, total

  def __enter__(self):
    if not self.on:
      return lambda: None
    from rich.progress import Progress

    self._bar = Progress(transient=False)
    self._bar.start()
    task = self._bar.add_task(self.label, total=self.total)
    return lambda: self._bar.advance(task)

  def __exit__(self, *exc):
    if self.on:
      self._bar.stop()
