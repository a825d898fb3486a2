"""RL (K2 §3.2.3) configs: the K2 objective with MuonClip, rollouts from an engine, PTX, weight sync.

  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny
  python launch/rl.py --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny \
      --config.rollout.engine_url=http://127.0.0.1:30000      # an SGLang server instead

With no `rollout.engine_url` the embedded k2jax engine runs in-process. With a URL, the server must
see `sync.root` at the same path (shared filesystem) and serve the same architecture; the learner
pushes its full weights once at start, then only changed tensors after every update.

`tiny` trains the tiny model from scratch on "1+b" (b in 0..8; the answer is the digit that follows b):
a format-only warm start (random answers: teaches "digit then [EOS]", nothing about which digit) leaves it
at chance (~1/9), then RL with the exact-match reward alone raises the reward (BUILD.md has the figures).
"""

from ml_collections import config_dict


def get_config(arg: str = "tiny") -> config_dict.ConfigDict:
  if arg != "tiny":
    raise ValueError(f"configs/rl.py: unknown variant {arg!r}; known: tiny")
  c = config_dict.ConfigDict()
  c.seed = 0  # model init and warm-start sampling
  c.iterations = 60  # RL iterations (one rollout batch each)
  c.tokenizer_path = ""  # tiktoken model for prompts and rewards ("" = the bundled BPE)

  c.model = config_dict.ConfigDict()
  c.model.preset = "tiny"  # k2jax.model.presets name (used when init_from is empty)
  c.model.init_from = ""  # k2jax workdir or HF dir to start the policy from ("" = random init)
  c.model.param_dtype = "float32"  # master weights
  c.model.compute_dtype = "float32"  # matmuls/activations ("bfloat16" on accelerators)

  c.task = config_dict.ConfigDict()  # k2jax/rl/tasks.py
  c.task.kind = "arith"  # "arith": generated a+b, exact match; "math_jsonl": task.path, \boxed{} reward
  c.task.path = ""  # math_jsonl: {"question", "answer"} records (chat-templated prompts)
  c.task.a_min, c.task.a_max = 1, 1  # "1+b": the digit that follows b
  c.task.b_min, c.task.b_max = 0, 8
  c.task.seed = 0  # prompt stream (prompt i is a function of (seed, i))
  c.task.template = "{a}+{b}"  # prompt text ({a}, {b} = operands); ends on b so a tiny model reads it
  c.task.budget = 4  # total response tokens per sample over all its segments (K2 budget control)
  c.task.truncation_penalty = 0.5  # subtracted from the reward of samples that hit the budget

  c.rollout = config_dict.ConfigDict()
  c.rollout.engine_url = ""  # "" = embedded engine in-process; else an SGLang /generate server
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

  c.loss = config_dict.ConfigDict()  # k2jax.rl.algo.K2LossConfig
  c.loss.tau = 1.0  # regulariser tau of the K2 objective
  c.loss.old_logprobs = "trainer"  # pi_old: "trainer" (recomputed) or "engine" (sampling logprobs)
  c.loss.ptx_coef = 0.002  # weight of the PTX NLL on the curated set (0 disables PTX)

  c.ptx = config_dict.ConfigDict()  # k2jax.rl.ptx.PTXConfig
  c.ptx.source = "bundled"  # jsonl of {"messages"} or {"text"} records; "bundled" = offline corpus
  c.ptx.num_samples = 32  # curated records kept (the first usable ones)
  c.ptx.batch_size = 4  # PTX rows per update
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

  c.checkpoint = config_dict.ConfigDict()
  c.checkpoint.every = 20  # iterations between orbax checkpoints (and one at the end)
  c.checkpoint.keep = 2  # checkpoints kept

  c.log = config_dict.ConfigDict()
  c.log.tensorboard = False  # also write TensorBoard events to WORKDIR/tb

  c.eval = config_dict.ConfigDict()
  c.eval.every = 10  # greedy accuracy on every distinct prompt each N iterations (0 = off)

  c.lock()
  return c
