"""RL (K2 §3.2.3) configs: the K2 objective with MuonClip, rollouts from an engine, PTX, weight sync.

  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny
  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny \
      --config.rollout.engine_url=http://127.0.0.1:30000      # an SGLang server instead
  python launch/rl.py --config=configs/rl.py:1t --dry_run      # counts + per-device memory plan on a pod
  python launch/rl.py --config=configs/rl.py:1t --aot=v5p-1024 # XLA's per-device memory, per phase (libtpu)

With no `rollout.engine_url` the embedded k2jax engine runs in-process and gets the new weights as device
arrays; `--config.rollout.engine=sglang_jax_colocated` runs sglang-jax's engine in-process instead (Python >= 3.12
with sgl_jax installed, docs/rl.md "sglang-jax colocated"; the `sglang_jax.*` keys size it; on CPU it needs
128-wide heads: `--config.model.preset=tiny128`), with the weights swapped on device after every update. With a URL, the server must see `sync.root` at the same path (shared filesystem) and serve the
same architecture; every JAX process writes the tensors it holds, a full push once at start, then only
changed tensors after every update. With `engine.sharding` (tp | ep | tp_ep) and no URL the embedded engine
serves on a mesh over all the trainer's devices, on one process or many (colocated phases: `colocate.*`). The policy is sharded like pretraining: the same `mesh.*` keys and
rules presets as configs/k2.py, and the same multi-process launch (launch/slurm_gpu.sh, tpu_pod.sh).

K2-Thinking-style INT4 (docs/int4.md): `--config.model.expert_qat=int4` trains on the INT4 release's grid (routed
experts fake-quantized in every forward pass, straight-through gradients to the float32 masters);
`--config.rollout.quantization=int4` serves the rollouts at INT4 whatever the trainer does (the embedded engine
holds the experts packed and quantizes each push on arrival; a remote SGLang engine gets INT4 pushes), and
`--config.model.init_from` may be the INT4 release itself (its experts dequantized into the masters exactly).
Without `rollout.quantization` the embedded engine serves what the trainer computes (QAT's grid, fake-quantized).

`1t` is Kimi K2 itself (init_from the released checkpoint) on a TPU pod, colocated as K2 §3.3: the embedded
engine on the trainer's 512 chips (`--config.rollout.engine_url=http://sglang-router:30000`: SGLang workers
instead); its `--dry_run` prints parameter counts and the per-device memory plan of the RL update, and
`--aot=v5p-1024` XLA's per-device memory of the generation and update phases (k2jax/rl/aot.py).

`tiny` trains the tiny model from scratch on "1+b" (b in 0..8; the answer is the digit that follows b):
a format-only warm start (random answers: teaches "digit then [EOS]", nothing about which digit) leaves it
at chance (~1/9), then RL with the exact-match reward alone raises the reward (docs/results.md has the figures).

Held-out evaluation (k2jax/rl/evaluation.py): every `eval.every` iterations (and after the warm start and at
the end) the rollout engine, serving the newly pushed weights, runs the task's own prompts greedily
(`eval/<task>/pass@1`; `eval_accuracy` their mean) and each held-out task of `eval.tasks.<name>` or of a JSON
list in `eval.tasks_file` through launch/eval.py's runner (formats gsm8k, math, humaneval, mbpp, mc,
answer.KIND; n, ks, temperature per task), logged as `eval/<name>/pass@k`, `mean@n`, `maj@k` beside the reward:

  echo '[{"name": "gsm8k", "format": "gsm8k", "path": "/data/gsm8k/test.jsonl", "limit": 200},
         {"name": "aime", "format": "math", "path": "/data/aime.jsonl", "n": 8, "ks": [1, 8], "temperature": 1.0}]' \
      > /tmp/eval_tasks.json
  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny --config.eval.tasks_file=/tmp/eval_tasks.json

`critic.coef > 0` turns on closed-loop critic refinement (K2 §3.2.2, k2jax/rl/critic.py; off by default): pairs of
each batch's responses to verifiable prompts (exact, math, code rewards) whose rewards differ are shown to the
policy in the rubric reward's pairwise judge format and the verifier-consistent verdict is trained as an
auxiliary NLL term; `critic_agreement` on hash-held-out pairs is logged every iteration. `critic.rubrics`
('|'-separated) shows task-specific rubrics instead of the rubric reward's generic ones (same layout; 139
tokens instead of 316 here). In that (rubric) layout the tiny model's judge has not been seen to leave chance
(0.5); with `reward.judge_layout=short` it does, inside RL (bench/critic_loop.py: held-out agreement 0.5 -> 1.0
on 5 of 5 seeds; docs/results.md "The critic"):

  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_critic \
      --config.critic.coef=1.0 --config.critic.seq_len=144 --config.critic.rubrics="The answer is correct."
  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_critic_short --config.reward.judge_layout=short \
      --config.critic.coef=10 --config.critic.seq_len=48 --config.loss.tau=1 --config.optim.updates_per_batch=24

`agentic_tiny` mixes six task types in every batch, each with its own token budget and reward kind
(data/rl/agentic_tiny/): math, code (unit tests in the sandbox), instruction following, an LLM judge,
the K2 rubric reward (both judged by the embedded engine itself unless `reward.judge_url` is set) and a
multi-turn tool-use task against a `sim_tools` environment service, which the learner starts itself
(a subprocess on a free port, stopped at exit) unless `agentic.env_urls` names one:

  python launch/rl.py --config=configs/rl.py:agentic_tiny --workdir=/tmp/rl_agentic \
      --config.agentic.env_urls=sim_tools=http://127.0.0.1:8080   # python -m k2jax.agentic.envs --port=8080

`recipe` is stage 3 of docs/pretraining.md "The whole recipe" (scripts/recipe.sh): RL from the recipe's SFT
workdir on "max of four digits" (data/recipe/rl_train.jsonl, exact reward), with the held-out split
(data/recipe/heldout.jsonl, never trained on) evaluated greedily every `eval.every` iterations as eval/heldout/pass@1:

  python launch/rl.py --config=configs/rl.py:recipe --workdir=/tmp/k2jax_recipe/rl \
      --config.model.init_from=/tmp/k2jax_recipe/sft

`swe_tiny` mixes software-engineering episodes (env "swe": fix a bug in a repository with bash and an editor,
graded by the repository's tests in a fresh sandbox; the toy tasks in data/swe/toy_tasks, built by
launch/swe_build.py) with arithmetic in every batch; the env service starts itself unless `agentic.env_urls`
names one (`swe=http://env-swe.k2jax-envs.svc:8080`, deploy/k8s/env-swe.yaml). Point `tasks.swe.path` at
another built set's rl_tasks.jsonl for real repositories:

  python launch/rl.py --config=configs/rl.py:swe_tiny --workdir=/tmp/rl_swe
"""

