"""Kimi K2 pretraining / SFT configs: `tiny` (CPU demo), `small` (one accelerator), `1t` (the K2 recipe),
`sft_tiny` (chat fine-tuning of a tiny workdir).

  python launch/train.py --config=configs/k2.py:tiny --workdir=/tmp/k2tiny
  python launch/train.py --config=configs/k2.py:tiny --workdir=W --config.steps=50 --config.optim.peak_lr=3e-3
  python launch/train.py --config=configs/k2.py:1t --dry_run            # counts + memory plan, no allocation
  python launch/sweep.py --config=configs/k2.py:tiny --sweep=lr --workdir=/tmp/sweeps

Every knob lives here; `k2jax.train.config.from_config_dict` turns this ConfigDict into frozen
dataclasses once, at the `run()` boundary. `model.*` fields left at None take the preset's value.
"""

from ml_collections import config_dict

VARIANTS = ("tiny", "small", "1t", "sft_tiny")

# Architecture fields a run may override on top of `model.preset` (HF DeepSeek-V3 names).
MODEL_INT_FIELDS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "moe_intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "n_routed_experts",
  "num_experts_per_tok",
  "n_shared_experts",
  "first_k_dense_replace",
  "n_group",
  "topk_group",
  "max_position_embeddings",
)
MODEL_FLOAT_FIELDS = ("routed_scaling_factor", "rope_theta", "rms_norm_eps", "initializer_range")

# K2 (arXiv 2507.20534 §2.5): 2^26 = 67M tokens per step, 10T tokens constant LR then 5.5T cosine.
_K2_BATCH_SEQS = 16384  # x 4096 tokens = 2^26
_K2_STEPS = round(15.5e12 / 2**26)


def get_config(arg: str = "tiny") -> config_dict.ConfigDict:
  """The config for `arg` in VARIANTS (locked: an unknown `--config.x` fails naming the key)."""
  if arg not in VARIANTS:
    raise ValueError(f"configs/k2.py: unknown variant {arg!r}; choose one of {VARIANTS}")
  c = _base()
  {"tiny": _tiny, "small": _small, "1t": _k2_1t, "sft_tiny": _sft_tiny}[arg](c)
  c.lock()
  return c


def _base() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.steps = 300  # optimizer steps to train (the LR schedule spans them)
  c.seed = 0  # parameter init seed
  c.topology = ""  # k2jax.memory.TOPOLOGIES name for --dry_run's memory plan ('' = none)

  c.model = config_dict.ConfigDict()
  c.model.preset = "tiny"  # k2jax.model.presets name: tiny | small | 1t
  # Typed, unset overrides (None = keep the preset's value), so `--config.model.hidden_size=256` parses.
  for name in MODEL_INT_FIELDS:
    c.model[name] = config_dict.FieldReference(None, field_type=int)
  for name in MODEL_FLOAT_FIELDS:
    c.model[name] = config_dict.FieldReference(None, field_type=float)
  c.model.param_dtype = "float32"  # master weights
  c.model.compute_dtype = "float32"  # activations / matmuls (bfloat16 on accelerators)
  c.model.scan_layers = True  # lax.scan over stacked layers (one compiled layer body)
  c.model.remat_policy = "none"  # none | full | dots | dots_no_batch
  # auto | einsum | flash: auto = the Pallas flash kernel (linear memory in seq_len, returns QK-Clip's max
  # logit) when compiling for TPU (GPU: its plain-JAX blocked fallback), the einsum path on CPU.
  c.model.attention = "auto"
  c.model.moe_dispatch = "auto"  # EP all-to-all: auto (ragged on TPU/GPU, fixed on CPU) | fixed | ragged
  c.model.moe_chunk_tokens = 0  # EP: tokens per device per dispatch chunk (0 = all at once; bounds EP buffers)

  c.data = config_dict.ConfigDict()
  c.data.kind = "pretrain"  # pretrain (packed documents) | sft (chat, assistant-only loss)
  c.data.path = ""  # '' = bundled corpus; else a file or glob (jsonl/parquet/array_record)
  c.data.tokenizer_path = ""  # '' = bundled tiny BPE; else a tiktoken rank file (K2's tiktoken.model) or its HF dir
  c.data.seq_len = 64  # tokens per packed row
  c.data.global_batch_size = 16  # rows per optimizer step, summed over all hosts
  c.data.num_microbatches = 1  # gradient accumulation: the global batch is split into this many
  c.data.seed = 0  # shuffle / packing seed
  c.data.num_workers = 0  # grain worker processes per host (0 = in-process)
  c.data.read_threads = 0  # grain read/tokenize threads per host

  c.optim = config_dict.ConfigDict()  # MuonClip (k2jax.optim.muonclip) + WSD schedule
  c.optim.peak_lr = 2e-4  # constant-phase LR, shared by Muon (0.2*sqrt(max(A,B)) RMS) and AdamW
  c.optim.final_lr = 2e-5  # LR at the end of the cosine decay
  c.optim.warmup_steps = 500  # linear warmup from 0
  c.optim.decay_fraction = 5.5 / 15.5  # fraction of `steps` in the cosine decay (K2: 5.5T of 15.5T tokens)
  c.optim.weight_decay = 0.1  # decoupled, times the LR, on Muon and AdamW leaves
  c.optim.momentum = 0.95  # Muon (plain-sum Nesterov) momentum
  c.optim.adam_b1 = 0.9
  c.optim.adam_b2 = 0.95
  c.optim.adam_eps = 1e-8
  c.optim.qk_clip_tau = 100.0  # QK-Clip threshold on the max pre-softmax logit (<= 0 disables)
  c.optim.bias_update_rate = 1e-3  # aux-loss-free balancing: b_i += u * sign(mean_load - load_i)
  # Keep the optimizer state in pinned host memory between steps (TPU/GPU; brought to HBM for the update
  # only). On CPU the device memory is host memory: ignored.
  c.optim.offload_state = False

  c.mesh = config_dict.ConfigDict()  # device mesh; -1 = all remaining devices
  c.mesh.rules = "fsdp"  # k2jax.sharding rules preset: fsdp | fsdp_ep | fsdp_ep_tp
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.expert = 1
  c.mesh.tensor = 1

  c.checkpoint = config_dict.ConfigDict()
  c.checkpoint.every_steps = 100  # save every N steps (and at the end, and on SIGTERM/preemption)
  c.checkpoint.keep = 3  # keep the last K checkpoints
  c.checkpoint.async_save = True  # write in the background while training continues
  c.checkpoint.init_from = ""  # workdir or HF dir whose weights start a fresh run ('' = random init)
  # HF init_from: bytes of HF blocks each process holds in flight beyond its own shards (orbax uses 2 GiB)
  c.checkpoint.read_budget_bytes = 2 << 30
  # When checkpoints exist but none restores: "error" stops naming each and why (nothing moved, exit != 0);
  # "fresh" moves them to W/checkpoints_corrupt/ and trains from step 0.
  c.checkpoint.on_unreadable = "error"

  c.log = config_dict.ConfigDict()
  c.log.every_steps = 10  # metrics.jsonl / TensorBoard / progress line cadence
  c.log.progress = True  # live rich progress line with ETA (only on a terminal)
  c.log.tensorboard = True  # TensorBoard events in W/tb
  c.log.peak_flops = 0.0  # per-device peak FLOP/s for MFU; 0 = measure fp32 matmul rate at start
  c.log.spike_factor = 2.0  # loss > factor x running mean of the last window -> spike logged
  c.log.spike_window = 50  # steps in the running mean
  return c


