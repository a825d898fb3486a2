"""The long-context stages of configs/k2.py: 32k and 128k resolve with context parallelism and YaRN, a YaRN
factor too small for the stage's length is refused, and `checkpoint.resume_from` starts a stage from the
previous stage's weights and optimizer state."""

import jax
import numpy as np
import pytest

from k2jax.model import presets
from k2jax.optim import QKClipSpec, muonclip
from k2jax.train import config as train_config
from k2jax.train import core
from tests.train import _util


@pytest.mark.parametrize("variant,seq_len,cp", [("1t_32k", 32768, 8), ("1t_128k", 131072, 32)])
def test_long_context_stages_resolve(variant, seq_len, cp):
  tc = train_config.from_config_dict(_util.k2.get_config(variant))
  assert tc.data.seq_len == seq_len and tc.data.global_batch_size * seq_len == 2**26  # K2's 67M tokens a step
  assert (tc.mesh.rules, tc.mesh.expert, tc.model.cp_gather) == ("fsdp_ep_cp", cp, "latent")
  rope = tc.model.rope
  assert (rope["factor"], rope["original_max_position_embeddings"], rope["mscale_all_dim"]) == (32.0, 4096, 1.0)
  assert tc.model.max_position_embeddings == 131072
  # v5p-1024 (512 devices): one row per fsdp group a microbatch, 4,096 tokens per device as at 4k.
  shape = train_config.check_runtime(tc, 512, 1)
  rows = tc.data.global_batch_size // tc.data.num_microbatches // shape["fsdp"]
  assert rows * seq_len // shape["expert"] == 4096


def test_yarn_factor_short_of_the_stage_length_is_refused():
  c = _util.k2.get_config("1t_128k")
  c.model.rope_factor = 8.0  # 8 x 4096 = 32768 < 131072
  with pytest.raises(train_config.ConfigError, match=r"data.seq_len: 131072 is past YaRN's reach: factor 8.0"):
    train_config.from_config_dict(c)
  c = _util.k2.get_config("tiny")
  c.model.rope_factor = 4.0
  with pytest.raises(train_config.ConfigError, match="rope_factor: preset 'tiny' has rope_scaling type 'default'"):
    train_config.from_config_dict(c)


def test_resume_from_carries_weights_and_optimizer_state_into_a_new_layout(tmp_path):
  cfg = presets.get("tiny", num_hidden_layers=2)
  opt = muonclip(1e-2, qk_clip_spec=QKClipSpec.from_config(cfg))
  common = dict(init_from="", read_budget_bytes=1 << 30, keep=1, async_save=False, on_unreadable="error")
  src = core.build(cfg, opt, mesh_shape={"fsdp": 8}, preset="fsdp", seed=0, workdir=str(tmp_path / "w4k"), **common)
  # A state that has trained: moved weights and non-zero moments, step 7.
  moved = jax.tree.map(lambda x: x + 0.5 if np.issubdtype(x.dtype, np.floating) else x + 1, src.state)
  moved = moved._replace(step=src.state.step + 7)
  src.ckpt.save(7, moved, None, {})
  src.ckpt.wait()
  dst = core.build(
    cfg,
    opt,
    mesh_shape={"fsdp": 2, "expert": 4},
    preset="fsdp_ep_cp",
    seed=1,
    workdir=str(tmp_path / "w32k"),
    resume_from=str(tmp_path / "w4k"),
    **common,
  )
  assert dst.restored_step is None and int(dst.state.step) == 0  # the stage's own schedule starts at 0
  for want, got in zip(jax.tree.leaves((moved.params, moved.bias, moved.opt_state)), jax.tree.leaves(dst.state[1:4])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(FileNotFoundError, match="resume_from: no checkpoint"):
    core.build(
      cfg,
      opt,
      mesh_shape={"fsdp": 8},
      preset="fsdp",
      seed=0,
      workdir=str(tmp_path / "w2"),
      resume_from=str(tmp_path / "empty"),
      **common,
    )


def test_context_degree_that_does_not_split_the_sequence_is_refused():
  c = _util.k2.get_config("1t_32k")
  c.data.seq_len = 4096 + 8  # not divisible by 2 x 8
  tc = train_config.from_config_dict(c)
  with pytest.raises(train_config.ConfigError, match=r"data.seq_len: 4104 is not divisible by 2 x the context"):
    train_config.check_runtime(tc, 512, 1)