import os

from ml_collections import config_dict

from k2jax.rl import config as rl_config

TASK_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "rl", "agentic_tiny")
SWE_TASKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "swe", "toy_tasks")
RECIPE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "recipe")
VARIANTS = ("tiny", "1t", "agentic_tiny", "swe_tiny", "recipe")


def get_config(arg: str = "tiny") -> config_dict.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"configs/rl.py: unknown variant {arg!r}; known: {', '.join(VARIANTS)}")
  c = _tiny()
  if arg == "1t":
    _k2_1t(c)
  if arg == "agentic_tiny":
    _agentic_tiny(c)
  if arg == "swe_tiny":
    _swe_tiny(c)
  if arg == "recipe":
    _recipe(c)
  c.lock()
  return c


def _k2_1t(c):
  """Kimi K2 RL on 512 TPU v5p chips: the policy sharded as K2 pretraining (EP 8 x FSDP 64)."""
  c.topology = "v5p-1024"
  c.iterations = 1000
  c.tokenizer_path = "/data/kimi-k2/tiktoken.model"  # K2's tokenizer (ships with the checkpoint)
  c.model.preset = "1t"
  c.model.init_from = ""  # the released K2 checkpoint (an HF dir) on a real run
  c.model.param_dtype = "float32"
  c.model.compute_dtype = "bfloat16"
  c.model.remat_policy = "full"
  # "int4": K2 Thinking's QAT of the routed experts (INT4 rollouts: rollout.quantization and sync.dtype "int4")
  c.model.expert_qat = "none"
  c.mesh.rules = "fsdp_ep"
  c.mesh.expert = 8
  c.task.kind = "math_jsonl"
  c.task.budget = 3584  # response tokens per sample; prompt + response fit train.seq_len
  c.rollout.group_size = 8
  c.rollout.target_groups = 64  # 512 rows per update: one row per chip
  c.rollout.launch_groups = 80
  c.rollout.max_concurrency = 640
  # Colocated (K2 §3.3): the embedded engine on the trainer's own 512 chips, weights resharded device to
  # device, optimizer state in host memory while generating. `--config.rollout.engine_url=http://sglang-router:30000`
  # rolls out on separate SGLang workers instead. `launch/rl.py --aot=v5p-1024` compiles this iteration
  # (docs/results.md has XLA's figures). Serving mesh: experts over 8 (48 each), heads and widths
  # over 64 (one head each); requests (KV cache slots) over the 8 expert devices. Each mesh axis must be a
  # product of the 8x8x8 torus's sides (1, 8, 64, 512: XLA refused expert:16,tensor:32), and the requests'
  # axes must divide the 16-token prefill bucket: so 8. 640 slots = the rollout's 80 launched groups x 8
  # in flight, each a full 4096-token row.
  c.rollout.engine_url = ""
  c.engine.sharding = "tp_ep"
  c.engine.mesh = "expert:8,tensor:64"
  c.engine.max_slots = 640
  c.engine.max_seq_len = 4096
  c.train.seq_len = 4096
  c.ptx.batch_size = 512
  c.ptx.seq_len = 4096
  c.warm_start.steps = 0  # K2 RL starts from the SFT model
  c.optim.lr = 1e-6
  c.optim.bias_update_rate = 0.0
  c.checkpoint.every = 20
  c.checkpoint.keep = 3
  c.eval.every = 0
  c.sync.dtype = "fp8"  # the SGLang workers serve the release's block-FP8 layout: half the bytes of bf16


