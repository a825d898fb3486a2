"""Benchmarks on a checkpoint through any engine: `python launch/eval.py --model=M --tasks=T --out=DIR`.

  python launch/eval.py --model=/tmp/run --tasks=gsm8k:/data/gsm8k_test.jsonl --out=/tmp/ev \
      --num_fewshot=8 --fewshot_file=gsm8k=/data/gsm8k_train.jsonl
  python launch/eval.py --model=http://127.0.0.1:30000 --tokenizer=/models/k2 --chat \
      --tasks=aime=answer.math:/data/aime.jsonl,he=humaneval:HumanEval.jsonl.gz --n=8 --k=1,4,8 --temperature=0.6
  python launch/eval.py --model=/models/k2 --tasks_file=tasks.json --out=/tmp/ev
  python launch/eval.py --model=http://127.0.0.1:30000 --tasks=swe:/data/swe_tasks/rl_tasks.jsonl --out=/tmp/ev_swe \
      --max_tokens=1024 --max_turns=30

--model: a k2jax workdir or HF dir (the embedded engine; multiple choice scored by its forward pass) or the
URL of an SGLang-compatible server (SGLang, sglang-jax, launch/serve.py; --tokenizer=auto reads the server's
/get_model_info tokenizer_path, which must be readable here; else pass --tokenizer).
--tasks: comma-separated `[NAME=]FORMAT:PATH` (NAME defaults to FORMAT); formats: gsm8k, math, humaneval,
mbpp, mc, answer.{exact,math,code,instruction}, swe (k2jax/eval/tasks.py lists their fields). --tasks_file: a
JSON list of {"name", "format", "path", "fewshot_file"?, "num_fewshot"?} instead.
swe: the rl_tasks.jsonl that launch/swe_build.py writes (RL's agentic SWE tasks); each sample is one episode of
the RL tool loop with the SWE environment in-process (bash in the sandbox, the editor, finish), --max_tokens per
turn, --max_turns turns (a record's own max_turns wins) and --max_episode_tokens in all; the workspace's final
diff is graded by k2jax.swe.grade: score 1 iff resolved (pass@1 = SWE-bench's resolved rate), the verdict, its
reason and the patch in each sample. A grading infrastructure failure is never a 0: the run stops naming those
samples (the others are kept; a rerun grades only those). Needs the sandbox (k2jax.sandbox).
Writes DIR/samples.jsonl (a rerun resumes from it), DIR/report.json and DIR/report.md, and prints the table.
A rerun reuses a stored sample only when the model's content (a workdir's latest checkpoint, an HF dir's
files; a URL: what its /get_model_info reports), the task files' content, the grader's version and the
settings all match; otherwise it stops naming what changed (use a fresh --out). A k above a task's n stops
the run before the model is opened. report.json holds, per task, each metric with its stderr over problems
and their count, the grader/format version and the fingerprint; `launch/plot.py --compare=A/report.json
--compare=B/report.json --out=cmp.png` draws two runs side by side.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from k2jax import compile_cache, host_malloc  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "k2jax workdir, HF dir, or http(s):// server URL.", required=True)
_TASKS = flags.DEFINE_list("tasks", [], "[NAME=]FORMAT:PATH items.")
_TASKS_FILE = flags.DEFINE_string(
  "tasks_file",
  None,
  "JSON list of task objects (instead of --tasks): name, path, format, and optionally fewshot_file, num_fewshot "
  "and the task's own sampling (n, ks, temperature, top_p, max_tokens; the flags' values otherwise).",
)
_OUT = flags.DEFINE_string("out", None, "Output dir (samples.jsonl, report.json, report.md).", required=True)
_N = flags.DEFINE_integer("n", 1, "Samples per problem.")
_K = flags.DEFINE_list("k", ["1"], "k of pass@k and maj@k (each <= n: a larger k is an error).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 512, "Generated tokens per sample at most.")
_SEED = flags.DEFINE_integer("seed", 0, "Base seed (sample i of a doc: hash(seed, task, doc, i)).")
_FEWSHOT = flags.DEFINE_integer("num_fewshot", 0, "Few-shot examples before each question.")
_FEWSHOT_FILE = flags.DEFINE_list("fewshot_file", [], "NAME=PATH: the task's few-shot examples (its first records).")
_LIMIT = flags.DEFINE_integer("limit", None, "First docs of each task only.")
_CHAT = flags.DEFINE_bool("chat", False, "K2 chat template (few-shot examples as turns).")
_SYSTEM = flags.DEFINE_string("system", None, "Chat: a system message.")
_CONCURRENCY = flags.DEFINE_integer(
  "concurrency", 16, "Requests in flight (an embedded engine decodes at most this many of its slots at once)."
)
_TOKENIZER = flags.DEFINE_string(
  "tokenizer", "auto", "tiktoken file or model dir ('bundled': the repo's BPE; 'auto': the model's, or a URL server's)."
)
_SLOTS = flags.DEFINE_integer(
  "max_running_requests", 8, "Embedded engine: requests decoded together (at most --concurrency are in flight)."
)
_MAX_LEN = flags.DEFINE_integer("max_seq_len", 2048, "Embedded engine: prompt + generated tokens.")
_API_KEY = flags.DEFINE_string("api_key", None, "URL: Bearer token.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Progress bars.")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 30, "swe: assistant turns per episode (a record's max_turns wins).")
_EPISODE_TOKENS = flags.DEFINE_integer(
  "max_episode_tokens", 32768, "swe: prompt + every turn of an episode (capped by the embedded engine's max_seq_len)."
)
_COMPILE_CACHE = compile_cache.define_flag()


def tasks_from_flags():
  from k2jax.eval import TaskSpec

  bad = [item for item in _FEWSHOT_FILE.value if "=" not in item]
  if bad:
    raise app.UsageError(f"--fewshot_file items {bad}: expected NAME=PATH")
  shots = dict(item.split("=", 1) for item in _FEWSHOT_FILE.value)
  if _TASKS_FILE.value:
    with open(_TASKS_FILE.value, encoding="utf-8") as f:
      return tuple(TaskSpec(**spec) for spec in json.load(f))
  specs = []
  for item in _TASKS.value:
    head, sep, path = item.partition(":")
    if not sep or not path:
      raise app.UsageError(f"--tasks item {item!r}: expected [NAME=]FORMAT:PATH")
    name, _, fmt = head.rpartition("=")
    specs.append(TaskSpec(name or fmt, path, fmt, fewshot_file=shots.get(name or fmt)))
  if not specs:
    raise app.UsageError("give --tasks or --tasks_file")
  return tuple(specs)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  host_malloc.keep_freed_memory()  # freed XLA:CPU buffers stay in the heap (k2jax/host_malloc.py)
  # The embedded engine's programs depend on the model's shapes only: a second evaluation of the same
  # architecture (another checkpoint, another task) loads them instead of compiling (as launch/serve.py).
  compile_cache.enable(_COMPILE_CACHE.value)
  from k2jax import eval as k2eval

  config = k2eval.EvalConfig(
    model=_MODEL.value,
    tasks=tasks_from_flags(),
    out=_OUT.value,
    n=_N.value,
    ks=tuple(int(k) for k in _K.value),
    temperature=_TEMPERATURE.value,
    top_p=_TOP_P.value,
    max_tokens=_MAX_TOKENS.value,
    seed=_SEED.value,
    num_fewshot=_FEWSHOT.value,
    limit=_LIMIT.value,
    chat=_CHAT.value,
    system=_SYSTEM.value,
    concurrency=_CONCURRENCY.value,
    tokenizer=_TOKENIZER.value,
    max_slots=_SLOTS.value,
    max_seq_len=_MAX_LEN.value,
    api_key=_API_KEY.value,
    progress=_PROGRESS.value,
    max_turns=_MAX_TURNS.value,
    max_episode_tokens=_EPISODE_TOKENS.value,
  )
  try:
    k2eval.run(config)
  except (k2eval.EngineFailed, k2eval.TaskFormatError, k2eval.InfraFailure) as e:
    sys.exit(f"eval failed: {e}")
  with open(os.path.join(config.out, "report.md"), encoding="utf-8") as f:
    print(f.read(), end="")


if __name__ == "__main__":
  app.run(main)
