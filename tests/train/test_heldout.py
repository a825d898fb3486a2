"""Held-out loss (`eval.*`, k2jax.train.heldout): equals a numpy computation over a plain forward's logits,
bits-per-byte by hand, one compilation, a split training never reads. Identical numbers after a SIGKILL + resume
are tests/train/test_resume.py's, on 1 vs 2 processes tests/train/test_multihost.py's (their runs evaluate too)."""

import json
import math

import jax
import numpy as np
import pytest

from k2jax import sharding
from k2jax.data import PretrainDataConfig, SourceSpec, make_pretrain_iter
from k2jax.data import heldout as data_heldout
from k2jax.data.sources import HoldoutSplit, heldout_ids
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer
from k2jax.train import core, heldout, inputs, loop
from k2jax.train.config import from_config_dict
from tests.train import _util

SEQ, ROWS = 64, 8
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _texts(n: int, seed: int) -> list[str]:
  """Short ASCII documents (under SEQ tokens: each is one packed segment, its first token never a target)."""
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))) + f" {i}." for i in range(n)]


def _write(path, texts):
  with open(path, "w") as f:
    for t in texts:
      f.write(json.dumps({"text": t}) + "\n")
  return str(path)


def _core(tmp_path, **overrides):
  tc = from_config_dict(_util.tiny_config(**{"data.seq_len": SEQ, "data.global_batch_size": ROWS, **overrides}))
  optimizer, _ = loop.make_optimizer(tc)
  c = core.build(
    tc.model,
    optimizer,
    mesh_shape=sharding.resolve_mesh_shape({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1}, jax.device_count()),
    preset="fsdp",
    seed=3,
    init_from="",
    read_budget_bytes=1 << 30,
    workdir=str(tmp_path / "w"),
    keep=1,
    async_save=False,
    on_unreadable="error",
  )
  return tc, c


@pytest.mark.slow
def test_loss_equals_numpy_over_plain_forward_and_bpb_by_hand(tmp_path):
  a = _write(tmp_path / "a.jsonl", _texts(40, 0))
  b = _write(tmp_path / "b.jsonl", _texts(9, 1))
  tc, c = _core(tmp_path, **{"eval.path": f"first={a},{b}"})
  ev = loop.make_evaluator(tc, c)
  assert [s.name for s in ev.sources] == ["first", "b"]

  # One batch: the eval step's per-token cross entropy == numpy's over the logits of a plain (unsharded,
  # unjitted) forward of the same weights.
  batch = next(iter(ev.batches(ev.sources[0])))
  got_BT = ev.ce(c.state.params, c.state.bias, batch)
  model = c.mdef.bind(jax.device_get(c.state.params), jax.device_get(c.state.bias))
  logits = np.asarray(model(batch["input_ids"], batch["segment_ids"], batch["positions"]).logits, np.float64)
  m = logits.max(-1, keepdims=True)
  lse_BT = (m[..., 0] + np.log(np.exp(logits - m).sum(-1))).astype(np.float64)
  ce_BT = lse_BT - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
  want_BT = ce_BT * batch["loss_mask"]
  assert batch["loss_mask"].sum() > 100
  np.testing.assert_allclose(got_BT, want_BT, rtol=2e-5, atol=2e-5)

  # All batches of both sources: token-weighted loss, perplexity, bpb by hand.
  rec = ev.evaluate(c.state.params, c.state.bias)
  tok = load_tokenizer(BUNDLED_TOKENIZER)
  overall_loss, overall_tokens, overall_bytes = 0.0, 0, 0
  for src, texts in ((ev.sources[0], _texts(40, 0)), (ev.sources[1], _texts(9, 1))):
    loss_sum, tokens = 0.0, 0
    for bt in ev.batches(src):
      ce = ev.ce(c.state.params, c.state.bias, bt)
      loss_sum += float(np.sum(ce, dtype=np.float64))
      tokens += int(bt["loss_mask"].sum())
    # Every document's tokens + EOS, minus the first (never a target); the EOS has no bytes.
    assert tokens == sum(len(tok.encode(t)) for t in texts)
    n_bytes = sum(len(t.encode()) - len(tok.decode(tok.encode(t)[:1]).encode()) for t in texts)
    p = f"eval/{src.name}"
    assert rec[f"{p}/tokens"] == tokens and rec[f"{p}/bytes"] == n_bytes
    assert rec[f"{p}/loss"] == pytest.approx(loss_sum / tokens, rel=1e-12)
    assert rec[f"{p}/perplexity"] == pytest.approx(math.exp(loss_sum / tokens), rel=1e-12)
    assert rec[f"{p}/bpb"] == pytest.approx(loss_sum / tokens * tokens / (n_bytes * math.log(2)), rel=1e-12)
    overall_loss, overall_tokens, overall_bytes = (
      overall_loss + loss_sum,
      overall_tokens + tokens,
      overall_bytes + n_bytes,
    )
  assert rec["eval/loss"] == pytest.approx(overall_loss / overall_tokens, rel=1e-12)
  assert rec["eval/bpb"] == pytest.approx(overall_loss / (overall_bytes * math.log(2)), rel=1e-12)
  assert 0 < rec["eval/bpb"] < rec["eval/loss"]  # ~4 bytes per token here
  assert rec["eval/b/batches"] == 1 and rec["eval/first/batches"] >= 2  # the last one padded
  assert ev.fn._cache_size() == 1  # one compilation for every batch, padded or not

  # eval.steps bounds the batches per source; the same weights give the same numbers twice.
  ev2 = loop.make_evaluator(
    from_config_dict(
      _util.tiny_config(**{"data.seq_len": SEQ, "data.global_batch_size": ROWS, "eval.path": a, "eval.steps": 1})
    ),
    c,
  )
  r2 = ev2.evaluate(c.state.params, c.state.bias)
  assert r2["eval/batches"] == 1 and r2["eval/tokens"] == int(batch["loss_mask"].sum())
  assert r2["eval/loss"] == ev2.evaluate(c.state.params, c.state.bias)["eval/loss"]


