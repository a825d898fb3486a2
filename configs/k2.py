"""Kimi K2 pretraining / SFT configs: `tiny` (CPU demo), `small` (one accelerator), `1t` (the K2 recipe),
`sft_tiny` (chat fine-tuning of a tiny workdir), `recipe_pretrain` and `recipe_sft` (the first two stages of
docs/pretraining.md "The whole recipe", scripts/recipe.sh).

  python launch/train.py --config=configs/k2.py:tiny --workdir=/tmp/k2tiny
  python launch/train.py --config=configs/k2.py:tiny --workdir=W --config.steps=50 --config.optim.peak_lr=3e-3
  python launch/train.py --config=configs/k2.py:1t --dry_run            # counts + memory plan, no allocation
  python launch/train.py --config=configs/k2.py:1t_32k --workdir=W32 --config.checkpoint.resume_from=W4k
  python launch/train.py --config=configs/k2.py:tiny --workdir=W --config.eval.fraction=0.02 --config.eval.every_steps=50
  python launch/sweep.py --config=configs/k2.py:tiny --sweep=lr --workdir=/tmp/sweeps
  python launch/train.py --config=configs/k2.py:sft_tiny --workdir=W --config.model.expert_qat=int4  # INT4 QAT (docs/int4.md)

Every knob is declared once, in `k2jax.train.config` (default, type, one-line doc, check): `_base()` is
those defaults as a ConfigDict and each preset below only changes fields; `from_config_dict` turns the
ConfigDict into the frozen dataclasses at the `run()` boundary. `model.*` fields left at None take the
preset's value. `eval.*` (off in every preset) adds held-out loss, perplexity and bits-per-byte, overall and
per source (k2jax.train.heldout), on its own files or a hash-of-record-id split of data.path; `eval.tasks`
(or `eval.tasks_file`) adds benchmark tasks run at the same steps through the eval runner (docs/pretraining.md).
"""

import os

from ml_collections import config_dict

from k2jax.train import config as train_config

VARIANTS = (
  "tiny",
  "small",
  "1t",
  "1t_32k",
  "1t_128k",
  "1t_multislice",
  "1t_pipeline",
  "sft_tiny",
  "recipe_pretrain",
  "recipe_sft",
)
RECIPE_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "recipe")

# K2 (arXiv 2507.20534 §2.5): 2^26 = 67M tokens per step, 10T tokens constant LR then 5.5T cosine.
_K2_BATCH_SEQS = 16384  # x 4096 tokens = 2^26
_K2_STEPS = round(15.5e12 / 2**26)


def get_config(arg: str = "tiny") -> config_dict.ConfigDict:
  """The config for `arg` in VARIANTS (locked: an unknown `--config.x` fails naming the key)."""
  if arg not in VARIANTS:
    raise ValueError(f"configs/k2.py: unknown variant {arg!r}; choose one of {VARIANTS}")
  c = _base()
  presets = {"tiny": _tiny, "small": _small, "1t": _k2_1t, "1t_32k": _k2_1t_32k, "1t_128k": _k2_1t_128k}
  presets.update({"1t_multislice": _k2_1t_multislice, "1t_pipeline": _k2_1t_pipeline, "sft_tiny": _sft_tiny})
  presets.update(recipe_pretrain=_recipe_pretrain, recipe_sft=_recipe_sft)
  presets[arg](c)
  c.lock()
  return c


def _base() -> config_dict.ConfigDict:
  return train_config.config_dict()  # k2jax/train/config.py declares every key, its default and doc


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


def _k2_long_context(c, seq_len: int, cp: int):
  """A long-context stage of `1t`: the same 2^26 tokens per step in fewer, longer rows, the sequence sharded
  over the expert axis (context parallelism, `fsdp_ep_cp`: every EP device holds 1/cp of each row), so each
  device still holds 4,096 tokens per microbatch as at 4k. Start it from the 4k run's newest checkpoint
  with its optimizer state: `--config.checkpoint.resume_from=<4k workdir>` (docs/long-context.md)."""
  _k2_1t(c)
  c.data.seq_len = seq_len
  c.data.global_batch_size = 2**26 // seq_len
  c.data.num_microbatches = 32  # 64 rows a microbatch = one row per fsdp group
  c.mesh.rules = "fsdp_ep_cp"
  c.mesh.expert = cp
  c.model.cp_gather = "latent"  # model/mla.py: 28.6x fewer gathered bytes than per-head K/V
  c.model.rope_factor = 32.0  # YaRN over original_max_position_embeddings 4096 (released config.json)
  c.optim.warmup_steps = 0
  c.optim.decay_fraction = 1.0
  c.checkpoint.every_steps = 100