def _tiny(c):
  c.steps = 300
  c.model.preset = "tiny"
  c.data.seq_len = 64
  c.data.global_batch_size = 16
  c.optim.peak_lr = 1e-2  # tiny models want a far higher LR than K2's 2e-4
  c.optim.final_lr = 1e-3
  c.optim.warmup_steps = 20
  c.optim.decay_fraction = 0.3
  c.checkpoint.every_steps = 100


def _small(c):
  c.steps = 2000
  c.model.preset = "small"
  c.model.compute_dtype = "bfloat16"
  c.model.remat_policy = "dots_no_batch"
  c.data.seq_len = 1024
  c.data.global_batch_size = 64
  c.optim.peak_lr = 2e-3
  c.optim.final_lr = 2e-4
  c.optim.warmup_steps = 100
  c.checkpoint.every_steps = 500


def _k2_1t(c):
  c.steps = _K2_STEPS  # 15.5T tokens at 2^26 tokens per step
  c.topology = "v5p-1024"  # 512 TPU v5p chips (k2jax.memory.TOPOLOGIES)
  c.model.preset = "1t"
  c.model.compute_dtype = "bfloat16"
  c.model.remat_policy = "full"
  # 8 chunks of 512 tokens: the dropless EP receive buffer is 32768 rows (448 MiB) instead of 262144 (3.5 GiB).
  c.model.moe_chunk_tokens = 512
  c.data.seq_len = 4096
  c.data.global_batch_size = _K2_BATCH_SEQS
  c.data.num_microbatches = 32  # 4096 tokens per device per microbatch: fits v5p HBM (dry run)
  c.data.num_workers = 8
  c.optim.peak_lr = 2e-4
  c.optim.final_lr = 2e-5
  c.optim.warmup_steps = 500
  # Muon momentum and Adam moments (7.6 of the 16.3 GiB of state per device on v5p-1024) wait in host memory
  # through the forward and backward passes (bench/aot.py).
  c.optim.offload_state = True
  c.mesh.rules = "fsdp_ep"
  c.mesh.expert = 8  # EP 8 x FSDP 64 on v5p-1024 (MaxText's Kimi recipe)
  c.checkpoint.every_steps = 500
  c.log.every_steps = 1


def _sft_tiny(c):
  _tiny(c)
  c.steps = 100
  c.data.kind = "sft"
  c.data.seq_len = 128
  c.data.global_batch_size = 8
  c.optim.peak_lr = 3e-3
  c.optim.final_lr = 3e-4
  c.optim.warmup_steps = 10
  c.optim.bias_update_rate = 0.0  # routing frozen after pretraining (DeepSeek-V3 sets u = 0 late)
  c.checkpoint.every_steps = 50


def get_sweep(name: str) -> list[dict]:
  """Sweeps: a list of runs, each a dict of dotted config keys -> values (absl overrides)."""
  sweeps = {
    "lr": [{"optim.peak_lr": lr, "optim.final_lr": final} for lr, final in ((3e-3, 3e-4), (1e-2, 1e-3), (3e-2, 3e-3))],
    "bias_rate": [{"optim.bias_update_rate": u} for u in (0.0, 1e-3, 1e-2)],
    "microbatches": [{"data.num_microbatches": k} for k in (1, 2, 4)],
  }
  if name not in sweeps:
    raise ValueError(f"configs/k2.py: unknown sweep {name!r}; known: {sorted(sweeps)}")
  return sweeps[name]