def _ids_of(batches) -> set[int]:
  return {int(t) for b in batches for t in b["input_ids"][b["segment_ids"] > 0].ravel()}


def test_no_heldout_record_reaches_training(tmp_path):
  n, base = 300, 100  # record i is `input_ids = [base + i] * 3` (+ EOS): its id is its tokens
  path = tmp_path / "ids.jsonl"
  with open(path, "w") as f:
    for i in range(n):
      f.write(json.dumps({"input_ids": [base + i] * 3}) + "\n")
  tc = from_config_dict(_util.tiny_config(**{"data.path": str(path), "eval.fraction": 0.1, "eval.seed": 5}))
  split = heldout.holdout_split(tc.eval)
  held = {base + i for i in heldout_ids(n, split)}
  assert 15 < len(held) < 45
  eos = load_tokenizer(BUNDLED_TOKENIZER).eos_id

  # The held-out batches hold exactly the held-out records.
  (src,) = heldout.sources_for(tc.eval, tc.data.path)
  assert (
    _ids_of(data_heldout.batches(src, kind="pretrain", seq_len=64, rows=4, tokenizer_path=BUNDLED_TOKENIZER)) - {eos}
    == held
  )

  # The training iterator of the run (inputs.make_iterator with the split), over ~8 epochs (packing bins hold
  # records back): every
  # training record, and no held-out one.
  it = inputs.make_iterator(tc.data, tc.model.vocab_size, holdout=split)
  seen = _ids_of(next(it) for _ in range(8 * n * 4 // (tc.data.global_batch_size * tc.data.seq_len))) - {eos}
  assert not seen & held
  assert seen == set(range(base, base + n)) - held
  # One epoch on 2 processes: disjoint per process, together all training records, none held out.
  cfg = PretrainDataConfig(sources=(SourceSpec(str(path)),), seq_len=64, batch_size=4, num_epochs=1, holdout=split)
  per = [_ids_of(make_pretrain_iter(cfg, process_index=p, process_count=2)) - {eos} for p in range(2)]
  assert not per[0] & per[1] and per[0] | per[1] == set(range(base, base + n)) - held
  # The split is a pure function of (record id, seed): pinned, so no version quietly re-deals it.
  assert heldout_ids(1000, HoldoutSplit(0.01, 0)).tolist() == PINNED_SPLIT


PINNED_SPLIT = [196, 295, 472, 558, 663, 689, 710, 963, 975, 976, 992]


EVAL_KEYS = lambda r: {k: v for k, v in r.items() if k.startswith("eval/") and k != "eval/seconds"}  # noqa: E731


def _evals(workdir):
  return [r for r in _util.metrics(workdir) if "eval/loss" in r]


@pytest.mark.slow
def test_sft_heldout_counts_assistant_tokens_and_bytes(tmp_path):
  from k2jax.data.sft import render_chat

  chats = []
  for i, t in enumerate(_texts(12, 2)):
    chats.append({"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": t}]})
  path = tmp_path / "chats.jsonl"
  with open(path, "w") as f:
    f.writelines(json.dumps(c) + "\n" for c in chats)
  tc, c = _core(tmp_path, **{"data.kind": "sft", "data.seq_len": 128, "eval.path": str(path)})
  ev = loop.make_evaluator(tc, c)
  rec = ev.evaluate(c.state.params, c.state.bias)
  tok = load_tokenizer(BUNDLED_TOKENIZER)
  masks = [render_chat(ch["messages"], None, tokenizer=tok)[1] for ch in chats]
  assert rec["eval/tokens"] == sum(sum(m) for m in masks)  # assistant tokens only (never a row's first)
  # The assistant content's bytes; the template's closing <|im_end|> is a special token (no bytes).
  assert rec["eval/bytes"] == sum(len(ch["messages"][1]["content"].encode()) for ch in chats)
  loss_sum = sum(
    float(np.sum(ev.ce(c.state.params, c.state.bias, b), dtype=np.float64)) for b in ev.batches(ev.sources[0])
  )
  assert rec["eval/loss"] == pytest.approx(loss_sum / rec["eval/tokens"], rel=1e-12)
  assert rec["eval/bpb"] == pytest.approx(loss_sum / (rec["eval/bytes"] * math.log(2)), rel=1e-12)