def _k2_1t_32k(c):
  """K2 §2.5's long-context activation: 60B tokens at 32k with LR 2e-5 -> 7e-6."""
  _k2_long_context(c, 32768, cp=8)
  c.steps = round(60e9 / 2**26)  # 894
  c.optim.peak_lr = 2e-5
  c.optim.final_lr = 7e-6


def _k2_1t_128k(c):
  """The YaRN extension to 128k (factor 32 over 4096: K2 §2.5 names no 128k training stage; this one is
  short, 10B tokens, at the 32k stage's final LR). CP 32 x FSDP 16 on v5p-1024: 384 / 32 = 12 experts a device."""
  _k2_long_context(c, 131072, cp=32)
  c.steps = round(10e9 / 2**26)  # 149
  c.optim.peak_lr = 7e-6
  c.optim.final_lr = 7e-6


def _k2_1t_multislice(c):
  """1t on two v5p-1024 slices over DCN: only data parallelism (and so the gradient reduction) crosses slices;
  EP 8 x FSDP 64 inside each slice, as `1t` on one. Half the microbatches: each slice takes half the batch."""
  _k2_1t(c)
  c.mesh.dcn_data = 2
  c.data.num_microbatches = 16


def _k2_1t_pipeline(c):
  """1t with the 60 MoE layers in a 4-stage circular pipeline (15 repeats of one layer per stage, 4 microbatches:
  bubble 3/63 = 4.8%), EP 8 inside each stage, FSDP over the rest: the GPU-cluster layout (stages across
  nodes, EP inside a node), here on 512 devices. The dense first layer, embedding and head run outside.
  XLA:TPU's compile for v5p-1024 puts the peak at 71.1 GiB a device; with 8 pipeline microbatches of 16
  passes it needed 104.4 GiB of 95.7 (docs/pipelines-and-multislice.md)."""
  _k2_1t(c)
  c.mesh.stage = 4
  c.pipeline.repeats = 15
  c.pipeline.microbatches = 4
  c.data.num_microbatches = 32  # 512 rows per pass, 128 per pipeline microbatch: one per batch shard


def _sft_tiny(c):
  _tiny(c)
  c.steps = 100
  c.data.kind = "sft"
  c.model.expert_qat = "none"  # "int4": train on the INT4 release's grid (routed experts only; docs/int4.md)
  c.data.seq_len = 128
  c.data.global_batch_size = 8
  c.optim.peak_lr = 3e-3
  c.optim.final_lr = 3e-4
  c.optim.warmup_steps = 10
  c.optim.bias_update_rate = 0.0  # routing frozen after pretraining (DeepSeek-V3 sets u = 0 late)
  c.checkpoint.every_steps = 50


def _recipe_pretrain(c):
  """Stage 1 of the learning recipe: the tiny model briefly on the bundled corpus (language, not the task)."""
  _tiny(c)
  c.steps = 150
  c.checkpoint.every_steps = 150
  c.log.tensorboard = False


def _recipe_sft(c):
  """Stage 2: SFT from stage 1 (`--config.checkpoint.init_from=PRETRAIN_WORKDIR`) on the recipe task's chats
  (data/recipe/sft_train.jsonl, scripts/recipe_data.py; no held-out prompt in it). Short on purpose: the SFT
  model is partly right, so what RL adds on the held-out split is measurable."""
  _sft_tiny(c)
  c.data.path = os.path.join(RECIPE_DATA, "sft_train.jsonl")
  c.steps = 75  # held-out pass@1 measured on a 2-core CPU: 0.61 after 60 steps, 0.90 after 75, 0.995 after 200
  c.checkpoint.every_steps = 75
  c.log.tensorboard = False


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