def _tiny() -> config_dict.ConfigDict:
  """k2jax/rl/config.py declares every key, its default (this preset) and doc."""
  return rl_config.config_dict()


def _agentic_tiny(c: config_dict.ConfigDict) -> None:
  """Six task types, one group of each per batch; a warm start on the tool-call demos of the sim_tools task
  teaches the random tiny model the call format, so episodes reach tool results (masked out of the loss)."""
  c.iterations = 2
  for name, kind, reward, budget in (
    ("math", "jsonl", "math", 12),
    ("code", "jsonl", "code", 16),
    ("instruction", "jsonl", "instruction", 12),
    ("judge", "jsonl", "judge", 8),
    ("rubric", "jsonl", "rubric", 8),
    ("sim_tools", "agentic", "env", 128),
  ):
    path, env = os.path.join(TASK_DATA, f"{name}.jsonl"), "sim_tools" if kind == "agentic" else ""
    c.tasks[name] = rl_config.task_section(kind=kind, reward=reward, budget=budget, weight=1, path=path, env=env)
  c.task.truncation_penalty = 0.0
  c.rollout.group_size = 2
  c.rollout.target_groups = c.rollout.launch_groups = 6  # = the number of task types: every kind in every batch
  c.rollout.partial_rollout = False
  c.reward.judge_max_tokens = 8
  c.agentic.max_turns = 3
  c.agentic.max_new_tokens_per_turn = 24
  c.engine.max_slots = 16
  c.engine.max_seq_len = 512  # the rubric judge's pairwise prompt (~400 tokens with two answers) + its reply
  c.train.seq_len = 224  # agentic: ~90 prompt tokens + the 128-token budget
  c.loss.ptx_coef = 0.0
  c.warm_start.steps = 20
  c.warm_start.batch_size = 4
  c.eval.every = 0
  c.checkpoint.every = 2
  c.log.rollouts = True


def _swe_tiny(c: config_dict.ConfigDict) -> None:
  """SWE episodes + arithmetic, one group of each per batch. A warm start on the tasks' demo tool call (a bash
  test run) and on the arithmetic format teaches the random tiny model the call format, so episodes reach tool
  results (masked out of the loss). The tiny model resolves nothing: the run checks the plumbing."""
  c.iterations = 2
  for name, kind, reward, budget, path, env in (
    ("arith", "arith", "exact", 4, "", ""),
    ("swe", "agentic", "env", 160, os.path.join(SWE_TASKS, "rl_tasks.jsonl"), "swe"),
  ):
    c.tasks[name] = rl_config.task_section(kind=kind, reward=reward, budget=budget, weight=1, path=path, env=env)
  c.task.truncation_penalty = 0.0
  c.rollout.group_size = 2
  c.rollout.target_groups = c.rollout.launch_groups = 2  # = the number of task types
  c.rollout.partial_rollout = False
  c.agentic.max_turns = 3
  c.agentic.max_new_tokens_per_turn = 48
  c.agentic.step_timeout_s = 300.0  # a step may grade: the repository's tests in a fresh sandbox
  c.engine.max_slots = 8
  c.engine.max_seq_len = 1024
  c.train.seq_len = 800  # ~600 prompt tokens (the issue and three tool schemas) + the 160-token budget
  c.loss.ptx_coef = 0.0
  c.warm_start.steps = 10
  c.warm_start.batch_size = 4
  c.eval.every = 0
  c.checkpoint.every = 2
  c.log.rollouts = True


def _recipe(c: config_dict.ConfigDict) -> None:
  """RL from an SFT workdir (`model.init_from`, set on the command line) on the recipe's train split; the held-out
  split is an eval task only. No warm start (the SFT model already answers in the chat format), no PTX."""
  c.iterations = 40
  c.tasks["maxdigit"] = rl_config.task_section(
    kind="jsonl", reward="exact", budget=3, weight=1, path=os.path.join(RECIPE_DATA, "rl_train.jsonl")
  )
  c.warm_start.steps = 0
  c.loss.ptx_coef = 0.0
  c.train.seq_len = 32  # the chat-templated prompt (~20 tokens) + the 3-token budget
  # Muon's update has a fixed RMS whatever the gradient's size: at 3e-3 (the tiny preset's) the noisy RL steps
  # undid the SFT (held-out greedy pass@1 0.90 -> 0.62 in 5 iterations, measured); 3e-4 keeps it and improves it.
  c.optim.lr = 3e-4
  c.eval.every = 20  # iterations 0, 20 and 40: each evaluation is 200 greedy + 1600 sampled answers
  heldout = os.path.join(RECIPE_DATA, "heldout.jsonl")
  c.eval.tasks["heldout"] = rl_config.eval_task_section(format="answer.exact", path=heldout, chat=True)
  c.eval.tasks["heldout_sampled"] = rl_config.eval_task_section(
    format="answer.exact", path=heldout, chat=True, n=8, ks=(1, 8), temperature=1.0
  )
  c.checkpoint.every = 40