@pytest.mark.parametrize(
  "overrides, key",
  [
    ({"eval.path": "x.jsonl", "eval.fraction": 0.1}, "eval.fraction"),
    ({"eval.fraction": 1.0}, "eval.fraction"),
    ({"eval.every_steps": 10}, "eval.every_steps"),
    ({"eval.at_start": True}, "eval.at_start"),
    ({"eval.steps": -1, "eval.fraction": 0.1}, "eval.steps"),
  ],
)
def test_bad_eval_config_names_the_key(overrides, key):
  from k2jax.model.config import ConfigError

  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    from_config_dict(_util.tiny_config(**overrides))


def test_missing_heldout_file_names_eval_path(tmp_path):
  from k2jax.model.config import ConfigError
  from k2jax.train.config import check_runtime

  tc = from_config_dict(_util.tiny_config(**{"eval.path": f"a={tmp_path}/none.jsonl"}))
  with pytest.raises(ConfigError, match=r"eval\.path.*none\.jsonl"):
    check_runtime(tc, 8, 1)
  assert not from_config_dict(_util.tiny_config()).eval.enabled  # presets: eval off


@pytest.mark.slow
@pytest.mark.parametrize("rules, axes", [("fsdp_ep", {"expert": 4}), ("fsdp_ep_tp", {"expert": 2, "tensor": 2})])
def test_eval_on_expert_and_tensor_parallel_meshes_matches_fsdp(tmp_path, rules, axes):
  """The eval step runs on the training mesh of any rules preset (EP all-to-all, TP-sharded weights)."""
  over = {"data.seq_len": SEQ, "data.global_batch_size": ROWS, "eval.fraction": 0.02, "eval.steps": 2}
  tc = from_config_dict(_util.tiny_config(**over))
  optimizer, _ = loop.make_optimizer(tc)
  got = {}
  for name, extra in (("fsdp", {}), (rules, axes)):
    c = core.build(
      tc.model,
      optimizer,
      mesh_shape=sharding.resolve_mesh_shape({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1, **extra}, 8),
      preset=name,
      seed=3,
      init_from="",
      read_budget_bytes=1 << 30,
      workdir=str(tmp_path / name),
      keep=1,
      async_save=False,
      on_unreadable="error",
    )
    got[name] = loop.make_evaluator(tc, c).evaluate(c.state.params, c.state.bias)
  assert got["fsdp"]["eval/tokens"] == got[rules]["eval/tokens"] > 500
  assert got[rules]["eval/loss"] == pytest.approx(got["fsdp"]["eval/loss"], rel=1e-6)
