"""SFT: `sft_tiny` starts from a workdir's weights (`checkpoint.init_from`) and trains on chats with
the loss on assistant tokens only."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from k2jax.convert import workdir as wd
from k2jax.data import BUNDLED_CORPUS
from k2jax.model import K2Model, presets
from k2jax.train import loop
from tests.train import _util


def _chats(path, n=24):
  with open(BUNDLED_CORPUS) as f:
    texts = [json.loads(line)["text"] for line, _ in zip(f, range(n))]
  with open(path, "w") as f:
    for t in texts:
      msgs = [{"role": "user", "content": "Summarise: " + t[:200]}, {"role": "assistant", "content": t[:120]}]
      f.write(json.dumps({"messages": msgs}) + "\n")


@pytest.mark.slow
def test_sft_from_pretrained_workdir(tmp_path):
  base = str(tmp_path / "base")
  cfg = presets.get("tiny", num_hidden_layers=2)  # differs from the sft config's preset
  state = nnx.to_pure_dict(nnx.state(K2Model(cfg, rngs=nnx.Rngs(7))))
  wd.save_model_only(cfg, state, base)
  chats = str(tmp_path / "chats.jsonl")
  _chats(chats)
  c = _util.k2.get_config("sft_tiny")
  c.log.progress, c.log.tensorboard = False, False
  c.steps, c.log.every_steps = 3, 1
  c.checkpoint.init_from, c.data.path = base, chats
  c.log.spike_factor, c.log.spike_window = 0.5, 1  # every step after the first is a "spike"
  out = loop.run(c, str(tmp_path / "sft"))
  assert out["step"] == 3 and np.isfinite(out["loss"])
  assert wd.read_model_config(str(tmp_path / "sft")).num_hidden_layers == 2  # architecture from init_from
  rows = _util.metrics(str(tmp_path / "sft"))
  tokens_per_step = c.data.global_batch_size * c.data.seq_len
  assert all(0 < r["tokens"] < 0.8 * tokens_per_step for r in rows)  # assistant tokens only
  with open(os.path.join(str(tmp_path / "sft"), "spikes.process0.jsonl")) as f:
    spikes = [json.loads(line) for line in f]
  assert [s["step"] for s in spikes] == [2, 3]
  assert all(len(s["batch_fingerprint"]) == 12 and "parent" in s["data_state_before"] for s in spikes)
  with pytest.raises(Exception, match="data.path"):
    c2 = _util.k2.get_config("sft_tiny")
    loop.run(c2, str(tmp_path / "nodata"))
