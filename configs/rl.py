"""RL (K2 §3.2.3) configs: the K2 objective with MuonClip, rollouts from an engine, PTX, weight sync.

  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny
  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny \
      --config.rollout.engine_url=http://127.0.0.1:30000      # an SGLang server instead
  python launch/rl.py --config=configs/rl.py:1t --dry_run      # counts + per-device memory plan on a pod
  python launch/rl.py --config=configs/rl.py:1t --aot=v5p-1024 # XLA's per-device memory, per phase (libtpu)

With no `rollout.engine_url` the embedded k2jax engine runs in-process and gets the new weights as device
arrays; `--config.rollout.engine=sglang_jax_colocated` runs sglang-jax's engine in-process instead (Python >= 3.12
with sgl_jax installed, BUILD.md "sglang-jax colocated"; the `sglang_jax.*` keys size it; on CPU it needs
128-wide heads: `--config.model.preset=tiny128`), with the weights swapped on device after every update. With a URL, the server must see `sync.root` at the same path (shared filesystem) and serve the
same architecture; every JAX process writes the tensors it holds, a full push once at start, then only
changed tensors after every update. With `engine.sharding` (tp | ep | tp_ep) and no URL the embedded engine
serves on a mesh over all the trainer's devices, on one process or many (colocated phases: `colocate.*`). The policy is sharded like pretraining: the same `mesh.*` keys and
rules presets as configs/k2.py, and the same multi-process launch (launch/slurm_gpu.sh, tpu_pod.sh).

`1t` is Kimi K2 itself (init_from the released checkpoint) on a TPU pod, colocated as K2 §3.3: the embedded
engine on the trainer's 512 chips (`--config.rollout.engine_url=http://sglang-router:30000`: SGLang workers
instead); its `--dry_run` prints parameter counts and the per-device memory plan of the RL update, and
`--aot=v5p-1024` XLA's per-device memory of the generation and update phases (k2jax/rl/aot.py).

`tiny` trains the tiny model from scratch on "1+b" (b in 0..8; the answer is the digit that follows b):
a format-only warm start (random answers: teaches "digit then [EOS]", nothing about which digit) leaves it
at chance (~1/9), then RL with the exact-match reward alone raises the reward (BUILD.md has the figures).

`agentic_tiny` mixes six task types in every batch, each with its own token budget and reward kind
(data/rl/agentic_tiny/): math, code (unit tests in the sandbox), instruction following, an LLM judge,
the K2 rubric reward (both judged by the embedded engine itself unless `reward.judge_url` is set) and a
multi-turn tool-use task against a `sim_tools` environment service, which the learner starts itself
(a subprocess on a free port, stopped at exit) unless `agentic.env_urls` names one:

  python launch/rl.py --config=configs/rl.py:agentic_tiny --workdir=/tmp/rl_agentic \
      --config.agentic.env_urls=sim_tools=http://127.0.0.1:8080   # python -m k2jax.agentic.envs --port=8080

`swe_tiny` mixes software-engineering episodes (env "swe": fix a bug in a repository with bash and an editor,
graded by the repository's tests in a fresh sandbox; the toy tasks in data/swe/toy_tasks, built by
launch/swe_build.py) with arithmetic in every batch; the env service starts itself unless `agentic.env_urls`
names one (`swe=http://env-swe.k2jax-envs.svc:8080`, deploy/k8s/env-swe.yaml). Point `tasks.swe.path` at
another built set's rl_tasks.jsonl for real repositories:

  python launch/rl.py --config=configs/rl.py:swe_tiny --workdir=/tmp/rl_swe
"""

import os

from ml_collections import config_dict

