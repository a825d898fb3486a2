"""Held-out loss of pretraining and SFT (`eval.*`): token-weighted loss, perplexity and bits-per-byte,
overall and per held-out source.

One jitted eval step, `eval_step(params, bias, batch) -> ce_BT`, runs the model's forward on the train
step's mesh with the state's own shardings (params / bias as training holds them, the batch sharded on rows
like training batches) and returns the masked per-token cross entropy, replicated; it is compiled once: every
held-out batch has the same shape (`k2jax.data.heldout`: the last partial batch is padded with zero-weight
rows). The host sums per source in float64, in batch order: the numbers depend only on the weights and the
held-out files, not on resumes or process counts (every process builds the same global batches and feeds its
own rows).

  loss       = sum(ce over loss tokens) / tokens                        (nats per token)
  perplexity = exp(loss)
  bpb        = sum(ce) / (bytes * ln 2)                                 (bits per UTF-8 byte)
where `bytes` counts the UTF-8 bytes of the loss tokens' text (`heldout.token_bytes`: the targets' token
bytes; special tokens such as EOS or <|im_end|> have none).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from k2jax import distributed
from k2jax.data import heldout as data_heldout
from k2jax.data.sources import HoldoutSplit, SourceSpec
from k2jax.train import inputs
from k2jax.train.step import MODEL_INPUTS, ModelDef

PREFIX = "eval"


def make_eval_step(mdef: ModelDef):
  """The pure eval step: masked next-token cross entropy per token (float32 [B, T]), the train step's loss
  before its sum."""

  def eval_step(params: dict, bias: dict, batch: dict) -> jax.Array:
    model = mdef.bind(params, bias)
    out = model(*(batch[k] for k in MODEL_INPUTS))
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(out.logits.astype(jnp.float32), batch["targets"])
    return ce_BT * batch["loss_mask"].astype(jnp.float32)

  return eval_step


@dataclasses.dataclass
class Totals:
  """One source's sums over its evaluated batches."""

  loss_sum: float = 0.0  # nats
  tokens: int = 0
  bytes: int = 0
  batches: int = 0

  def add(self, ce_BT: np.ndarray, mask_BT: np.ndarray, bytes_BT: np.ndarray) -> None:
    m = mask_BT.astype(bool)
    self.loss_sum += float(np.sum(ce_BT[m], dtype=np.float64))
    self.tokens += int(m.sum())
    self.bytes += int(bytes_BT[m].sum())
    self.batches += 1


def summarize(totals: dict[str, Totals]) -> dict[str, float | int]:
  """`eval/{loss,perplexity,bpb,tokens,bytes}` over all sources (token-weighted) and `eval/<source>/...`."""
  out: dict[str, float | int] = {}
  every = Totals()
  for name, t in totals.items():
    out.update(_keys(f"{PREFIX}/{name}", t))
    every.loss_sum += t.loss_sum
    every.tokens += t.tokens
    every.bytes += t.bytes
    every.batches += t.batches
  out.update(_keys(PREFIX, every))
  return out


def _keys(prefix: str, t: Totals) -> dict[str, float | int]:
  loss = t.loss_sum / t.tokens if t.tokens else float("nan")
  return {
    f"{prefix}/loss": loss,
    f"{prefix}/perplexity": math.exp(loss) if loss < 700 else float("inf"),
    f"{prefix}/bpb": t.loss_sum / (t.bytes * math.log(2)) if t.bytes else float("nan"),
    f"{prefix}/tokens": t.tokens,
    f"{prefix}/bytes": t.bytes,
    f"{prefix}/batches": t.batches,
  }


def sources_for(spec, data_path: str) -> tuple[data_heldout.HeldoutSource, ...]:
  """The held-out sources of an `eval.*` spec: `eval.path`'s files, or `eval.fraction` of `data.path`."""
  if spec.path:
    return data_heldout.parse_sources(spec.path)
  return data_heldout.split_sources((SourceSpec(data_path),), holdout_split(spec))


def holdout_split(spec) -> HoldoutSplit | None:
  """The split training must skip (None when the held-out set is its own files, or there is none)."""
  return HoldoutSplit(spec.fraction, spec.seed) if spec.fraction > 0 else None


class Evaluator:
  """Held-out loss of a TrainState's weights on `layout`'s mesh (a `k2jax.train.core.Layout`)."""

  def __init__(
    self,
    sources: tuple[data_heldout.HeldoutSource, ...],
    layout,
    *,
    kind: str,
    seq_len: int,
    rows: int,
    tokenizer_path: str,
    max_batches: int = 0,
  ):
    if not sources:
      raise ValueError("Evaluator: no held-out sources")
    self.sources, self.layout = sources, layout
    self.kind, self.seq_len, self.rows, self.max_batches = kind, seq_len, rows, max_batches
    self.tokenizer_path = tokenizer_path
    self.token_bytes = data_heldout.token_bytes(tokenizer_path, layout.model.vocab_size)
    self.sharding = layout.batch_sharding
    self.local_rows = distributed.process_rows(rows, self.sharding)
    replicated = NamedSharding(layout.mesh, P())
    self.fn = distributed.compiled_together(jax.jit(make_eval_step(layout.mdef), out_shardings=replicated), "eval_step")

  def evaluate(self, params: dict, bias: dict) -> dict[str, float | int]:
    """`summarize` of every source's held-out batches (the first `max_batches` of each; 0 = all)."""
    totals = {}
    for src in self.sources:
      t = totals[src.name] = Totals()
      pending = None  # batch k's result is read after batch k+1 is dispatched: the host packs while it runs
      for batch in self.batches(src):
        out = self._dispatch(params, bias, batch)
        if pending is not None:
          self._add(t, *pending)
        pending = (out, batch)
      if pending is not None:
        self._add(t, *pending)
    return summarize(totals)

  def _add(self, t: Totals, out: jax.Array, batch: dict) -> None:
    t.add(np.asarray(out.addressable_data(0)), batch["loss_mask"], self.token_bytes[batch["targets"]])

  def batches(self, src: data_heldout.HeldoutSource):
    """`src`'s global held-out batches (numpy, every row)."""
    return data_heldout.batches(
      src,
      kind=self.kind,
      seq_len=self.seq_len,
      rows=self.rows,
      tokenizer_path=self.tokenizer_path,
      max_batches=self.max_batches,
    )

  def ce(self, params: dict, bias: dict, batch: dict) -> np.ndarray:
    """Masked per-token cross entropy of one global batch (float32 [rows, T], on every process)."""
    return np.asarray(self._dispatch(params, bias, batch).addressable_data(0))

  def _dispatch(self, params: dict, bias: dict, batch: dict) -> jax.Array:
    local = {k: v[self.local_rows] for k, v in batch.items()}
    with self.layout.use():
      return self.fn(params, bias, inputs.to_global(local, self.sharding, self.rows))