TASK_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "rl", "agentic_tiny")
SWE_TASKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "swe", "toy_tasks")
VARIANTS = ("tiny", "1t", "agentic_tiny", "swe_tiny")


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
  # (BUILD.md "Colocated RL" has XLA's figures). Serving mesh: experts over 8 (48 each), heads and widths
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
  c = config_dict.ConfigDict()
  c.seed = 0  # model init and warm-start sampling
  c.iterations = 60  # RL iterations (one rollout batch each)
  c.tokenizer_path = ""  # tiktoken model for prompts and rewards ("" = the bundled BPE)
  c.topology = ""  # k2jax.memory.TOPOLOGIES name for --dry_run's memory plan ('' = none)

  c.model = config_dict.ConfigDict()
  c.model.preset = "tiny"  # k2jax.model.presets name (used when init_from is empty)
  c.model.init_from = ""  # k2jax workdir or HF dir to start the policy from ("" = random init)
  # HF init_from: bytes of HF blocks each process holds in flight beyond its own shards (orbax uses 2 GiB)
  c.model.read_budget_bytes = 2 << 30
  c.model.param_dtype = "float32"  # master weights
  c.model.compute_dtype = "float32"  # matmuls/activations ("bfloat16" on accelerators)
  c.model.scan_layers = True  # lax.scan over stacked layers
  c.model.remat_policy = "none"  # none | full | dots | dots_no_batch
  c.model.attention = "auto"  # attention kernel, as configs/k2.py

  c.mesh = config_dict.ConfigDict()  # device mesh and rules preset, exactly as configs/k2.py
  c.mesh.rules = "fsdp"  # k2jax.sharding rules preset: fsdp | fsdp_ep | fsdp_ep_tp
  c.mesh.data = 1
  c.mesh.fsdp = -1  # -1 = all remaining devices
  c.mesh.expert = 1
  c.mesh.tensor = 1

  c.task = config_dict.ConfigDict()  # k2jax/rl/tasks.py
  c.task.kind = "arith"  # "arith": generated a+b, exact match; "math_jsonl": task.path, \boxed{} reward
  c.task.path = ""  # math_jsonl: {"question", "answer"} records (chat-templated prompts)
  c.task.a_min, c.task.a_max = 1, 1  # "1+b": the digit that follows b
  c.task.b_min, c.task.b_max = 0, 8
  c.task.seed = 0  # prompt stream (prompt i is a function of (seed, i))
  c.task.template = "{a}+{b}"  # prompt text ({a}, {b} = operands); ends on b so a tiny model reads it
  c.task.budget = 4  # total response tokens per sample over all its segments (K2 budget control)
  c.task.truncation_penalty = 0.5  # subtracted from the reward of samples that hit the budget (all tasks)

  # Mixed task batches: tasks.<name> = {kind, reward, path, env, budget, weight} replaces the single `task`
  # (kind "arith" still reads task.a_min.. and task.template). k2jax/rl/tasks.py:task_specs has the keys.
  c.tasks = config_dict.ConfigDict()

  c.reward = config_dict.ConfigDict()  # k2jax/rl/rewards/contract.py (the one reward contract)
  c.reward.judge_url = ""  # OpenAI-compatible endpoint for judge/rubric rewards ("" = the rollout engine)
  c.reward.judge_model = "default"  # model name sent to judge_url
  c.reward.judge_max_tokens = 64  # judge reply length
  c.reward.judge_criteria = ""  # judge criteria for prompts without data["criteria"] ("" = the default)

  c.agentic = config_dict.ConfigDict()  # multi-turn episodes (k2jax/agentic): env services and turn limits
  c.agentic.env_urls = ""  # "sim_tools=http://host:port,..."; an env without a URL gets a local service
  c.agentic.local_workers = 1  # service processes started per environment without a URL
  c.agentic.max_turns = 4  # assistant turns per episode (a task's max_turns may lower it)
  c.agentic.max_new_tokens_per_turn = 64  # per engine call; the task budget caps the whole response
  c.agentic.step_timeout_s = 60.0  # an env reset/step slower than this fails the episode (dropped)

  c.rollout = config_dict.ConfigDict()
  c.rollout.engine_url = ""  # "" = an engine in this process (rollout.engine); else an SGLang /generate server
  c.rollout.engine = "embedded"  # in-process engine: "embedded" (k2jax) | "sglang_jax_colocated"
  c.rollout.worker_urls = ""  # with a router as engine_url: its workers, comma-separated (updates, aborts)
  c.rollout.group_size = 8  # K responses per prompt
  c.rollout.target_groups = 16  # complete groups per train batch
  c.rollout.launch_groups = 20  # groups in flight (over-sampling; the slowest are aborted)
  c.rollout.partial_rollout = True  # aborted samples resume next iteration (K1.5 partial rollouts)
  c.rollout.max_staleness = 2  # resumed tokens at most this many weight versions old
  c.rollout.temperature = 1.0  # initial sampling temperature ...
  c.rollout.temperature_final = 1.0  # ... decaying towards this (K2 temperature decay)
  c.rollout.temperature_half_life = 100.0  # iterations
  c.rollout.top_p = 1.0  # nucleus sampling (1 = off)
  c.rollout.max_concurrency = 64  # rollout threads = in-flight engine requests

  c.engine = config_dict.ConfigDict()  # embedded engine only (k2jax.engine.EngineConfig)
  c.engine.max_slots = 32  # requests decoded together
  c.engine.max_seq_len = 64  # prompt + response tokens per request
  c.engine.sharding = ""  # serving preset on all devices (tp | ep | tp_ep; "" = one device, one process)
  c.engine.mesh = ""  # serving mesh, e.g. "expert:4,tensor:2" ("" = the preset's default)

  c.colocate = config_dict.ConfigDict()  # engine.sharding set: generate/update phases (k2jax/rl/phases.py)
  c.colocate.offload_opt_state = True  # optimizer state to host memory while the engine generates
  c.colocate.offload_params = False  # the float32 master weights too (the engine serves its own copy)

  c.sglang_jax = config_dict.ConfigDict()  # rollout.engine=sglang_jax_colocated (k2jax.engine.SglangJaxConfig)
  c.sglang_jax.device = "cpu"  # cpu | tpu | gpu
  c.sglang_jax.tp_size = 1  # its mesh: the first tp_size local devices
  c.sglang_jax.dtype = "float32"  # served weights ("bfloat16" on TPU; float32 matches the trainer's logprobs)
  c.sglang_jax.attention_backend = "native"  # CPU: native; TPU: fa
  c.sglang_jax.context_length = 512  # prompt + response tokens per request
  c.sglang_jax.mem_fraction_static = 0.1  # device memory share for weights + KV pool
  c.sglang_jax.max_total_tokens = 4096  # KV pool size in tokens
  c.sglang_jax.max_running_requests = 8  # requests decoded together
  c.sglang_jax.chunked_prefill_size = 256
  c.sglang_jax.precompile_bs_paddings = "8"  # comma-separated batch sizes compiled at start
  c.sglang_jax.precompile_token_paddings = "256"  # comma-separated prefill token counts compiled at start

  c.loss = config_dict.ConfigDict()  # k2jax.rl.algo.K2LossConfig
  c.loss.tau = 1.0  # regulariser tau of the K2 objective
  c.loss.old_logprobs = "trainer"  # pi_old: "trainer" (recomputed) or "engine" (sampling logprobs)
  c.loss.ptx_coef = 0.002  # weight of the PTX NLL on the curated set (0 disables PTX)

  c.ptx = config_dict.ConfigDict()  # k2jax.rl.ptx.PTXConfig
  c.ptx.source = "bundled"  # jsonl of {"messages"} or {"text"} records; "bundled" = offline corpus
  c.ptx.num_samples = 32  # curated records kept (the first usable ones)
  c.ptx.batch_size = 8  # PTX rows per update (a multiple of the mesh's batch shards)
  c.ptx.seq_len = 32  # tokens per PTX row (longer records truncated)

  c.warm_start = config_dict.ConfigDict()  # format-only SFT before RL (random answers; see tasks.py)
  c.warm_start.steps = 20  # 0 disables
  c.warm_start.batch_size = 32  # format examples per warm-start update
  c.warm_start.lr = 0.01  # constant LR during the warm start

  c.optim = config_dict.ConfigDict()  # MuonClip (k2jax.optim.muonclip)
  c.optim.lr = 0.003  # constant RL learning rate
  c.optim.weight_decay = 0.0  # decoupled decay (times the LR) on Muon and AdamW params
  c.optim.momentum = 0.95  # Muon momentum
  c.optim.qk_clip_tau = 100.0  # QK-Clip threshold on the forward's max logits (0 disables)
  c.optim.bias_update_rate = 0.0  # MoE balancing-bias step per update (0 keeps the bias fixed)
  c.optim.updates_per_batch = 1  # optimizer steps per rollout batch (pi_old fixed across them)

  c.train = config_dict.ConfigDict()
  c.train.seq_len = 16  # trainer row length: prompt + response must fit

  c.sync = config_dict.ConfigDict()  # k2jax.rl.weight_sync.WeightSyncConfig
  c.sync.root = ""  # shared dir for HF safetensors pushes ("" = WORKDIR/weights)
  c.sync.keep_last = 2  # pushed version directories kept on disk
  c.sync.dtype = ""  # remote pushes: "" (param dtype) | bfloat16 | float32 | fp8 (the release's block-FP8)

  c.checkpoint = config_dict.ConfigDict()
  c.checkpoint.every = 20  # iterations between orbax checkpoints (and one at the end)
  c.checkpoint.keep = 2  # checkpoints kept
  c.checkpoint.async_save = True  # write in the background while rollouts continue
  # When checkpoints exist but none restores: "error" stops naming each and why (nothing moved, exit != 0);
  # "fresh" moves them to WORKDIR/checkpoints_corrupt/ and starts from iteration 0.
  c.checkpoint.on_unreadable = "error"

  c.log = config_dict.ConfigDict()
  c.log.tensorboard = False  # also write TensorBoard events to WORKDIR/tb
  c.log.rollouts = False  # also write every sample's tokens and loss mask to WORKDIR/rollouts.jsonl

  c.eval = config_dict.ConfigDict()
  c.eval.every = 10  # greedy accuracy on every distinct prompt each N iterations (0 = off)

  return c


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
    t = config_dict.ConfigDict()
    t.kind, t.reward, t.budget, t.weight = kind, reward, budget, 1
    t.path = os.path.join(TASK_DATA, f"{name}.jsonl")
    t.env = "sim_tools" if kind == "agentic" else ""
    c.tasks[name] = t
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
    t = config_dict.ConfigDict()
    t.kind, t.reward, t.budget, t.weight, t.path, t.env = kind, reward, budget, 1, path, env
    c.tasks[name] = t
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
